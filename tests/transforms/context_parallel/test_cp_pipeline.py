"""sw.context_parallel under sw.pipeline: sequences cut over cp inside each stage, stages over pp.

float64 on thread ranks, equal to the single-device step to rounding (assert_equivalent's float64
default). The ring's sends are per micro-batch: every compute of a stage holding an attention lists
its ``cp - 1`` ppermutes (forward; again in backward, and under a zero-bubble schedule in whichever
of the input and weight passes runs the attention's backward), and the ledger equals the Plan.
"""

from __future__ import annotations

from typing import Any

import pytest

import shardwise as sw
from shardwise.transforms.context_parallel import context_parallel

from .test_cp_step import SEQ, batches, gpt


@pytest.mark.parametrize(("schedule", "attention"), [
    ("gpipe", "ring"), ("1f1b", "ulysses"), ("zb_h1", "ring"), ("interleaved_1f1b", "ring"),
])
def test_cp_2_by_pp_2_equals_the_single_device_step(schedule: str, attention: str) -> None:
    step, params = gpt()
    composed = sw.pipeline(context_parallel(step, "cp", attention=attention), "pp", schedule=schedule, microbatches=2)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(pp=2, cp=2), batches(), params)


def test_dp_by_pp_by_cp_4_with_zero_equals_the_single_device_step() -> None:
    step, params = gpt()
    composed = sw.shard_params(
        sw.pipeline(context_parallel(step, "cp"), "pp", schedule="1f1b", microbatches=2), "dp", 1
    )
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, pp=2, cp=4), batches(size=8), params)


def _ledger(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[list[tuple[str, str, str, int]]]:
    def run() -> list[tuple[str, str, str, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    return sw.launch(run, mesh.size, timeout=120)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_ring_sends_per_microbatch_and_the_ledger_equals_the_plan(schedule: str) -> None:
    step, params = gpt()
    cp, microbatches = 2, 2
    composed = sw.pipeline(context_parallel(step, "cp"), "pp", schedule=schedule, microbatches=microbatches)
    mesh, batch = sw.Mesh(pp=2, cp=cp), batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    # Per micro-batch, per attention layer a stage holds (one each here): cp - 1 sends of the key/value
    # slice [2, 4 / 2 micro-batches, heads 4, SEQ / cp, 4] forward, and cp - 1 of its gradient backward.
    # Zero-bubble splits the second stage's backward into an input pass and a weight pass: the ring's
    # backward lies on the input's path and runs in the input pass alone (the weight pass starts where
    # the weights' branches leave that path: model/split_backward.py), so no more sends either way.
    slice_bytes = 2 * (4 // microbatches) * 4 * (SEQ // cp) * 4 * 8
    for rank in range(mesh.size):
        sends = [(a.microbatch, a.wire[0].nbytes) for a in plan.actions[rank] if a.op == "ppermute"]
        want = sorted([(m, slice_bytes) for m in range(microbatches)] * 2 * (cp - 1))
        assert sorted(sends) == want, f"rank {rank}: {sends}"
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want_ledger = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want_ledger, f"rank {rank}\nledger: {got}\nplan:   {want_ledger}"


def test_a_padded_llama_over_pp_by_cp_equals_the_single_device_step() -> None:
    """The whole sequence's mask, made on the first stage, crosses to the second with the activations."""
    pytest.importorskip("transformers")
    from .test_cp_masks_hf import llama

    step, params, data = llama("left")
    composed = sw.pipeline(sw.context_parallel(step, "cp"), "pp", schedule="1f1b", microbatches=2)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(pp=2, cp=2), data, params)
