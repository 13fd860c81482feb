"""A Plan's timeline: every rank's actions with their start and end, simulated or measured.

:func:`roles` says what each action is to a timeline (a compute, the issue of a
transfer or collective, a wait for one, or bookkeeping); :class:`PlanTimeline`
holds the slots, what each rank had in flight, and the figures (makespan,
compute time, bubble, time in waits). ``PlanTimeline.from_measured`` reads a run
made with ``step.with_trace()`` (its ``metrics["action_times"]``), and
``engine/simulate/simulation.py`` makes the same from a Plan on paper, so both draw and
compare alike.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

from ...collectives.mesh import Mesh
from ..plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    CHECK_REPLICAS,
    FINISH_GRADS,
    FORWARD,
    FREE,
    GATHER,
    GATHER_PARAMS,
    INSIDE,
    LOSS,
    RECV_ACTIVATION,
    RECV_GRAD,
    RECV_TIED,
    REDUCE_METRICS,
    REDUCE_REPLICAS,
    REDUCE_SCATTER,
    SEND_ACTIVATION,
    SEND_GRAD,
    SEND_TIED,
    SUM_TIED,
    UPDATE,
    WAIT_CHECK,
    WAIT_GATHER,
    WAIT_METRICS,
    WAIT_PARAMS,
    WAIT_REDUCE,
    WAIT_REPLICAS,
    WAIT_SENDS,
    Action,
    Plan,
)

ActionTimes = Sequence[tuple[int, float, float]]  # one rank's (position, start, end) per action

# What an action is to the timeline: a compute, the issue of a transfer or collective, a wait
# for one, or local bookkeeping.
COMPUTE, ISSUE, WAIT, LOCAL = "compute", "issue", "wait", "local"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, LOSS, UPDATE)
KINDS = (*COMPUTE_KINDS, GATHER, WAIT_GATHER, FREE, REDUCE_SCATTER, WAIT_REDUCE, REDUCE_REPLICAS, WAIT_REPLICAS,
         GATHER_PARAMS, WAIT_PARAMS,
         SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD, RECV_GRAD, SEND_TIED, RECV_TIED, SUM_TIED, WAIT_SENDS,
         FINISH_GRADS, REDUCE_METRICS, WAIT_METRICS, INSIDE, CHECK_REPLICAS, WAIT_CHECK)
SENDS = (SEND_ACTIVATION, SEND_GRAD, SEND_TIED)
RECVS = (RECV_ACTIVATION, RECV_GRAD, RECV_TIED)
WAIT_OF = {WAIT_GATHER: GATHER, WAIT_REDUCE: REDUCE_SCATTER, WAIT_PARAMS: GATHER_PARAMS, WAIT_CHECK: CHECK_REPLICAS,
           WAIT_REPLICAS: REDUCE_REPLICAS}
ASYNC = tuple(WAIT_OF.values())


def roles(actions: Sequence[Action]) -> tuple[str, ...]:
    """Each action's role on one rank; the first reduce_metrics is async (issued), later ones sync."""
    out: list[str] = []
    metrics_issued = False
    for a in actions:
        if a.kind in COMPUTE_KINDS:
            out.append(COMPUTE)
        elif a.kind in SENDS or a.kind in ASYNC or (a.kind == REDUCE_METRICS and not metrics_issued):
            out.append(ISSUE)
        elif (
            a.kind in RECVS
            or a.kind in WAIT_OF
            or a.kind in (WAIT_SENDS, WAIT_METRICS, REDUCE_METRICS, INSIDE)
        ):
            out.append(WAIT)
        else:
            out.append(LOCAL)
        metrics_issued |= a.kind == REDUCE_METRICS
    return tuple(out)


class PlanMismatch(ValueError):
    """The ranks' action lists do not fit together (a send nobody receives, collectives out of step)."""


def peer_rank(mesh: Mesh, rank: int, a: Action) -> int:
    """The global rank at the other end of transfer ``a`` of ``rank``."""
    if a.axis is None or a.peer is None:
        raise PlanMismatch(f"rank {rank}: {a} needs a mesh axis and a peer to pair with its other end")
    return mesh.rank_of({**mesh.coords_of(rank), a.axis: a.peer})


