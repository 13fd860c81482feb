"""sw.expert_parallel under sw.pipeline: experts split over ep inside each stage, stages over pp.

float64 on thread ranks, equal to the single-device step to rounding (assert_equivalent's float64
default). Every compute of a stage holding a MoE block lists its own all-to-alls and count exchange
(per micro-batch; under a zero-bubble schedule the all-to-alls' transposes run in whichever of the
input and weight passes walks them), and the ledger equals the Plan.
"""

from __future__ import annotations

import pytest

import shardwise as sw

from .test_ep_step import _ledger, batches, moe_model


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pp_2_by_ep_2_equals_the_single_device_step_and_the_ledger_is_the_plan(schedule: str) -> None:
    step, params = moe_model()
    composed = sw.pipeline(sw.expert_parallel(step, "ep"), "pp", schedule=schedule, microbatches=2)
    mesh = sw.Mesh(pp=2, ep=2)
    sw.testing.assert_equivalent(composed, step, mesh, batches(), params)
    batch = batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"
    # Stage s holds the MoE block of layer s + 1: per micro-batch, one count exchange and two
    # all-to-alls forward, two backward; zero-bubble's second stage walks the all-to-alls' transposes
    # in both its input and its weight pass (autograd re-walks the nodes both need).
    for rank in range(mesh.size):
        stage = mesh.coords_of(rank)["pp"]
        a2a = sum(a.op == "all_to_all" for a in plan.actions[rank])
        gathers = sum(a.label == "moe counts" for a in plan.actions[rank])
        assert gathers == 2, f"rank {rank}"
        assert a2a == 2 * (2 + (4 if schedule == "zb_h1" and stage == 1 else 2)), f"rank {rank}"


def test_dp_by_pp_by_ep_with_zero_equals_the_single_device_step() -> None:
    step, params = moe_model()
    composed = sw.shard_params(sw.pipeline(sw.expert_parallel(step, "ep"), "pp", "1f1b", microbatches=2), "dp", 1)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, pp=2, ep=2), batches(size=16), params)
