"""simulate(): known bubble and memory results of the built-ins, checked exactly, and the Timeline.

All bubble figures use the default costs F=1, B=2, I=1, W=1, comm=0 (per
stage; a ZB-V stage is half a 1F1B stage, but the bubble is a ratio, so a
uniform scale does not change it). Integer costs give integer times, so every
bubble is compared as a Fraction, exactly.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.transforms.pipeline import (
    SCHEDULES,
    Costs,
    PipeOp,
    Schedule,
    Slot,
    Timeline,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    zb_h1,
    zb_v,
)


def bubble(timeline: Timeline) -> Fraction:
    exact = 1 - Fraction(sum(timeline.busy)) / (len(timeline.ranks) * Fraction(timeline.makespan))
    assert timeline.bubble_fraction == float(exact)  # the float property is the exact value, rounded once
    return exact


@given(p=st.integers(1, 4), m=st.integers(1, 12))
def test_gpipe_bubble_and_memory(p: int, m: int) -> None:
    """GPipe: makespan (m+p-1)(F+B), so the bubble is (p-1)/(m+p-1); every rank holds all m activations."""
    timeline = simulate(gpipe(p, p, m))
    assert bubble(timeline) == Fraction(p - 1, m + p - 1)
    assert timeline.makespan == 3 * (m + p - 1)
    assert timeline.peak_activations == (m,) * p


@given(p=st.integers(1, 4), m=st.integers(1, 12))
def test_one_f_one_b_bubble_and_memory(p: int, m: int) -> None:
    """1F1B: the same bubble as GPipe, (p-1)/(m+p-1), but rank r holds only min(p-r, m)."""
    timeline = simulate(one_f_one_b(p, p, m))
    assert bubble(timeline) == Fraction(p - 1, m + p - 1)
    assert timeline.peak_activations == tuple(min(p - r, m) for r in range(p))
    assert max(timeline.peak_activations) <= p


@given(p=st.integers(1, 4), v=st.integers(2, 3), k=st.integers(1, 4))
def test_interleaved_bubble(p: int, v: int, k: int) -> None:
    """Interleaved 1F1B (Megatron-LM): bubble (p-1)/(v*m + p-1), exactly, for every m = k*p.

    Megatron's analysis puts the bubble time at (p-1)(tf+tb)/v against an ideal
    m(tf+tb), i.e. bubble/ideal = (p-1)/(v*m); as a share of the makespan (what
    bubble_fraction measures) that is (p-1)/(v*m + p-1). The simulation with
    F=1, B=2 per virtual stage and comm=0 matches it exactly: makespan
    3(v*m + p-1), each rank busy 3*v*m. (Megatron's warm-up of
    2(p-1-r) + (v-1)p forwards is what makes it exact; with v=1 it is 1F1B's
    figure.) It is strictly below 1F1B's (p-1)/(m+p-1) for p >= 2.
    """
    m = k * p
    timeline = simulate(interleaved_1f1b(p, v * p, m))
    assert bubble(timeline) == Fraction(p - 1, v * m + p - 1)
    assert timeline.makespan == 3 * (v * m + p - 1)
    if p >= 2:
        assert bubble(timeline) < bubble(simulate(one_f_one_b(p, p, m)))


@given(p=st.integers(2, 4), m=st.integers(1, 12))
def test_zb_h1_beats_1f1b_at_the_same_memory(p: int, m: int) -> None:
    """ZB-H1: strictly below 1F1B's bubble with the same peak activations (held until W).

    For m >= p the bubble is exactly (p-1)/(3m + p-1): each rank idles
    (p-1)(F + I - W) = p-1 units, the paper's figure, against 1F1B's
    (p-1)(F + B) = 3(p-1). For m < p the warm-up is cut short and the figure
    is higher, but still below 1F1B's.
    """
    h1 = simulate(zb_h1(p, p, m))
    base = simulate(one_f_one_b(p, p, m))
    assert bubble(h1) < bubble(base)
    assert max(h1.peak_activations) == max(base.peak_activations) == min(p, m)
    if m >= p:
        assert bubble(h1) == Fraction(p - 1, 3 * m + p - 1)


@given(p=st.integers(2, 4), m=st.integers(1, 12))
def test_zb_v_beats_zb_h1(p: int, m: int) -> None:
    """ZB-V: below ZB-H1 once m > p, and exactly (p-1)/(6m + p-1) for m >= 2p.

    Each rank does 6m units (2 stages x F, I, W) and idles only the p-1 units
    before the first forward reaches rank p-1. With m <= p the V cannot fill
    and ZB-V is no better than ZB-H1 (equal in our runs), so the strict claim
    is tested for m > p. Peak activations: at most 2p half-size stage
    activations per rank, i.e. 1F1B's p full-stage ones.
    """
    v = simulate(zb_v(p, 2 * p, m))
    if m > p:
        assert bubble(v) < bubble(simulate(zb_h1(p, p, m)))
    if m >= 2 * p:
        assert bubble(v) == Fraction(p - 1, 6 * m + p - 1)
    assert max(v.peak_activations) <= 2 * p


@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 4),
    m=st.integers(1, 6),
    comm=st.integers(0, 2),
)
def test_timing_rules(name: str, p: int, m: int, comm: int) -> None:
    """Against the rules themselves: in order per rank, no overlap, after dependencies (+comm across ranks)."""
    stages = {"zb_v": 2 * p, "interleaved_1f1b": 2 * p}.get(name, p)
    microbatches = p * m if name == "interleaved_1f1b" else m
    schedule = SCHEDULES[name](p, stages, microbatches)
    costs = Costs(comm=comm)
    timeline = simulate(schedule, costs)
    end = {slot.op: slot.end for row in timeline.ranks for slot in row}
    for rank, row in enumerate(timeline.ranks):
        assert tuple(slot.op for slot in row) == schedule.ranks[rank]
        free = 0
        for op, start, stop in row:
            assert stop - start == costs.of(op)
            ready = [end[d] + (comm if schedule.placement[d.stage] != rank else 0) for d in schedule.dependencies(op)]
            assert start == max([free, *ready])  # as early as the rules allow, no earlier
            free = stop
    assert timeline.makespan == max(end.values())


def test_costs_per_kind_and_per_stage() -> None:
    schedule = one_f_one_b(2, 2, 1)
    slow_last = simulate(schedule, {"F": 2, "B": 3, (1, "F"): 5, "comm": 1})
    assert [list(row) for row in slow_last.ranks] == [
        [Slot(PipeOp(0, 0, "F"), 0, 2), Slot(PipeOp(0, 0, "B"), 12, 15)],
        [Slot(PipeOp(1, 0, "F"), 3, 8), Slot(PipeOp(1, 0, "B"), 8, 11)],
    ]
    assert Costs.from_mapping({"I": 2}).of(PipeOp(0, 0, "I")) == 2
    with pytest.raises(ValueError, match=r"Costs\.comm must be a finite number >= 0, got -1"):
        Costs(comm=-1)
    with pytest.raises(ValueError, match="unknown cost key 'X'"):
        Costs.from_mapping({"X": 1})
    with pytest.raises(ValueError, match=r"per_stage\[\(0, 'Z'\)\]"):
        Costs(per_stage={(0, "Z"): 1})
    assert Costs() == Costs() and hash(Costs()) == hash(Costs())


def test_chrome_trace_is_json_with_one_event_per_op() -> None:
    schedule = zb_v(2, 4, 3)
    trace = json.loads(json.dumps(simulate(schedule).to_chrome_trace()))
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == sum(len(r) for r in schedule.ranks)
    assert sorted(e["name"] for e in ops) == sorted(str(op) for op in schedule.ops())
    first = next(e for e in ops if e["name"] == "0F0")
    assert (first["pid"], first["tid"], first["cat"], first["ts"], first["dur"]) == (0, 0, "F", 0.0, 1000.0)
    assert {e["tid"] for e in ops} == {0, 1}
    assert simulate(schedule).to_chrome_trace(unit_us=1.0)["traceEvents"][-1]["dur"] in (1.0, 2.0)


def test_from_measured_matches_simulated() -> None:
    """A runtime trace (seconds, any clock origin, any event order) gives the same figures."""
    schedule = one_f_one_b(2, 2, 3)
    simulated = simulate(schedule)
    events = [(r, str(op), 100 + s / 4, 100 + e / 4) for r, row in enumerate(simulated.ranks) for op, s, e in row]
    measured = Timeline.from_measured(schedule, reversed(events))
    assert measured.ranks == tuple(tuple(Slot(op, s / 4, e / 4) for op, s, e in row) for row in simulated.ranks)
    assert measured.bubble_fraction == simulated.bubble_fraction
    assert measured.peak_activations == simulated.peak_activations
    assert measured.to_chrome_trace()["traceEvents"][-1]["ts"] == simulated.ranks[1][-1].start / 4 * 1e6
    with pytest.raises(ValueError, match="on rank 5"):
        Timeline.from_measured(schedule, [(5, "0F0", 0.0, 1.0)])
    with pytest.raises(ValueError, match="ends"):
        Timeline.from_measured(schedule, [(0, PipeOp(0, 0, "F"), 1.0, 0.0)])


def test_empty_and_idle_ranks() -> None:
    schedule = Schedule.parse("rank 0: 0F0 1F0 1B0 0B0\nrank 1:", placement=[0, 0])
    timeline = simulate(schedule)
    assert timeline.makespan == 6 and timeline.ranks[1] == ()
    assert timeline.bubble_fraction == 0.5
    assert timeline.peak_activations == (2, 0)


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda s: simulate(s, Costs(forward=float("nan"))), ValueError, r"Costs\.forward must be a finite number >= 0, "
                                                                     r"got nan"),
    (lambda s: simulate(s, Costs(forward="1")), ValueError, r"Costs\.forward must be a finite number >= 0, got '1'"),
    (lambda s: simulate(s, Costs(per_stage={(5, "F"): 1})), ValueError,
     r"Costs\.per_stage names stages \[5\], but the schedule has stages 0\.\.1: those costs would price nothing"),
    (lambda s: simulate(s, 3), TypeError, r"simulate\(schedule, costs\): Costs or a mapping"),
    (lambda s: simulate("1f1b"), TypeError, r"a Schedule or a Plan, got str; a built-in's name needs its shape: "
                                            r"get_schedule\('1f1b', ranks, stages, microbatches\)"),
])
def test_costs_and_arguments_that_would_price_nothing_or_fail_deep_are_refused(make, error, message) -> None:  # type: ignore[no-untyped-def]
    """A per-stage cost of a stage the schedule lacks priced nothing, a NaN cost made a NaN makespan, and a string
    cost, an int for the costs or a schedule's name failed inside the simulation with a bare Python error."""
    with pytest.raises(error, match=message):
        make(one_f_one_b(2, 2, 4))


def test_pipe_ops_are_public_where_the_docs_and_errors_name_them() -> None:
    """Found by session 41's probing: docs/api.md and Schedule's errors named PipeOp, which only
    shardwise.transforms.pipeline exported."""
    import shardwise as sw

    op = sw.schedules.PipeOp
    built = sw.schedules.Schedule(ranks=((op(0, 0, "F"), op(0, 0, "B")),), placement=(0,), microbatches=1)
    assert built == sw.schedules.Schedule.parse("rank 0: 0F0 0B0")
