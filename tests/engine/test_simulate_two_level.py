"""A two-level CommModel: a group within one node is priced by the fast figures, one that spans
nodes by the slow ones; simulate prices each collective of a Plan by the link its axis crosses,
and so shows HSDP ahead of flat ZeRO-3 where the nodes' network is slow."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.plan import CommModel, PlanCosts
from shardwise.testing.models import mlp

FAST, SLOW = CommModel.link(bandwidth=1e9, latency=1e-6), CommModel.link(bandwidth=1e8, latency=1e-5)
TWO_LEVEL = CommModel.two_level(intra=FAST, inter=SLOW, ranks_per_node=4)


def test_a_group_is_priced_by_the_link_it_crosses() -> None:
    assert TWO_LEVEL.level(range(4)) == FAST and TWO_LEVEL.level((4, 5, 6, 7)) == FAST
    assert TWO_LEVEL.level((0, 4)) == SLOW and TWO_LEVEL.level(range(8)) == SLOW
    assert TWO_LEVEL.time("psum_scatter", 1000, 4, ranks=range(4)) == FAST.time("psum_scatter", 1000, 4)
    assert TWO_LEVEL.time("psum_scatter", 1000, 4, ranks=(0, 4, 8, 12)) == SLOW.time("psum_scatter", 1000, 4)
    assert FAST.level(None) == FAST  # one level: where the ranks are does not matter


def test_bad_models_are_refused() -> None:
    with pytest.raises(ValueError, match="needs both inter"):
        CommModel(inter=SLOW)
    with pytest.raises(ValueError, match=r"ranks_per_node=0\): .* int >= 1"):
        CommModel.two_level(intra=FAST, inter=SLOW, ranks_per_node=0)
    with pytest.raises(TypeError, match="one-level CommModel"):
        CommModel.two_level(intra=TWO_LEVEL, inter=SLOW, ranks_per_node=4)
    with pytest.raises(ValueError, match="pass ranks="):
        TWO_LEVEL.time("psum", 8, 2)
    with pytest.raises(ValueError, match=r"bandwidth=0\): a finite number, > 0"):
        CommModel.link(bandwidth=0)


def _plans() -> dict[str, sw.plan.Plan]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([64, 256, 256, 256, 64]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3))
    batch = (torch.randn(16, 64), torch.randn(16, 64))
    flat = sw.shard_params(step, "dp", 3, reduce_in_flight=1)
    hsdp = sw.shard_params(step, "dp", 3, reduce_in_flight=1, replicate="node")
    return {"flat": flat.plan(sw.Mesh(dp=8), params, batch), "hsdp": hsdp.plan(sw.Mesh(node=2, dp=4), params, batch)}


def test_simulate_prices_each_axis_by_its_link_and_hsdp_wins_over_a_slow_network() -> None:
    plans = _plans()
    costs = PlanCosts(kind={"forward": 1e-4, "backward": 2e-4}, comm=TWO_LEVEL, unit_us=1e6)
    timelines = {name: sw.simulate(plan, costs) for name, plan in plans.items()}
    mesh = plans["hsdp"].mesh
    for transfer in timelines["hsdp"].transfers[0]:  # rank 0's collectives: dp within its node, node across
        action = transfer.action
        group = mesh.group_ranks(action.require("axis"), 0)
        link = FAST if action.axis == "dp" else SLOW
        assert transfer.end - transfer.start == pytest.approx(link.time(action.op, action.nbytes, len(group)))
    assert {t.action.axis for t in timelines["hsdp"].transfers[0]} == {"dp", "node"}
    # Flat ZeRO-3 crosses the slow network with every gather and reduce-scatter; HSDP with the
    # shards' all-reduce only.
    assert timelines["hsdp"].makespan < 0.5 * timelines["flat"].makespan
    # On one level (every link fast) the two are within a few percent: HSDP's advantage is the topology.
    one_level = PlanCosts(kind={"forward": 1e-4, "backward": 2e-4}, comm=FAST, unit_us=1e6)
    flat, hsdp = (sw.simulate(plans[k], one_level).makespan for k in ("flat", "hsdp"))
    assert hsdp == pytest.approx(flat, rel=0.1)
    # And it holds twice the model state per rank (4 shards, not 8).
    assert plans["hsdp"].memory["opt_state"][0] > 1.9 * plans["flat"].memory["opt_state"][0]


def test_covering_fills_both_levels() -> None:
    plan = _plans()["hsdp"]
    partial = CommModel.two_level(intra=CommModel(alpha={"all_gather": 1e-6}), inter=CommModel(beta={"psum": 1e-9}),
                                  ranks_per_node=4)
    covered, unseen = partial.covering(plan)
    assert unseen == ("all_gather", "psum", "psum_scatter")
    assert covered.ranks_per_node == 4 and covered.inter is not None
    sw.simulate(plan, PlanCosts(comm=covered))  # every op now has figures on both levels
    with pytest.raises(ValueError, match="needs a communication time for op"):
        sw.simulate(plan, PlanCosts(comm=partial))
