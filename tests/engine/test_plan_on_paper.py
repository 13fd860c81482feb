"""Planning a model larger than any machine: identical blocks run once, identical ranks lowered once.

A meta-built Hugging Face Llama is functionalized and planned with the reuse (engine/model/reuse.py:
a block like one run before, on an input like its, is not run again; engine/step/planning.py: ranks
that differ only in their data-parallel coordinate share their lowering) and without it (the reuse
keys switched off, every rank lowered on its own). The Plans must be equal, action by action and
figure by figure, and the number of decoder-layer forwards must not grow with the number of layers.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.model import reuse
from shardwise.engine.step.planning import plan_of
from shardwise.transforms.tensor_parallel import LLAMA_BLOCKS

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
DecoderLayer = T.models.llama.modeling_llama.LlamaDecoderLayer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = torch.zeros((1, 8), dtype=torch.long)  # what functionalize records the split on


def meta_llama(layers: int, hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 64) -> Any:
    cfg = T.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0,
    )
    with torch.device("meta"):
        return T.LlamaForCausalLM(cfg)


def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def planned(layers: int, stack: Callable[[sw.Step], sw.Step], mesh: sw.Mesh, *, share: bool = True,
            batch: int = 8, seq: int = 16) -> sw.plan.Plan:
    chain, params = sw.functionalize(meta_llama(layers), units=DecoderLayer, example_input=EXAMPLE)
    step = stack(sw.train_step(chain, loss, sw.optim.adamw(1e-3)))
    ids = torch.zeros((batch, seq), dtype=torch.long)
    return plan_of(step, mesh, params, (ids, ids), share_identical_ranks=share)


@pytest.fixture
def no_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer and block says nothing of what it computes: each one runs."""
    monkeypatch.setattr(reuse, "reuse_key", lambda fn: None)
    monkeypatch.setattr(reuse, "module_signature", lambda module: None)


@pytest.fixture
def layer_forwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times a LlamaDecoderLayer's forward really runs (a reused one does not)."""
    count = [0]
    forward = DecoderLayer.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    yield count


STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "zero3 dp4": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=4)),
    "zero3 dp2 x pp2 1f1b bf16": (
        lambda s: sw.mixed_precision(sw.shard_params(sw.pipeline(s, "pp", "1f1b", 2), "dp", stage=3), "compute=bf16"),
        sw.Mesh(dp=2, pp=2),
    ),
    "zero3 dp2 x pp2 x tp2 bf16": (
        lambda s: sw.mixed_precision(sw.shard_params(sw.pipeline(
            sw.tensor_parallel(s, "tp", sw.tp.llama_plan(), sequence_parallel=LLAMA_BLOCKS), "pp", "1f1b", 2,
        ), "dp", stage=3), "compute=bf16"),
        sw.Mesh(dp=2, pp=2, tp=2),
    ),
}


@functools.cache
def planned_with_reuse(stack: str) -> sw.plan.Plan:
    """``STACKS[stack]`` planned at 4 layers as ``planned`` plans by default, once for the tests that read it
    (a Plan is not changed by reading it; the counting tests below plan their own, to count)."""
    transform, mesh = STACKS[stack]
    return planned(4, transform, mesh)


@pytest.mark.parametrize("stack", list(STACKS))
def test_the_plan_with_reuse_equals_the_plan_computed_layer_by_layer_and_rank_by_rank(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    transform, mesh = STACKS[stack]
    shared = planned_with_reuse(stack)
    with monkeypatch.context() as m:
        m.setattr(reuse, "reuse_key", lambda fn: None)
        m.setattr(reuse, "module_signature", lambda module: None)
        by_layer = planned(4, transform, mesh, share=False)
    assert shared.actions == by_layer.actions
    assert dict(shared.memory) == dict(by_layer.memory)
    assert shared.layers == by_layer.layers
    assert shared.memory["kept_for_backward"][0] > 0


def test_ranks_of_one_class_share_their_actions_and_the_others_do_not() -> None:
    mesh = STACKS["zero3 dp2 x pp2 x tp2 bf16"][1]
    plan = planned_with_reuse("zero3 dp2 x pp2 x tp2 bf16")
    for r in range(mesh.size):
        for q in range(mesh.size):
            same_class = all(mesh.coords_of(r)[a] == mesh.coords_of(q)[a] for a in ("pp", "tp"))
            assert (plan.actions[r] is plan.actions[q]) == same_class, (r, q)
    # the two pipeline stages hold different layers: their actions differ
    assert plan.actions[0] != plan.actions[mesh.size - 1]


def test_identical_blocks_run_once_whatever_the_number_of_layers(layer_forwards: list[int]) -> None:
    transform, mesh = STACKS["zero3 dp2 x pp2 1f1b bf16"]
    counts = {}
    for layers in (4, 12):
        layer_forwards[0] = 0
        planned(layers, transform, mesh)
        counts[layers] = layer_forwards[0]
    assert counts[12] == counts[4], counts


def test_without_reuse_every_block_runs(no_reuse: None, layer_forwards: list[int]) -> None:
    """The counter above can fail: without the reuse, forwards grow with the layers."""
    transform, mesh = STACKS["zero3 dp2 x pp2 1f1b bf16"]
    counts = {}
    for layers in (4, 12):
        layer_forwards[0] = 0
        planned(layers, transform, mesh)
        counts[layers] = layer_forwards[0]
    assert counts[12] > counts[4] + 8 * 2, counts


def test_the_reused_figures_are_per_layer_those_of_a_run_layer_by_layer() -> None:
    chain, params = sw.functionalize(meta_llama(4), units=DecoderLayer, example_input=EXAMPLE)
    ids = torch.zeros((2, 16), dtype=torch.long)
    from shardwise.engine.plan.accounting import predict_kept_parts

    assert predict_kept_parts(chain, params, ids, reuse=True) == predict_kept_parts(chain, params, ids, reuse=False)


@pytest.mark.beside([sys.executable, str(ROOT / "benchmarks" / "plan_at_scale.py"), "--layers", "16", "--hidden",
                     "1024", "--intermediate", "2048", "--heads", "16", "--kv-heads", "4", "--vocab", "1024", "--seq",
                     "256", "--ranks", "64", "--microbatches", "4"],
                    timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})  # beside the other tests (conftest)
def test_a_scaled_down_model_is_planned_on_paper_in_bounded_time_and_memory(
    beside: subprocess.CompletedProcess[str],
) -> None:
    """Hidden 1024, 16 blocks, 64 ranks, ZeRO-3 alone and dp x pp x tp: the benchmark's script,
    in a process of its own (its VmHWM is its own)."""
    done = beside
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["stack"] for r in rows] == ["zero3", "3d"]
    for row in rows:
        assert row["peak_rss_bytes"] < 1.5e9, row  # the interpreter, torch and transformers are ~0.4 GB of it
        assert row["functionalize_s"] + row["plan_s"] < 120, row  # generous: CI machines are shared
        # ZeRO-3 holds 1/64 of the model state (fp32 master, grad, two Adam moments: 16 bytes each)
        held = row["rank0"]["params"] + row["rank0"]["grads"] + row["rank0"]["opt_state"]
        assert held >= row["formula_model_state_bytes"], row
    zero3 = rows[0]
    model_state = zero3["rank0"]["params"] + zero3["rank0"]["grads"] + zero3["rank0"]["opt_state"]
    assert model_state <= 1.01 * zero3["formula_model_state_bytes"]  # padding to equal shards only
