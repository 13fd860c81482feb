"""simulate(plan): hand-built plans with times worked out by hand, deadlocks and mismatches reported,
agreement with simulate(schedule), a composed dp x pp step simulated, measured and drawn."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.plan.actions import (
    BACKWARD,
    FORWARD,
    GATHER,
    RECV_ACTIVATION,
    RECV_GRAD,
    REDUCE_SCATTER,
    SEND_ACTIVATION,
    SEND_GRAD,
    WAIT_GATHER,
    WAIT_REDUCE,
    Action,
    Plan,
    Wire,
)
from shardwise.engine.simulate.costs import CommModel, PlanCosts, measured_transfers
from shardwise.engine.simulate.simulation import PlanDeadlock, PlanMismatch, simulate
from shardwise.engine.simulate.timeline import PlanTimeline
from shardwise.testing.models import mlp
from shardwise.transforms import pipeline as pipe


def wire(nbytes: int) -> tuple[Wire, ...]:
    return (Wire("float32", nbytes),)


def fwd(stage: int = 0) -> Action:
    return Action(FORWARD, "x", 0, stage)


def test_a_send_delivers_after_alpha_plus_bytes_times_beta() -> None:
    send = Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1, wire=wire(1000))
    recv = Action(RECV_ACTIVATION, "y", 0, 1, axis="pp", peer=0, wire=wire(1000))
    plan = Plan(sw.Mesh(pp=2), ((fwd(0), send), (recv, fwd(1))))
    costs = PlanCosts(comm=CommModel(alpha={"send": 0.5}, beta={"send": 0.001}))
    timeline = simulate(plan, costs)
    # rank 0 computes [0, 1] and sends; 0.5 + 1000 * 0.001 later rank 1 has it, then computes.
    assert [(s.start, s.end) for s in timeline.ranks[1]] == [(0.0, 2.5), (2.5, 3.5)]
    assert timeline.makespan == 3.5
    assert timeline.busy == (1.0, 1.0) and timeline.comm_wait == (0.0, 2.5)
    assert timeline.bubble_fraction == pytest.approx(1 - 2 / 7)
    (transfer,) = timeline.transfers[0]
    assert (transfer.start, transfer.end, transfer.kind) == (1.0, 2.5, SEND_ACTIVATION)


def test_a_send_of_several_tensors_is_one_stream_to_its_peer() -> None:
    """The executor sends a transfer's tensors back to back to one peer: one latency, all the bytes
    (a Hugging Face layer's output travels with its position embeddings). A collective of several
    tensors is still one collective each."""
    two = (Wire("float32", 600), Wire("float32", 400))
    send = Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1, wire=two)
    recv = Action(RECV_ACTIVATION, "y", 0, 1, axis="pp", peer=0, wire=two)
    plan = Plan(sw.Mesh(pp=2), ((fwd(0), send), (recv, fwd(1))))
    costs = PlanCosts(comm=CommModel(alpha={"send": 0.5}, beta={"send": 0.001}))
    # sent at 1; 0.5 + (600 + 400) x 0.001 later rank 1 has both (two latencies would be 3.0).
    assert [(s.start, s.end) for s in simulate(plan, costs).ranks[1]] == [(0.0, 2.5), (2.5, 3.5)]
    gather, wait = Action(GATHER, "u", axis="dp", wire=two), Action(WAIT_GATHER, "u", axis="dp")
    plan = Plan(sw.Mesh(dp=2), ((gather, wait), (gather, wait)))
    costs = PlanCosts(comm=CommModel(alpha={"all_gather": 0.25}, beta={"all_gather": 0.01}))
    assert simulate(plan, costs).makespan == pytest.approx(2 * 0.25 + 1000 * 0.01)


def test_a_gather_starts_when_the_last_rank_issues_it() -> None:
    unit = "u"
    gather, wait = Action(GATHER, unit, axis="dp", wire=wire(100)), Action(WAIT_GATHER, unit, axis="dp")
    plan = Plan(sw.Mesh(dp=2), ((gather, wait, fwd()), (fwd(), gather, wait)))
    costs = PlanCosts(comm=CommModel(alpha={"all_gather": 0.25}, beta={"all_gather": 0.01}))
    timeline = simulate(plan, costs)
    # rank 1 issues at 1; over 2 ranks: 1 step of 0.25, and 1 x 100 bytes x 0.01: done at 2.25.
    assert [s.end for s in timeline.ranks[0]] == [0.0, 2.25, 3.25]
    assert [s.end for s in timeline.ranks[1]] == [1.0, 1.0, 2.25]
    assert [(t.start, t.end) for row in timeline.transfers for t in row] == [(1.0, 2.25), (1.0, 2.25)]


def test_an_async_reduce_scatter_overlaps_the_computes_until_waited() -> None:
    rs, wait = Action(REDUCE_SCATTER, "u", axis="dp", wire=wire(400)), Action(WAIT_REDUCE, "u", axis="dp")
    plan = Plan(sw.Mesh(dp=2), ((rs, fwd(), wait), (fwd(), rs, fwd(), wait)))
    costs = PlanCosts(comm=CommModel(alpha={"psum_scatter": 0.5}, beta={"psum_scatter": 0.01}))
    timeline = simulate(plan, costs)
    # issued by both at 1; 0.5 + 400 x (1/2) x 0.01 = 2.5 later it is done.
    assert timeline.ranks[0][-1].end == 3.5 and timeline.comm_wait[0] == 2.5
    assert timeline.ranks[1][-1].end == 3.5 and timeline.comm_wait[1] == 1.5  # its second F ran meanwhile


def test_a_deadlock_names_the_ranks_and_what_they_wait_for() -> None:
    plan = Plan(sw.Mesh(pp=2), (
        (Action(RECV_GRAD, "x", 0, 0, axis="pp", peer=1), Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1)),
        (Action(RECV_ACTIVATION, "y", 0, 1, axis="pp", peer=0), Action(SEND_GRAD, "y", 0, 1, axis="pp", peer=0)),
    ))
    with pytest.raises(PlanDeadlock, match=r"rank 0: action 0 recv_grad.*\n.*rank 1: action 0 recv_activation") as err:
        simulate(plan)
    assert sorted(err.value.blocked) == [0, 1]
    assert "rank 1 is stuck at action 0" in err.value.blocked[0][2]


def test_a_collective_that_one_rank_never_issues_deadlocks_its_wait() -> None:
    gather, wait = Action(GATHER, "u", axis="dp"), Action(WAIT_GATHER, "u", axis="dp")
    with pytest.raises(PlanDeadlock, match=r"needs ranks \[1\] too.*rank 1 has finished"):
        simulate(Plan(sw.Mesh(dp=2), ((gather, wait), (fwd(),))))


def test_collectives_out_of_step_are_a_mismatch() -> None:
    a = (Action(GATHER, "u", axis="dp"), Action(WAIT_GATHER, "u", axis="dp"))
    b = (Action(REDUCE_SCATTER, "u", axis="dp"), Action(WAIT_REDUCE, "u", axis="dp"))
    with pytest.raises(PlanMismatch, match=r"rank 0 issues gather.*but rank 1 issues reduce_scatter"):
        simulate(Plan(sw.Mesh(dp=2), (a, b)))
    send = Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1)
    with pytest.raises(PlanMismatch, match="never receives it"):
        simulate(Plan(sw.Mesh(pp=2), ((send,), ())))


def _mlp_step() -> tuple[sw.Step, dict]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 16, 16, 16, 4]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9)), params


@pytest.mark.parametrize(("schedule", "stages"), [("gpipe", 2), ("1f1b", 2), ("zb_h1", 2), ("interleaved_1f1b", 4)])
def test_a_pipelined_plan_agrees_with_its_schedule(schedule: str, stages: int) -> None:
    step, params = _mlp_step()
    piped = sw.pipeline(step, "pp", schedule, 4, stages=stages)
    mesh = sw.Mesh(pp=2)
    plan, sched = piped.plan(mesh, params), piped.layout(mesh, params).schedule
    for costs in (pipe.Costs(), pipe.Costs(forward=1, backward=3, comm=0.5, per_stage={(1, "F"): 2, (0, "I"): 2})):
        from_plan, from_schedule = pipe.simulate(plan, costs), pipe.simulate(sched, costs)
        assert isinstance(from_plan, PlanTimeline)
        assert from_plan.makespan == from_schedule.makespan
        assert from_plan.bubble_fraction == from_schedule.bubble_fraction
        computes = [[(str(s.label), s.start) for s in row if s.kind != "loss" and s.compute and s.kind != "update"]
                    for row in from_plan.ranks]
        assert computes == [[(str(s.op), s.start) for s in row] for row in from_schedule.ranks]


def _composed() -> tuple[sw.Step, dict, sw.Mesh, tuple[torch.Tensor, torch.Tensor]]:
    step, params = _mlp_step()
    composed = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 4, trace=True), "dp", 3)
    gen = torch.Generator().manual_seed(1)
    return composed, params, sw.Mesh(dp=2, pp=2), (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))


def test_a_composed_step_is_simulated_and_drawn_with_its_collectives(tmp_path: Path) -> None:
    composed, params, mesh, batch = _composed()
    plan = composed.plan(mesh, params, batch)
    costs = PlanCosts(comm=CommModel(alpha={"all_gather": 0.3, "psum_scatter": 0.4, "psum": 0.1, "send": 0.2}))
    timeline = pipe.simulate(plan, costs)
    in_flight = {t.kind for row in timeline.transfers for t in row}
    assert {GATHER, REDUCE_SCATTER, SEND_ACTIVATION, SEND_GRAD} <= in_flight
    assert timeline.makespan > pipe.simulate(plan).makespan  # communication costs time
    assert timeline.peak_gathered_bytes == plan.memory["gathered_peak"]
    text = pipe.ascii_timeline(timeline)
    rows = [line for line in text.splitlines()[1:] if "|" in line]
    assert len(rows) == 2 * mesh.size  # each rank, and what it has in flight
    assert "g" in rows[1] and "r" in rows[1] and "s" in rows[1] and "~" in rows[0]
    legend = text[text.index("\nlegend: "):]  # says what the glyphs on the drawing mean, and only those
    assert "G gather;" in legend and "RS reduce_scatter;" in legend and "~ waiting;" in legend
    assert "under a rank, in flight: g gather, " in legend and "I backward's input half" not in legend
    assert all(len(line) <= 100 for line in legend.splitlines())
    trace = json.loads(pipe.write_chrome_trace(timeline, tmp_path / "plan.json").read_text())
    cats = {e.get("cat") for e in trace["traceEvents"] if e["tid"] % 2 == 1 and e["ph"] == "X"}
    assert {GATHER, REDUCE_SCATTER} <= cats
    assert sum(e["ph"] == "X" and e["tid"] % 2 == 0 for e in trace["traceEvents"]) == sum(map(len, plan.actions))
    pytest.importorskip("matplotlib")
    assert pipe.gantt(timeline, tmp_path / "plan.png").read_bytes().startswith(b"\x89PNG")


def test_a_measured_run_gives_a_timeline_and_fitted_costs() -> None:
    composed, params, mesh, batch = _composed()
    plan = composed.plan(mesh, params, batch)

    def run() -> list[list[tuple[int, float, float]]]:
        state = composed.init(params, mesh)
        out = []
        for _ in range(2):
            state, metrics = composed(state, batch)
            out.append(list(metrics["action_times"]))
        return out

    per_rank = sw.launch(run, mesh.size)
    steps = [[per_rank[r][i] for r in range(mesh.size)] for i in range(2)]
    measured = PlanTimeline.from_measured(plan, steps[1])
    assert [sorted(s.position for s in row) for row in measured.ranks] == [list(range(len(a))) for a in plan.actions]
    assert measured.ranks[0][0].start >= 0 and min(row[0].start for row in measured.ranks) == 0
    assert 0 < measured.bubble_fraction < 1 and measured.makespan > 0
    costs = PlanCosts.fit(plan, steps)
    forward = [e - s for step in steps for r in (0, 2) for i, s, e in step[r] if plan.actions[r][i].kind == FORWARD]
    assert costs.stage[(FORWARD, 0)] == statistics.median(forward) and costs.unit_us == 1e6
    simulated = simulate(plan, costs)
    assert simulated.makespan > 0 and BACKWARD in {s.kind for s in simulated.ranks[0]}
    with pytest.raises(ValueError, match="action times of 3 ranks"):
        PlanTimeline.from_measured(plan, steps[0][:3])


def test_costs_fit_takes_medians_of_computes_and_minima_of_waits() -> None:
    send = Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1)
    recv = Action(RECV_ACTIVATION, "y", 0, 1, axis="pp", peer=0)
    plan = Plan(sw.Mesh(pp=2), ((fwd(0), send), (recv, fwd(1))))
    steps = [[[(0, 0.0, 1.0), (1, 1.0, 1.1)], [(0, 0.0, 1.2), (1, 1.2, 3.2)]],
             [[(0, 0.0, 3.0), (1, 3.0, 3.1)], [(0, 0.0, 3.5), (1, 3.5, 4.5)]],
             [[(0, 0.0, 2.0), (1, 2.0, 2.3)], [(0, 0.0, 0.5), (1, 0.5, 3.5)]]]
    costs = PlanCosts.fit(plan, steps)
    assert costs.stage[(FORWARD, 0)] == 2.0 and costs.stage[(FORWARD, 1)] == 2.0
    assert costs.rank[(RECV_ACTIVATION, 1)] == 0.5  # the receive that did not wait
    assert costs.of(send, 0) == pytest.approx(0.1)


def test_comm_model_fit_recovers_alpha_and_beta() -> None:
    truth = CommModel(alpha={"psum": 2e-5, "send": 1e-5}, beta={"psum": 1e-9, "send": 4e-10})
    samples = [(op, b, n, truth.time(op, b, n)) for op in ("psum", "send") for b in (1 << 10, 1 << 16, 1 << 22)
               for n in (2, 4)]
    fitted = CommModel.fit(samples)
    for op in ("psum", "send"):
        assert fitted.alpha[op] == pytest.approx(truth.alpha[op], rel=1e-6)
        assert fitted.beta[op] == pytest.approx(truth.beta[op], rel=1e-6)
    one_size = CommModel.fit([("send", 64, 2, 3e-5), ("send", 64, 2, 5e-5)])
    assert one_size.beta["send"] == 0 and 3e-5 < one_size.alpha["send"] < 5e-5
    rows = [{"bench": "collectives", "backend": "gloo", "world": 2, "op": "send_recv", "bytes": b,
             "median_s": 2 * truth.time("send", b, 2)} for b in (4096, 1 << 20)]
    assert CommModel.from_benchmark(rows).alpha["send"] == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError, match="no collectives benchmark rows of backend 'threads'"):
        CommModel.from_benchmark(rows, backend="threads")


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="kind one of"):
        PlanCosts(kind={"forwards": 1.0})
    with pytest.raises(ValueError, match=r"PlanCosts.stage\[\('forward', 0\)\] = -1"):
        PlanCosts(stage={(FORWARD, 0): -1.0})
    with pytest.raises(ValueError, match=r"CommModel\.alpha has ops"):
        CommModel(alpha={"allgather": 1.0})
    with pytest.raises(TypeError, match="needs a shardwise Plan"):
        simulate("1f1b")  # type: ignore[arg-type]


def test_ranks_sharing_fewer_cores_share_them_equally() -> None:
    short, long = Action(FORWARD, "x", 0, 0), Action(FORWARD, "y", 0, 1)
    plan = Plan(sw.Mesh(dp=2), ((short,), (long,)))
    costs = {(FORWARD, 0): 1.0, (FORWARD, 1): 3.0}
    assert simulate(plan, PlanCosts(stage=costs)).makespan == 3.0
    shared = simulate(plan, PlanCosts(stage=costs, cores=1))
    # Both at half speed until the short one is done at 2; the long one has 2 left, alone.
    assert [row[0].end for row in shared.ranks] == [2.0, 4.0]
    # Measured that way, the fit recovers each action's own core time.
    measured = [[[(0, 0.0, 2.0)], [(0, 0.0, 4.0)]]]
    fitted = PlanCosts.fit(plan, measured, cores=1)
    assert fitted.stage[(FORWARD, 0)] == 1.0 and fitted.stage[(FORWARD, 1)] == 3.0 and fitted.cores == 1
    assert simulate(plan, fitted).ranks[1][0].end == 4.0
    with pytest.raises(ValueError, match="cores must be a positive int"):
        PlanCosts(cores=0)


def test_measured_transfers_read_what_a_waiting_receive_saw() -> None:
    send = Action(SEND_ACTIVATION, "x", 0, 0, axis="pp", peer=1, wire=wire(64))
    recv = Action(RECV_ACTIVATION, "y", 0, 1, axis="pp", peer=0, wire=wire(64))
    plan = Plan(sw.Mesh(pp=2), ((fwd(0), send), (recv, fwd(1))))
    waited = [[(0, 0.0, 1.0), (1, 1.0, 1.25)], [(0, 0.0, 2.0), (1, 2.0, 3.0)]]
    not_waiting = [[(0, 0.0, 1.0), (1, 1.0, 1.25)], [(0, 1.5, 1.75), (1, 1.75, 3.0)]]
    costs = PlanCosts(rank={(RECV_ACTIVATION, 1): 0.25})
    # Sent at 1.25; received at 2.0 by a rank waiting since 0, whose receive itself costs 0.25.
    assert measured_transfers(plan, [waited, not_waiting], costs) == [("send", 64, 2, 0.5)]


def _small_mlp_step() -> tuple[Any, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 8, 3]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


def test_a_cost_keyed_by_what_the_plan_does_not_have_is_refused() -> None:
    """A layer name with a typo, a rank or stage beyond the mesh's, an action's text or a slot that is not
    there: each priced nothing, and the step was simulated at the default costs without an error."""
    step, params = _small_mlp_step()
    plan = sw.shard_params(step, "dp", 3).plan(sw.Mesh(dp=2), params, (torch.randn(8, 4), torch.randn(8, 3)))
    assert sw.simulate(plan, PlanCosts(layer={("forward", "0"): 100.0})).makespan > sw.simulate(plan).makespan
    for costs, name in [
        (PlanCosts(layer={("forward", "fc1"): 100.0}), r"layer key \('forward', 'fc1'\)"),
        (PlanCosts(rank={("forward", 7): 100.0}), r"rank key \('forward', 7\)"),
        (PlanCosts(stage={("forward", 5): 100.0}), r"stage key \('forward', 5\)"),
        (PlanCosts(action={"F(fc1)": 100.0}), r"action key 'F\(fc1\)'"),
        (PlanCosts(slot={(2, 0): 100.0}), r"slot key \(2, 0\)"),
    ]:
        with pytest.raises(ValueError, match=rf"PlanCosts\.{name} names no .* of the plan"):
            sw.simulate(plan, costs)


def test_a_payload_the_plan_does_not_know_is_not_priced_free_by_the_byte() -> None:
    """A plan made without a batch does not know what its transfers carry: a CommModel pricing by the byte
    charged them their latency alone, so the 1F1B step simulated 44x faster than with the batch (373x for
    ZeRO-3 without the parameters). Refused, as plan.collectives() refuses it; a model without a per-byte
    cost (CommModel(), the default) still simulates such a plan."""
    step, params = _small_mlp_step()
    piped = sw.pipeline(step, "pp", "1f1b", 4)
    link = PlanCosts(comm=CommModel.link(bandwidth=1e6, latency=1e-6))
    told = piped.plan(sw.Mesh(pp=2), params, (torch.randn(8, 4), torch.randn(8, 3)))
    assert sw.simulate(told, link).makespan > 0
    untold = piped.plan(sw.Mesh(pp=2), params)
    with pytest.raises(ValueError, match=r"send_activation\(stage0, mb=0, to=1\) carries a payload the plan does "
                       r"not know .*prices op 'send' by the byte"):
        sw.simulate(untold, link)
    assert sw.simulate(untold).makespan > 0