def channel(rank: int, peer: int, a: Action) -> tuple[Any, ...]:
    """What a send or receive carries, the same on both ends: (sender, receiver, axis, payload)."""
    if a.kind in (SEND_TIED, RECV_TIED):
        payload: tuple[Any, ...] = ("tied", a.tied)
    elif a.kind in (SEND_ACTIVATION, SEND_GRAD):
        payload = ("activation" if a.kind == SEND_ACTIVATION else "grad", a.stage, a.microbatch)
    else:  # a receive names its own stage; the producer is the one before (activation) or after (gradient)
        step = -1 if a.kind == RECV_ACTIVATION else 1
        payload = ("activation" if step < 0 else "grad", None if a.stage is None else a.stage + step, a.microbatch)
    src, dst = (rank, peer) if a.kind in SENDS else (peer, rank)
    return (src, dst, a.axis, *payload)


_SAME_STEP = ("were the times measured on this plan's step, mesh and batch? (the plan of a split step, tensor "
              "parallel's say, made without a batch lists none of its in-layer collectives: step.plan(mesh, params, "
              "batch))")


def check_action_times(plan: Plan, per_rank: Sequence[ActionTimes], what: str) -> None:
    """Refuse times that are not of ``plan``'s step: a traced step times every action of its rank's
    Plan once (an update skipped on an overflow too: its action runs and keeps the parameters), so
    each rank's positions are exactly its actions'. Times carry positions only; another step's
    would otherwise be read as this plan's actions' (a pipeline's forwards as ZeRO-3's gathers)."""
    if len(per_rank) != plan.mesh.size:
        raise ValueError(f"{what}: got action times of {len(per_rank)} ranks for a plan of {plan.mesh.size}")
    for r, times in enumerate(per_rank):
        n = len(plan.actions[r])
        for pos, start, end in times:
            if not 0 <= pos < n:
                raise ValueError(f"{what}: rank {r} has {n} actions, not one at position {pos}; {_SAME_STEP}")
            if end < start:
                raise ValueError(
                    f"{what}: rank {r}'s action {plan.actions[r][pos]} ends ({end}) before it starts ({start})"
                )
        positions = [pos for pos, _, _ in times]
        if len(positions) != n or len(set(positions)) != n:
            missing = sorted(set(range(n)) - set(positions))
            which = f"none for position {missing[0]} ({plan.actions[r][missing[0]]})" if missing else "some twice"
            raise ValueError(f"{what}: rank {r}'s times are of {len(positions)} actions, its plan's of {n} "
                             f"({which}); {_SAME_STEP}")


# -- the timeline -------------------------------------------------------------------------------
_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}
# A drawing's few characters for each action that is not a compute (the legend under a drawing reads them).
SHORT_LABELS = {
    LOSS: "L", UPDATE: "U", GATHER: "G", WAIT_GATHER: "wG", FREE: "fr", REDUCE_SCATTER: "RS", WAIT_REDUCE: "wRS",
    REDUCE_REPLICAS: "AR", WAIT_REPLICAS: "wAR",
    GATHER_PARAMS: "GP", WAIT_PARAMS: "wGP", SEND_ACTIVATION: "sa", RECV_ACTIVATION: "ra", SEND_GRAD: "sg",
    RECV_GRAD: "rg", SEND_TIED: "st", RECV_TIED: "rt", SUM_TIED: "tie", WAIT_SENDS: "ws", FINISH_GRADS: "fin",
    REDUCE_METRICS: "M", WAIT_METRICS: "wM",
}


def short_label(action: Action) -> str:
    """A few characters for a drawing: ``0F1`` (stage 0, forward, micro-batch 1), ``wG`` (wait_gather),
    ``psum`` (a psum inside a layer) ..."""
    if action.kind == INSIDE:  # a collective inside a layer: its op (the legend says so)
        return str(action.op)
    if action.kind in _LETTER:
        stage = "" if action.stage is None else str(action.stage)
        return f"{stage}{_LETTER[action.kind]}{'' if action.microbatch is None else action.microbatch}"
    mb = "" if action.microbatch is None or action.kind != LOSS else str(action.microbatch)
    return SHORT_LABELS.get(action.kind, action.kind) + mb


class PlanSlot(NamedTuple):
    """Action ``position`` of ``rank``'s list ran from ``start`` to ``end``; ``role``: compute/issue/wait/local."""

    rank: int
    position: int
    action: Action
    start: float
    end: float
    role: str

    @property
    def kind(self) -> str:
        return self.action.kind

    @property
    def op(self) -> Action:
        return self.action

    @property
    def label(self) -> str:
        return short_label(self.action)

    @property
    def compute(self) -> bool:
        return self.role == COMPUTE

    @property
    def waiting(self) -> bool:
        return self.role == WAIT


class Transfer(NamedTuple):
    """A collective or message in flight for ``rank``, issued by its action ``position`` (simulated only)."""

    rank: int
    position: int
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> str:
        return self.action.kind


