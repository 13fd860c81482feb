"""What calibrates simulate(plan) against a run: collectives queue per group, communication fitted
robustly from a run's waits, and a measured step replayed at its own costs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.plan.actions import (
    FORWARD,
    GATHER,
    GATHER_PARAMS,
    INSIDE,
    REDUCE_METRICS,
    REDUCE_SCATTER,
    SEND_ACTIVATION,
    SEND_GRAD,
    UPDATE,
    WAIT_GATHER,
    Action,
    Plan,
    Wire,
)
from shardwise.engine.simulate.costs import CommModel, PlanCosts, _fit_two, measured_transfers
from shardwise.engine.simulate.simulation import simulate
from shardwise.engine.simulate.timeline import PlanTimeline
from shardwise.testing import strategies as sst
from shardwise.testing.models import mlp


def _two_gathers() -> Plan:
    g0, g1 = (Action(GATHER, u, axis="dp", wire=(Wire("float32", 100),)) for u in ("u0", "u1"))
    w0, w1 = (Action(WAIT_GATHER, u, axis="dp") for u in ("u0", "u1"))
    f = Action(FORWARD, "x", 0, 0)
    return Plan(sw.Mesh(dp=2), ((g0, g1, w0, w1, f), (g0, g1, w0, w1, f)))


def test_a_groups_collectives_run_one_after_another() -> None:
    timeline = simulate(_two_gathers(), PlanCosts(comm=CommModel(alpha={"all_gather": 1.0})))
    # Both issued at 0 by both ranks: the first is in at 1, the second queues behind it, in at 2.
    assert [(t.start, t.end) for t in timeline.transfers[0]] == [(0.0, 1.0), (1.0, 2.0)]
    assert [s.end for s in timeline.ranks[0]] == [0.0, 0.0, 1.0, 2.0, 3.0]
    # Groups of another axis do not queue behind this one: pp=2 x dp=2, the two dp groups.
    g = Action(GATHER, "u", axis="dp", wire=(Wire("float32", 100),))
    w = Action(WAIT_GATHER, "u", axis="dp")
    plan = Plan(sw.Mesh(pp=2, dp=2), ((g, w),) * 4)
    assert simulate(plan, PlanCosts(comm=CommModel(alpha={"all_gather": 1.0}))).makespan == 1.0


def test_measured_transfers_count_a_collective_from_when_its_group_was_free() -> None:
    plan = _two_gathers()
    # Both issued at 0; the first was in at 1.0, the second at 2.5: it took 1.5 once the group was free.
    ranks = [[(0, 0.0, 0.0), (1, 0.0, 0.0), (2, 0.0, 1.0), (3, 1.0, 2.5), (4, 2.5, 3.5)]] * 2
    assert measured_transfers(plan, [ranks], PlanCosts()) == [("all_gather", 100, 2, 1.0), ("all_gather", 100, 2, 1.5)]
    # One size: its median, 1.25; simulated, the second queues behind the first and is in at 2.5 too.
    fitted = CommModel.fit(measured_transfers(plan, [ranks], PlanCosts()))
    assert fitted.alpha["all_gather"] == pytest.approx(1.25)
    assert simulate(plan, PlanCosts(comm=fitted)).ranks[0][3].end == pytest.approx(2.5)


def test_a_collective_behind_one_whose_landing_is_unknown_is_left_out() -> None:
    plan = _two_gathers()
    # The first gather was in by 1.9 (its wait found it there) and the second came in at 2.0. The
    # first landed somewhere in [0, 1.9], so the second began somewhere in [0, 1.9]: no sample.
    ranks = [[(0, 0.0, 0.0), (1, 0.0, 0.0), (2, 1.9, 1.9), (3, 1.9, 2.0), (4, 2.0, 3.0)]] * 2
    assert measured_transfers(plan, [ranks], PlanCosts()) == []
    # Issued after the first was in (at 2.0, the first in by 1.9): it began at its issue.
    g0, g1, w0, w1, f = plan.actions[0]
    later = Plan(plan.mesh, ((g0, w0, g1, w1, f),) * 2)
    ranks = [[(0, 0.0, 0.0), (1, 1.9, 1.9), (2, 2.0, 2.0), (3, 2.0, 2.5), (4, 2.5, 3.5)]] * 2
    assert measured_transfers(later, [ranks], PlanCosts()) == [("all_gather", 100, 2, 0.5)]


def test_a_synchronous_collective_counts_from_the_last_members_arrival() -> None:
    metrics = Action(REDUCE_METRICS, axis="dp", wire=(Wire("float32", 16),))
    plan = Plan(sw.Mesh(dp=2), ((metrics, metrics), (metrics, metrics)))  # the second one is synchronous
    # Rank 0 is there at 1.0, rank 1 at 1.5; both leave at 3.5: it took 2.0 once both were there.
    ranks = [[(0, 0.0, 0.1), (1, 1.0, 3.5)], [(0, 0.0, 0.1), (1, 1.5, 3.5)]]
    assert ("psum", 16, 2, 2.0) in measured_transfers(plan, [ranks], PlanCosts())


def test_comm_fit_counts_each_sample_at_its_sizes_mean() -> None:
    truth = CommModel(alpha={"all_gather": 1e-4}, beta={"all_gather": 1e-9})
    sizes = (1 << 12, 1 << 20, 1 << 24)
    # Per size, 20 samples at 0.9 and 1.1 of the truth (a mean of 1.0), and one that looks a
    # thousand times faster (its wait began just as the data came in): the size's mean is
    # (20 + 0.001) / 21 of the truth, and so is the fit, at every size.
    samples = [("all_gather", b, 2, truth.time("all_gather", b, 2) * f) for b in sizes for f in (0.9, 1.1) * 10]
    samples += [("all_gather", b, 2, truth.time("all_gather", b, 2) / 1000) for b in sizes]
    fitted = CommModel.fit(samples)
    for b in sizes:
        assert fitted.time("all_gather", b, 2) == pytest.approx(truth.time("all_gather", b, 2) * 20.001 / 21, rel=1e-6)
    # On the raw samples, least squares on relative error follows the fast ones: under a tenth.
    raw = [(2 - 1, b * 1.0, t, 1) for _, b, _, t in samples]
    alpha, beta = _fit_two(raw)
    assert alpha + beta * (1 << 12) < 0.1 * truth.time("all_gather", 1 << 12, 2)
    # A size seen once (at a fifth of its time) weighs as one sample against those seen at the
    # others: against 63 of them it drags the fit at its size to 0.68 of the truth, against 1260
    # to 0.93, next to the 0.95 that the other sizes' means give.
    late = [("all_gather", 1 << 22, 2, truth.time("all_gather", 1 << 22, 2) / 5)]
    at_late = truth.time("all_gather", 1 << 22, 2)
    assert CommModel.fit(samples + late).time("all_gather", 1 << 22, 2) / at_late < 0.7
    assert CommModel.fit(samples * 20 + late).time("all_gather", 1 << 22, 2) / at_late == pytest.approx(
        20.001 / 21, abs=0.03)


def _composed_plan() -> Plan:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 16, 16, 16, 4]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9))
    composed = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 4), "dp", 3)
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    return composed.plan(sw.Mesh(dp=2, pp=2), params, batch)


@pytest.mark.parametrize("cores", [None, 1, 3])
def test_a_simulated_step_replayed_at_its_own_costs_is_that_step(cores: int | None) -> None:
    plan = _composed_plan()
    # Waits cost nothing of their own here: a measured wait counts as idle throughout (its own
    # cost, once its data is in, cannot be told apart from its waiting), so only then is the
    # replay exact under shared cores.
    costs = PlanCosts(kind={FORWARD: 1.0, UPDATE: 0.5, GATHER: 0.1, GATHER_PARAMS: 0.1, REDUCE_SCATTER: 0.2,
                            SEND_ACTIVATION: 0.15, SEND_GRAD: 0.15},
                      action={"F(stage1, mb=2)": 2.5, "reduce_metrics(axis=pp)": 0.05}, cores=cores,
                      comm=CommModel(alpha={"all_gather": 0.3, "psum_scatter": 0.4, "psum": 0.1, "send": 0.2}))
    truth = simulate(plan, costs)
    step = [[(s.position, s.start, s.end) for s in row] for row in truth.ranks]
    # "Measured" as simulated, at plain costs that know none of it: every compute, issue and
    # bookkeeping action gets its own cost back from the step (its core share where shared).
    plain = PlanCosts(cores=cores, comm=costs.comm)
    assert simulate(plan, plain).makespan != pytest.approx(truth.makespan)
    replayed = simulate(plan, plain.of_step(plan, step))
    for got, want in zip(replayed.ranks, truth.ranks, strict=True):
        assert [s.position for s in got] == [s.position for s in want]
        assert [t for s in got for t in (s.start, s.end)] == pytest.approx([t for s in want for t in (s.start, s.end)],
                                                                            abs=1e-9)
    assert replayed.bubble_fraction == pytest.approx(truth.bubble_fraction)
    with pytest.raises(ValueError, match=r"PlanCosts\.of_step: got action times of 3 ranks"):
        plain.of_step(plan, step[:3])


def test_a_slot_cost_is_its_rank_and_position_only() -> None:
    f = Action(FORWARD, "x", 0, 0)
    plan = Plan(sw.Mesh(dp=2), ((f, f), (f, f)))
    costs = PlanCosts(slot={(1, 0): 4.0})
    assert costs.of(f, 1, 0) == 4.0 and costs.of(f, 1, 1) == costs.of(f, 0, 0) == costs.of(f, 1) == 1.0
    assert [s.end for s in simulate(plan, costs).ranks[1]] == [4.0, 5.0]
    with pytest.raises(ValueError, match=r"PlanCosts.slot\[\(1, 0\)\] = -1"):
        PlanCosts(slot={(1, 0): -1.0})


@given(
    problem=sst.problems(max_depth=4, max_steps=1),
    dp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    cores=st.sampled_from([None, 1, 2, 3]),
    data=st.data(),
)
def test_any_drawn_stack_replayed_at_its_simulated_costs_is_that_simulation(
    problem: sst.Problem, dp: int, pp: int, cores: int | None, data: st.DataObject
) -> None:
    stack = data.draw(sst.transform_stacks("dp", pp="pp"))
    assume(len(problem.case.chain) >= pp)
    mesh = sw.Mesh(dp=dp, pp=pp)
    batch = problem.batches_for(mesh, multiple=stack.microbatches)[0]
    plan = stack.apply(problem.step).plan(mesh, problem.params, batch)
    work = st.integers(1, 4).map(float)  # whole numbers keep unshared times exact
    kinds = {FORWARD: data.draw(work), UPDATE: data.draw(work), GATHER: data.draw(work) / 4,
             REDUCE_SCATTER: data.draw(work) / 4, SEND_ACTIVATION: data.draw(work) / 4, SEND_GRAD: data.draw(work) / 4}
    comm = CommModel(alpha={op: data.draw(work) / 2 for op in ("all_gather", "psum_scatter", "psum", "send")})
    truth = simulate(plan, PlanCosts(kind=kinds, cores=cores, comm=comm))
    step = [[(s.position, s.start, s.end) for s in row] for row in truth.ranks]
    replayed = simulate(plan, PlanCosts(cores=cores, comm=comm).of_step(plan, step))
    assert replayed.makespan == pytest.approx(truth.makespan, abs=1e-9)
    for got, want in zip(replayed.ranks, truth.ranks, strict=True):
        assert [t for s in got for t in (s.start, s.end)] == pytest.approx([t for s in want for t in (s.start, s.end)],
                                                                            abs=1e-9)
    # The queue: a group's collectives never overlap in the simulation.
    spans: dict[tuple, list[tuple[float, float]]] = {}
    for r, flights in enumerate(truth.transfers):
        for t in flights:
            if t.action.op not in (None, "send") and t.end > t.start:
                key = (t.action.axis, mesh.group_ranks(t.action.axis, r))
                spans.setdefault(key, []).append((t.start, t.end))
    for key, found in spans.items():
        ordered = sorted(set(found))
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(ordered)), (key, ordered)


def test_a_compute_costs_its_time_less_the_collectives_it_issued_inside_its_layers() -> None:
    f = Action(FORWARD, "x", 0, 0)
    inside = Action(INSIDE, "x", 0, 0, axis="tp", wire=(Wire("float32", 64),), op="psum")
    plan = Plan(sw.Mesh(tp=2), ((f, inside), (f, inside)))
    # Measured, the all-reduce ran inside the forward: [1, 2] within [0, 3] (rank 1: [1.5, 2] in [0, 3]).
    measured = [[(0, 0.0, 3.0), (1, 1.0, 2.0)], [(0, 0.0, 3.0), (1, 1.5, 2.0)]]
    costs = PlanCosts(comm=CommModel(alpha={"psum": 0.25})).of_step(plan, measured)
    assert costs.of(f, 0, 0) == 2.0 and costs.of(f, 1, 0) == 2.5
    # Simulated, the Plan runs it after its compute, which costs only its own time there.
    timeline = simulate(plan, costs)
    assert [(s.start, s.end) for s in timeline.ranks[0]] == [(0.0, 2.0), (2.0, 3.0)]
    # Busy time, and so the bubble, counts the compute without it, measured or simulated alike.
    assert PlanTimeline.from_measured(plan, measured).busy == (2.0, 2.5)
    assert timeline.busy[0] == 2.0
    # A timeline in which it ran after its compute (a simulated one) keeps the compute's whole time.
    sequential = [[(s.position, s.start, s.end) for s in row] for row in timeline.ranks]
    assert PlanCosts().of_step(plan, sequential).of(f, 0, 0) == 2.0
    # On one shared core, a rank waiting in it is idle: both forwards run at half speed in [0, 1]
    # and [2, 3], rank 1's alone in [1, 1.5] while rank 0 waits; rank 0 had 1.0 of the core, rank 1 1.5.
    shared = PlanCosts(cores=1).of_step(plan, measured)
    assert shared.of(f, 0, 0) == pytest.approx(1.0) and shared.of(f, 1, 0) == pytest.approx(1.5)


def test_a_comm_model_without_a_figure_for_an_op_the_plan_moves_is_refused() -> None:
    plan = _two_gathers()
    with pytest.raises(ValueError, match=r"op 'all_gather'.*figures only for \['send'\].*0\.0 to make it free"):
        simulate(plan, PlanCosts(comm=CommModel(alpha={"send": 1.0})))
    assert simulate(plan, PlanCosts(comm=CommModel(alpha={"all_gather": 0.0}))).makespan == 1.0  # free, said so
    assert simulate(plan, PlanCosts()).makespan == 1.0  # no model at all: everything free


def test_times_of_another_step_are_refused_not_read_as_this_plans_actions() -> None:
    """Times carry positions only: a pipeline's 13 timed actions were fitted as the first 13 of a
    ZeRO-3 plan's 48 (its forwards as gathers' costs). Every action of the plan must be timed, once."""
    plan = _two_gathers()  # 5 actions a rank
    fewer = [[(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.0, 3.0)]] * 2
    twice = [[(0, 0.0, 0.0), (1, 0.0, 0.0), (2, 0.0, 1.0), (2, 1.0, 2.5), (4, 2.5, 3.5)]] * 2
    for times, why in ((fewer, r"rank 0's times are of 3 actions, its plan's of 5 \(none for position 3"),
                       (twice, r"none for position 3 \(")):
        calls = {"PlanCosts.fit": lambda t: PlanCosts.fit(plan, [t]),
                 "PlanTimeline.from_measured": lambda t: PlanTimeline.from_measured(plan, t),
                 "measured_transfers": lambda t: measured_transfers(plan, [t], PlanCosts())}
        for what, call in calls.items():
            with pytest.raises(ValueError, match=f"{what}: .*{why}.*measured on this plan's step"):
                call(times)


def test_a_step_whose_update_was_skipped_on_an_overflow_still_fits_its_plan() -> None:
    """An update skipped for a non-finite gradient still runs its action (keeping the parameters): its
    times are of every action of the plan, and fit it."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 2]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    step = sw.mixed_precision(sw.shard_params(base.with_trace(), "dp", 3), "params=f32,compute=f16,output=f32",
                              loss_scale=1e30)  # float16 gradients scaled by 1e30 overflow
    mesh, batch = sw.Mesh(dp=2), (torch.randn(4, 4), torch.randn(4, 2))
    plan = step.plan(mesh, params, batch)

    def run() -> tuple[bool, list[tuple[int, float, float]]]:
        _, metrics = step(step.init(params, mesh), batch)
        return bool(metrics["skipped"]), metrics["action_times"]

    ranks = sw.launch(run, 2)
    assert all(skipped for skipped, _ in ranks)
    costs = PlanCosts.fit(plan, [[times for _, times in ranks]])
    assert costs.kind and PlanTimeline.from_measured(plan, [times for _, times in ranks]).makespan > 0
