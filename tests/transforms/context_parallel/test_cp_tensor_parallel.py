"""sw.context_parallel with sw.tensor_parallel: heads split over tp, the sequence over cp.

tensor_parallel rewrites the layers first (the engine's SPLIT_ORDER) and installs its forwards in the
modules; context_parallel's attention forward goes beneath tensor_parallel's Region on the attention
module (which calls the class's forward), so each tp rank runs ring or Ulysses attention over cp on
its own heads. float64 on thread ranks, equal to the single-device step to rounding
(assert_equivalent's float64 default); the ledger equals the Plan on both axes.
"""

from __future__ import annotations

from typing import Any

import pytest

import shardwise as sw
from shardwise.transforms.context_parallel import context_parallel

from .test_cp_step import batches, gpt

# Under cp x tp, context parallel's attention reaches the rank's split modules from the Region's probe copies: each
# Region is judged under tensor_parallel alone, and says so (tests/transforms/tensor_parallel/test_region_not_judged).
pytestmark = pytest.mark.filterwarnings("ignore::shardwise.tp.RegionNotJudged")


def tp(step: sw.Step, **kwargs: Any) -> sw.Step:
    return sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(vocab_parallel=False), **kwargs)


@pytest.mark.parametrize(("attention", "cp_first"), [("ring", True), ("ring", False), ("ulysses", True)])
def test_cp_2_by_tp_2_equals_the_single_device_step(attention: str, cp_first: bool) -> None:
    step, params = gpt()
    if cp_first:
        composed = tp(context_parallel(step, "cp", attention=attention))
    else:
        composed = context_parallel(tp(step), "cp", attention=attention)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2, tp=2), batches(), params)


def test_cp_4_by_tp_2_with_sequence_parallel_equals_the_single_device_step() -> None:
    step, params = gpt()
    composed = tp(context_parallel(step, "cp"), sequence_parallel=sw.tp.TINY_GPT_BLOCKS)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=4, tp=2), batches(), params)


def test_dp_by_cp_by_tp_with_zero_3_and_pp_by_cp_by_tp_equal_the_single_device_step() -> None:
    step, params = gpt()
    cp_tp = tp(context_parallel(step, "cp"))
    sw.testing.assert_equivalent(sw.shard_params(cp_tp, "dp", 3), step, sw.Mesh(dp=2, cp=2, tp=2), batches(), params)
    piped = sw.pipeline(cp_tp, "pp", schedule="1f1b", microbatches=2)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2, cp=2, tp=2), batches(), params)


def test_every_rank_issues_exactly_the_collectives_its_plan_lists() -> None:
    step, params = gpt()
    composed, mesh, batch = tp(context_parallel(step, "cp")), sw.Mesh(cp=2, tp=2), batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    ops = {(c.axis, c.op) for c in plan.collectives(0)}
    assert {("cp", "ppermute"), ("cp", "psum"), ("tp", "psum")} <= ops

    def run() -> list[tuple[str, str, str, int]]:
        state = composed.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            composed(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, mesh.size, timeout=120)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"


def test_a_padded_llama_over_cp_by_tp_equals_the_single_device_step() -> None:
    pytest.importorskip("transformers")
    from .test_cp_masks_hf import llama

    step, params, data = llama("left")
    composed = sw.tensor_parallel(context_parallel(step, "cp"), "tp", sw.tp.llama_plan(vocab_parallel=False))
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2, tp=2), data, params)


def test_ulysses_refuses_the_local_heads_the_axis_does_not_divide() -> None:
    """tp 2 leaves each rank 2 of the 4 heads, which Ulysses cannot cut over cp 4."""
    step, params = gpt()
    composed = tp(context_parallel(step, "cp", attention="ulysses"))
    message = r"q has 2 heads, which the size 4 of axis 'cp' does not divide"
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=4, tp=2), batches(1), params)