def chrome_event(name: str, cat: str, tid: int, start: float, end: float, scale: float,
                 args: Mapping[str, Any]) -> dict[str, Any]:
    """One complete ("X") Chrome trace event, times multiplied by ``scale`` into microseconds."""
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": float(start * scale),
            "dur": float((end - start) * scale), "args": dict(args)}


def thread_name(tid: int, name: str) -> dict[str, Any]:
    """The Chrome trace metadata event naming row ``tid``."""
    return {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}


@dataclass(frozen=True)
class PlanTimeline:
    """Per-rank slots of a Plan in execution order, time 0 the first start, and what was in flight."""

    plan: Plan
    ranks: tuple[tuple[PlanSlot, ...], ...]
    transfers: tuple[tuple[Transfer, ...], ...] = ()
    unit_us: float = 1000.0
    name: str = "plan"
    ascii_width: int = 120  # a plan's actions differ too much in length to size columns by the shortest

    @classmethod
    def from_measured(cls, plan: Plan, action_times: Sequence[ActionTimes],
                      name: str = "measured") -> PlanTimeline:
        """The timeline of one measured step: per rank, ``metrics["action_times"]`` (seconds, one clock)."""
        check_action_times(plan, action_times, "PlanTimeline.from_measured")
        origin = min((start for times in action_times for _, start, _ in times), default=0.0)
        rows = []
        for r, times in enumerate(action_times):
            kinds_roles = roles(plan.actions[r])
            slots = [PlanSlot(r, pos, plan.actions[r][pos], s - origin, e - origin, kinds_roles[pos])
                     for pos, s, e in times]
            rows.append(tuple(sorted(slots, key=lambda slot: (slot.start, slot.position))))
        return cls(plan, tuple(rows), unit_us=1e6, name=name)

    @property
    def makespan(self) -> float:
        """When the last action ends."""
        return max((slot.end for row in self.ranks for slot in row), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank spends computing (forward, backward, I, W, loss, update), less the time
        its computes spent in the collectives they issue inside their layers (a split's: a measured
        compute holds them, a simulated one is followed by them)."""
        out = []
        for row in self.ranks:
            inside = sorted((s.start, s.end) for s in row if s.kind == INSIDE)
            starts = [start for start, _ in inside]
            total = 0.0
            for c in (s for s in row if s.compute):
                held = inside[bisect.bisect_left(starts, c.start):bisect.bisect_left(starts, c.end)]
                total += c.end - c.start - sum(min(c.end, end) - start for start, end in held)
            out.append(total)
        return tuple(out)

    @property
    def comm_wait(self) -> tuple[float, ...]:
        """Time each rank spends in blocking communication actions (receives, waits, sync all-reduces)."""
        return tuple(sum(s.end - s.start for s in row if s.waiting) for row in self.ranks)

    @property
    def bubble_fraction(self) -> float:
        """``1 - busy / (ranks * makespan)``: the share of the ranks' time not spent computing."""
        span = Fraction(self.makespan) * len(self.ranks)
        return 0.0 if span == 0 else float(1 - sum(Fraction(b) for b in self.busy) / span)

    @property
    def peak_gathered_bytes(self) -> tuple[int, ...] | None:
        """Per rank, the most bytes of gathered ZeRO-3 units held at once (the Plan's figure), if known."""
        peak = self.plan.memory.get("gathered_peak")
        return None if peak is None else tuple(peak)

    def summary(self) -> dict[str, Any]:
        """The figures as plain values (one JSON line's worth)."""
        return {"makespan": self.makespan, "bubble": self.bubble_fraction, "busy": list(self.busy),
                "comm_wait": list(self.comm_wait), "peak_gathered_bytes": self.peak_gathered_bytes}

    def to_chrome_trace(self, unit_us: float | None = None) -> dict[str, Any]:
        """Chrome trace JSON: a row per rank (its actions) and one below it (what it had in flight)."""
        scale = self.unit_us if unit_us is None else unit_us
        events = [thread_name(2 * r, f"rank {r}") for r in range(len(self.ranks))]
        events += [thread_name(2 * r + 1, f"rank {r} in flight") for r, row in enumerate(self.transfers) if row]
        for slots in self.ranks:
            events += [chrome_event(str(s.action), s.kind, 2 * s.rank, s.start, s.end, scale,
                                    {"role": s.role, "position": s.position, "stage": s.action.stage,
                                     "microbatch": s.action.microbatch, "bytes": s.action.nbytes}) for s in slots]
        for flights in self.transfers:
            events += [chrome_event(str(t.action), t.kind, 2 * t.rank + 1, t.start, t.end, scale,
                                    {"axis": t.action.axis, "bytes": t.action.nbytes}) for t in flights]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"timeline": self.name}}
