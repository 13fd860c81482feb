"""Tensor parallel's safety nets and its checkpoints.

* Every step checks over the tensor-parallel axis that the gradients of replicated
  parameters agree, and refuses to update when they do not: a replicated parameter used
  on per-rank values (inside a region the plan does not mark) would otherwise drift apart.
* Random ops draw the same streams on every tensor-parallel rank: dropout on the
  replicated residual stream agrees, so the check passes and the replicas stay equal.
* A tensor-parallel state saves its slices as boxes of the whole tensors and loads onto
  any other mesh and stack; the run goes on as if never stopped.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT

TINY = {"vocab": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "seq_len": 8}


class Gained(nn.Module):
    """A column-parallel projection, a replicated gain on its output, a row-parallel projection: the
    gain multiplies each rank's slice of the features, so each rank's gradient of it is a part."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x) * self.gain))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Gained()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Probe(nn.Module):
    """Dropout that records its mask under its name, per thread (rank)."""

    masks: ClassVar[dict[tuple[str, int], list[torch.Tensor]]] = {}

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(torch.ones_like(x), p=0.5, training=True)
        Probe.masks.setdefault((self.name, threading.get_ident()), []).append(mask.detach().clone())
        return x * mask


class MLPBlock(nn.Module):
    """Pre-norm residual MLP with dropout on the split hidden features and on the residual stream."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), Probe("hidden"), nn.Linear(16, 8))
        self.out = Probe("residual")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.mlp(self.norm(x)))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


# Not judged (sw.tp.RegionNotJudged): its Probe draws dropout masks in eval mode too (training=True)
@pytest.mark.filterwarnings("ignore::shardwise.tp.RegionNotJudged")
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_random_ops_draw_per_rank_on_per_rank_values_and_alike_on_replicated_ones(sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(Blocks().double(), units=["blocks"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    plan = {"blocks.*.mlp": sw.tp.Region(), "blocks.*.mlp.0": sw.tp.Colwise(), "blocks.*.mlp.2": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel="blocks.*" if sequence_parallel else None)
    batch = (torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64))
    Probe.masks.clear()
    _run(tp, sw.Mesh(tp=2), params, batch, steps=1)
    by_name: dict[str, list[torch.Tensor]] = {}
    for (name, _thread), masks in sorted(Probe.masks.items(), key=lambda kv: kv[0][0]):
        by_name.setdefault(name, []).append(masks[0])
    hidden, residual = by_name["hidden"], by_name["residual"]
    assert len(hidden) == len(residual) == 2  # one per rank
    assert not torch.equal(hidden[0], hidden[1])  # each rank's slice of the features: its own mask
    # The residual stream is replicated without sequence parallel (one mask, every rank), and each
    # rank's slice of the sequence with it (its own mask).
    assert torch.equal(residual[0], residual[1]) is (not sequence_parallel)


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any, steps: int = 2) -> list[Any]:
    def main() -> Any:
        state = step.init(params, mesh)
        for _ in range(steps):
            state, metrics = step(state, batch)
        return metrics, step.full_params(state)

    return sw.launch(main, mesh.size, timeout=120)


def test_a_replicated_parameter_used_on_per_rank_values_is_refused_unless_in_a_region() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(Model().double(), units=["block"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    split = {"block.up": sw.tp.Colwise(), "block.down": sw.tp.Rowwise()}
    # Without a Region the gain's gradient is each rank's part: its copies would train apart.
    with pytest.raises(sw.collectives.RankFailed, match=r"replicated parameters differ .* Region"):
        _run(sw.tensor_parallel(step, "tp", split), sw.Mesh(tp=2), params, batch)
    # In a Region it is summed over the ranks, and the step is the single-device one.
    region_step = sw.tensor_parallel(step, "tp", {"block": sw.tp.Region(), **split})
    (metrics, full), _ = _run(region_step, sw.Mesh(tp=2), params, batch)
    reference = step.init(params)
    for _ in range(2):
        reference, want = step(reference, batch)
    torch.testing.assert_close(metrics["loss"], want["loss"], rtol=1e-12, atol=0)
    torch.testing.assert_close(full["block"]["block.gain"], reference.params["block"]["block.gain"], rtol=1e-12, atol=0)


def test_the_check_passes_and_replicas_agree_with_dropout_on_the_residual_stream() -> None:
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 64, (4, 8))
    chain, params = sw.functionalize(model, units=GPT2Block)
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o.logits, y), sw.optim.sgd(0.1))
    tp = sw.tensor_parallel(step, "tp", sw.tp.gpt2_plan())
    out = _run(tp, sw.Mesh(tp=2), params, (ids, ids), steps=3)
    (m0, full0), (m1, full1) = out
    assert torch.equal(m0["loss"], m1["loss"])
    for layer in full0:
        for name in full0[layer]:
            assert torch.equal(full0[layer][name], full1[layer][name]), (layer, name)
    # Dropout did draw: the same step without it lands elsewhere.
    quiet = sw.tensor_parallel(sw.train_step(sw.functionalize(model.eval(), units=GPT2Block)[0], step.loss_fn,
                                             sw.optim.sgd(0.1)), "tp", sw.tp.gpt2_plan())
    (q0, _), _ = _run(quiet, sw.Mesh(tp=2), params, (ids, ids), steps=3)
    assert not torch.equal(q0["loss"], m0["loss"])


@pytest.mark.parametrize(
    "target",
    ["tp4", "dp2", "pp2xtp2", "single"],
)
def test_a_tensor_parallel_checkpoint_resumes_on_another_mesh(tmp_path: Path, target: str) -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(**TINY).double(), units=Block)
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y), sw.optim.sgd(0.05, momentum=0.9))
    ids = torch.randint(0, 64, (4, 8))
    batch = (ids, torch.randint(0, 64, (4, 8)))
    saver = sw.shard_params(
        sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel="blocks.*"), "dp", 3
    )
    mesh = sw.Mesh(dp=2, tp=2)
    reference = step.init(params)
    for _ in range(3):
        reference, _ = step(reference, batch)

    def save() -> None:
        state = saver.init(params, mesh)
        for _ in range(2):
            state, _ = saver(state, batch)
        sw.checkpoint.save(tmp_path / "c", state, saver)

    sw.launch(save, mesh.size, timeout=120)
    targets = {
        "tp4": (sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan()), sw.Mesh(tp=4)),
        "dp2": (sw.shard_params(step, "dp", 2), sw.Mesh(dp=2)),
        "pp2xtp2": (
            sw.pipeline(sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(vocab_parallel=False)), "pp", "gpipe", 2),
            sw.Mesh(pp=2, tp=2),
        ),
        "single": (step, None),
    }
    loader, target_mesh = targets[target]

    def resume() -> Any:
        state = sw.checkpoint.load(tmp_path / "c", loader, target_mesh)
        state, _ = loader(state, batch)
        return loader.full_params(state)

    full = resume() if target_mesh is None else sw.launch(resume, target_mesh.size, timeout=120)[0]
    for layer, tensors in reference.params.items():
        for name, want in tensors.items():
            # Each mesh sums its partial results in its own order: float64 rounding only.
            torch.testing.assert_close(full[layer][name], want, rtol=1e-12, atol=1e-14)


def test_dropout_between_split_layers_is_per_rank_and_recomputed_alike() -> None:
    # Layer "1" sits between a Colwise layer and its Rowwise layer (an nn.Sequential's children):
    # it acts on each rank's slice of the features, so it draws the rank's stream; remat replays it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 8)).double().train()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    tp = sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    batch = (torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64))
    plain = _run(tp, sw.Mesh(tp=2), params, batch, steps=3)
    rematted = _run(sw.remat(tp, sw.policies.nothing_saveable), sw.Mesh(tp=2), params, batch, steps=3)
    for (m_plain, p_plain), (m_remat, p_remat) in zip(plain, rematted, strict=True):
        assert torch.equal(m_plain["loss"], m_remat["loss"])
        for name in p_plain["0"]:
            assert torch.equal(p_plain["0"][name], p_remat["0"][name])


class UpDropDown(nn.Module):
    """A Colwise, dropout on its split features and a Rowwise, in one module with no Region."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(8, 16), Probe("split features"), nn.Linear(16, 8)
        self.after = Probe("summed")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.down(self.drop(self.up(x))))


class OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = UpDropDown()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_dropout_after_a_self_entering_colwise_in_one_layer_is_per_rank_until_the_rowwise() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(OneBlock().double(), units=["block"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    tp = sw.tensor_parallel(step, "tp", {"block.up": sw.tp.Colwise(), "block.down": sw.tp.Rowwise()})
    batch = (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    Probe.masks.clear()
    plain = _run(tp, sw.Mesh(tp=2), params, batch, steps=2)
    masks: dict[str, list[torch.Tensor]] = {}
    for (name, _thread), recorded in sorted(Probe.masks.items(), key=lambda kv: kv[0][0]):
        masks.setdefault(name, []).append(recorded[0])
    assert not torch.equal(*masks["split features"])  # each rank's features: its own mask
    assert torch.equal(*masks["summed"])  # after the Rowwise's sum: one mask for all
    rematted = _run(sw.remat(tp, sw.policies.nothing_saveable), sw.Mesh(tp=2), params, batch, steps=2)
    for (_, full_plain), (_, full_remat) in zip(plain, rematted, strict=True):  # recomputed alike
        assert all(torch.equal(full_plain["block"][n], full_remat["block"][n]) for n in full_plain["block"])
