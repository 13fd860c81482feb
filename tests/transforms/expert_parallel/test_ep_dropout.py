"""sw.expert_parallel with dropout, equal to the single-device step in float64.

Each rank draws its own masks (per-rank streams, as under data parallel), so a plain single-device
step draws others. The reference here replays the ranks' masks: every call of ``F.dropout`` (before
and after each MoE block, on the attention's output, in HF Mixtral's attention weights) is recorded
on every rank, and the single-device step's same call gets the ranks' masks joined in batch order
(the batch is cut over dp, then ep). So the check is exact: the distributed step applied each mask
to the tokens it was drawn for, in forward and in backward (remat: recomputed alike), and routed,
dispatched and combined them as one device does. Replaying the masks in another order fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.testing.equivalence import NotEquivalentError, compare_histories, record_history
from shardwise.testing.models import MoEBlock

from .test_ep_step import batches

_ORIGINAL = F.dropout


class Masks:
    """Records each rank's dropout masks in call order, or replays given ones (F.dropout patched)."""

    def __init__(self) -> None:
        self.drawn: dict[int, list[torch.Tensor]] = {}
        self.recomputed: dict[int, list[torch.Tensor]] = {}  # remat's, in backward
        self.replay: list[torch.Tensor] | None = None
        self.lock = threading.Lock()
        self.inside = threading.local()

    def dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0 or isinstance(x, torch._subclasses.FakeTensor) or x.device.type == "meta":
            return _ORIGINAL(x, p, training, inplace)  # functionalize's capture and the Plan's prediction
        if getattr(self.inside, "call", False):
            # Under a TorchFunctionMode (a step's first-call watch), torch hands _ORIGINAL's call to the mode as
            # F.dropout, the name patched here: this method again, from inside itself. One mask per call.
            return _ORIGINAL(x, p, training, inplace)
        self.inside.call = True
        try:
            return self._dropout(x, p)
        finally:
            self.inside.call = False

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if self.replay is not None:
            return x * self.replay.pop(0)
        mask = _ORIGINAL(torch.ones_like(x), p, True)
        into = self.recomputed if torch._C._current_graph_task_id() != -1 else self.drawn
        with self.lock:
            into.setdefault(current_backend().rank, []).append(mask.detach().clone())
        return x * mask

    def joined(self, mesh: sw.Mesh, order: tuple[str, ...]) -> list[torch.Tensor]:
        """Per call, the ranks' masks joined along the batch in the order the step cut it (``order``'s axes)."""
        ranks = sorted(self.drawn, key=lambda r: tuple(mesh.coords_of(r)[a] for a in order))
        calls = {len(self.drawn[r]) for r in ranks}
        assert len(ranks) == mesh.size and len(calls) == 1, {r: len(m) for r, m in self.drawn.items()}
        return [torch.cat([self.drawn[r][i] for r in ranks]) for i in range(calls.pop())]


@pytest.fixture
def masks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Masks]:
    recorder = Masks()
    monkeypatch.setattr(F, "dropout", recorder.dropout)
    yield recorder


class DropMoEBlock(MoEBlock):
    """MoEBlock with dropout on the attention's output, the MoE's input and the MoE's output."""

    def __init__(self, *args: Any, p: float = 0.3) -> None:
        super().__init__(*args)
        self.drop_attn, self.drop_in, self.drop_out = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.ln1(x)))
        return x + self.drop_out(self.moe(self.drop_in(self.ln2(x))))


def drop_moe_model() -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.2), DropMoEBlock(8, 2, 4, 4, 2), DropMoEBlock(8, 2, 4, 4, 1), nn.Linear(8, 3)
    ).double()
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def run(masks: Masks, composed: sw.Step, mesh: sw.Mesh, data: list[Any], params: Any,
        seeds: Callable[[int], int] = lambda rank: 0) -> list[Any]:
    """Every rank's history of ``composed`` on ``mesh`` (rank r seeded ``seeds(r)``), its masks recorded."""
    masks.drawn.clear()
    masks.recomputed.clear()

    def program() -> Any:
        return record_history(composed, composed.init(params, mesh, seed=seeds(mesh.rank)), data)

    return sw.launch(program, mesh.size, timeout=120)


def compare(masks: Masks, per_rank: list[Any], reference: sw.Step, mesh: sw.Mesh, data: list[Any], params: Any,
            order: tuple[str, ...]) -> Any:
    """``reference`` on one device with the ranks' masks replayed, against ``per_rank``: as
    assert_equivalent compares (its float64 default)."""
    masks.replay = masks.joined(mesh, order)
    try:
        expected = record_history(reference, reference.init(params), data)
        assert masks.replay == [], f"{len(masks.replay)} masks left: the reference drew fewer than the ranks"
    finally:
        masks.replay = None
    return compare_histories(per_rank, expected, rtol=sw.testing.DEFAULT_RTOL[torch.float64])


