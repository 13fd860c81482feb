"""tensor_parallel on gloo processes at world 4: the same results as the single-device step, and the
same collectives as the Plan.

Each rank rebuilds the (seeded) problem itself, so nothing unpicklable crosses
processes; the parent computes the reference and compares. float64, so the 1e-12
bound of the threads tests holds: gloo moves exact bytes and its sums differ from
ours only in rounding order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT, mlp
from shardwise.transforms.tensor_parallel import TINY_GPT_BLOCKS

pytestmark = pytest.mark.gloo

VOCAB, SEQ, BATCH = 64, 8, 4


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def _problem(kind: str) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        chain, params = sw.functionalize(mlp([8, 32, 16, 32, 8]).double())
        step = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2), clip_norm=0.5)
        batches = [(torch.randn(BATCH, 8, generator=gen, dtype=torch.float64),
                    torch.randn(BATCH, 8, generator=gen, dtype=torch.float64)) for _ in range(3)]
        return step, params, batches
    model = TinyGPT(vocab=VOCAB, d_model=32, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=0.5)
    batches = [(torch.randint(VOCAB, (BATCH, SEQ), generator=gen),
                torch.randint(VOCAB, (BATCH, SEQ), generator=gen)) for _ in range(3)]
    return step, params, batches


def _distributed(kind: str, case: str) -> tuple[sw.Step, sw.Mesh, dict, list]:
    step, params, batches = _problem(kind)
    if kind == "mlp":
        plan: dict[str, Any] = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise(), "4": sw.tp.Colwise(), "6": sw.tp.Rowwise()}
        sp = None
    else:
        plan, sp = sw.tp.tiny_gpt_plan(vocab_parallel=case != "tp4-gathered"), TINY_GPT_BLOCKS
    if case == "tp4-gathered":
        sp = None
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel=sp)
    if case.startswith("tp4"):
        return tp, sw.Mesh(tp=4), params, batches
    stage = {"dp2xtp2-zero1": 1, "dp2xtp2-zero3": 3}[case]
    return sw.shard_params(tp, "dp", stage), sw.Mesh(dp=2, tp=2), params, batches


def _run_rank(kind: str, case: str) -> list:
    step, mesh, params, batches = _distributed(kind, case)
    return sw.testing.record_history(step, step.init(params, mesh), batches)


CASES = [("tiny_gpt", "tp4-sp"), ("tiny_gpt", "tp4-gathered"), ("tiny_gpt", "dp2xtp2-zero3"), ("mlp", "dp2xtp2-zero1")]


@pytest.mark.parametrize("kind,case", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_tensor_parallel_on_gloo_equals_single_device(kind: str, case: str, gloo4: Any) -> None:
    per_rank = gloo4.run(_run_rank, kind, case)
    step, params, batches = _problem(kind)
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories(per_rank, expected, rtol=1e-12)


def _ledger_rank(kind: str, case: str) -> list:
    step, mesh, params, batches = _distributed(kind, case)
    state = step.init(params, mesh)
    with sw.collectives.comm_ledger() as ledger:
        step(state, batches[0])
    return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records]


def test_the_ledger_on_gloo_is_the_plan(gloo4: Any) -> None:
    """The torch.distributed backend records what the threads backend does: the Plan's collectives."""
    per_rank = gloo4.run(_ledger_rank, "tiny_gpt", "dp2xtp2-zero3")
    step, mesh, params, batches = _distributed("tiny_gpt", "dp2xtp2-zero3")
    plan = step.plan(mesh, params, batches[0])
    for rank, got in enumerate(per_rank):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert any(op == "psum_scatter" and axis == "tp" for op, axis, _, _ in want)  # sequence parallel's
        assert got == want, f"rank {rank}: the ledger differs from the Plan\nledger: {got}\nplan:   {want}"
