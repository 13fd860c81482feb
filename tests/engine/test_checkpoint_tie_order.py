"""A tied model whose modules are registered in the other order (``head`` before ``emb``, the tie written
``emb.weight = head.weight``) names the tie by its other end; torch's ``load_state_dict`` takes either's
state_dict, and ``checkpoint.load`` resumes either from the other's checkpoint, momentum and all (before:
refused as "another model", whose advice restarted the run)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw

V, D = 16, 8
nn = torch.nn


class EmbFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))))


class HeadFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head, self.mid, self.emb = nn.Linear(D, V, bias=False), nn.Linear(D, D), nn.Embedding(V, D)
        self.emb.weight = self.head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(V, (4, 6), generator=g), torch.randint(V, (4, 6), generator=g)) for _ in range(4)]


def _step(cls: type[nn.Module], seed: int, zero: bool) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    chain, params = sw.functionalize(cls().double())
    step = sw.train_step(chain, _loss, sw.optim.adamw(1e-2))
    return (sw.shard_params(step, "dp", stage=3) if zero else step), params


def _run(save_cls: type[nn.Module], load_cls: type[nn.Module], zero: bool, path: Path) -> list[Any]:
    """On each rank: the saving model trains two steps and saves; a differently registered model (other
    seed) loads it; both take the last two steps. Their losses, and the weights, must be the same."""
    mesh = sw.Mesh(dp=2) if zero else None
    batches = _batches()
    saver, params = _step(save_cls, 0, zero)
    state = saver.init(params, mesh)
    for batch in batches[:2]:
        state, _ = saver(state, batch)
    sw.checkpoint.save(path, state, saver)
    loader, _ = _step(load_cls, 7, zero)
    resumed = sw.checkpoint.load(path, loader, mesh)
    assert resumed.step == 2
    out = []
    for batch in batches[2:]:
        state, m = saver(state, batch)
        resumed, r = loader(resumed, batch)
        out.append((float(m["loss"]), float(r["loss"])))
    a, b = sw.checkpoint.full_state_dict(saver, state), sw.checkpoint.full_state_dict(loader, resumed)
    return [out, {k: (a[k], b[k]) for k in a}]


@pytest.mark.parametrize("zero", [False, True], ids=["one-device", "zero3-dp2"])
@pytest.mark.parametrize("order", ["emb-first-saved", "head-first-saved"])
def test_a_tie_named_from_its_other_end_resumes_exactly(order: str, zero: bool, tmp_path: Path) -> None:
    save_cls, load_cls = (EmbFirst, HeadFirst) if order == "emb-first-saved" else (HeadFirst, EmbFirst)
    run = functools.partial(_run, save_cls, load_cls, zero, tmp_path / "ck")
    for losses, weights in sw.launch(run, 2) if zero else [run()]:
        assert [a for a, _ in losses] == [b for _, b in losses]
        assert sorted(weights) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
        for key, (a, b) in weights.items():
            assert torch.equal(a, b), key
        assert torch.equal(weights["emb.weight"][1], weights["head.weight"][1])  # still one tensor


def test_a_model_tied_otherwise_is_still_refused(tmp_path: Path) -> None:
    """Only the same two names tied the other way round are one tensor: a model tying ``head`` to ``mid``
    is another model."""

    class OtherTie(HeadFirst):
        def __init__(self) -> None:
            super().__init__()
            self.emb.weight = nn.Parameter(torch.randn(V, D))

    saver, params = _step(EmbFirst, 0, False)
    sw.checkpoint.save(tmp_path / "ck", saver.init(params), saver)
    other, _ = _step(OtherTie, 0, False)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"is of another model.*saved as a tie of emb\.weight"):
        sw.checkpoint.load(tmp_path / "ck", other)