def check(masks: Masks, composed: sw.Step, reference: sw.Step, mesh: sw.Mesh, data: list[Any], params: Any,
          order: tuple[str, ...], seeds: Callable[[int], int] = lambda rank: 0) -> Any:
    return compare(masks, run(masks, composed, mesh, data, params, seeds), reference, mesh, data, params, order)


@pytest.mark.parametrize(
    ("stack", "mesh", "order"),
    [("ep", sw.Mesh(ep=2), ("ep",)), ("ep", sw.Mesh(ep=4), ("ep",)),
     ("dp x ep zero3", sw.Mesh(dp=2, ep=2), ("dp", "ep")), ("ep remat", sw.Mesh(ep=2), ("ep",))],
    ids=["ep2", "ep4", "dp2xep2-zero3", "ep2-remat"],
)
def test_ep_with_dropout_equals_the_single_device_step_with_the_ranks_masks(
    masks: Masks, stack: str, mesh: sw.Mesh, order: tuple[str, ...]
) -> None:
    step, params = drop_moe_model()
    composed = sw.expert_parallel(step, "ep")
    if "zero3" in stack:
        composed = sw.shard_params(composed, "dp", 3)
    if "remat" in stack:
        composed = sw.remat(composed)
    check(masks, composed, step, mesh, batches(), params, order)
    per_rank = list(masks.drawn.values())
    assert len(per_rank[0]) == 2 * 7  # 2 steps x (1 + 2 blocks x 3) dropouts
    assert all(not torch.equal(per_rank[0][0], m[0]) for m in per_rank[1:]), "each rank draws its own stream"
    if "remat" in stack:  # backward recomputed each layer (last first) with the forward's masks
        for rank, again in masks.recomputed.items():
            matched = {next((i for i, m in enumerate(masks.drawn[rank]) if torch.equal(m, a)), None) for a in again}
            assert len(again) == len(per_rank[0]) and None not in matched and len(matched) == len(again), rank
    else:
        assert not masks.recomputed


def test_masks_replayed_on_the_wrong_tokens_or_from_another_seed_fail(masks: Masks) -> None:
    """The check can fail: the ranks' masks joined in the wrong order are not the computation that
    ran, nor are another seed's masks; a rank seeded unlike the others is refused by the step."""
    step, params = drop_moe_model()
    ep, mesh, data = sw.expert_parallel(step, "ep"), sw.Mesh(ep=2), batches()
    per_rank = run(masks, ep, mesh, data, params)
    drawn = {r: list(m) for r, m in masks.drawn.items()}
    assert compare(masks, per_rank, step, mesh, data, params, ("ep",)).steps == 2
    masks.drawn = {0: drawn[1], 1: drawn[0]}  # the masks on the other rank's tokens
    with pytest.raises(NotEquivalentError, match="step 1"):
        compare(masks, per_rank, step, mesh, data, params, ("ep",))

    other = run(masks, ep, mesh, data, params, seeds=lambda rank: 1)  # another seed: other masks on every rank
    assert not any(torch.equal(a, b) for r in drawn for a, b in zip(drawn[r], masks.drawn[r], strict=True))
    reseeded = masks.drawn
    masks.drawn = drawn  # the first run's masks replayed against the reseeded run
    with pytest.raises(NotEquivalentError, match="step 1"):
        compare(masks, other, step, mesh, data, params, ("ep",))
    masks.drawn = reseeded
    compare(masks, other, step, mesh, data, params, ("ep",))  # its own masks: equal again
    with pytest.raises(sw.collectives.RankFailed, match="differs from rank 0 in its seed"):
        run(masks, ep, mesh, data, params, seeds=lambda rank: rank)  # one stream per rank is the step's, not ours


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
def test_hf_mixtral_with_attention_dropout_equals_the_single_device_step(masks: Masks, stack: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, attention_dropout=0.25, attn_implementation="eager",
        experts_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = transformers.MixtralForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 6), generator=gen), torch.randint(32, (4, 6), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    ep, mesh = sw.expert_parallel(step, "ep"), sw.Mesh(ep=2)
    order: tuple[str, ...] = ("ep",)
    if stack == "dp x ep zero3":
        ep, mesh, order = sw.shard_params(ep, "dp", 3), sw.Mesh(dp=2, ep=2), ("dp", "ep")
    check(masks, ep, step, mesh, data, params, order)
    assert len(next(iter(masks.drawn.values()))) == 2 * 2  # 2 steps x 2 layers' attention weights
