"""``simulate(plan, costs) -> PlanTimeline``: every rank's actions of a Plan on paper, and the same
timeline measured from a run.

The model, and what it assumes:

* Each rank runs its actions in the Plan's order, one at a time. Every action
  costs its rank :meth:`PlanCosts.of` (a compute its compute time; a send or
  an async collective the time to issue it; a wait its bookkeeping once the
  data is in). Ranks are independent processors: nothing models two ranks
  sharing a core, or links shared by two transfers.
* A transfer or collective takes :meth:`CommModel.time`, ``alpha x steps +
  beta x bytes x factor`` per tensor, with the steps and byte factor of a ring
  over the group (``n`` ranks): all-gather ``n-1`` steps moving ``n-1`` times
  its input (a shard), reduce-scatter ``n-1`` and ``(n-1)/n`` of its input,
  all-reduce twice those, a send one message of its bytes. ``alpha`` and
  ``beta`` are per op, fitted by least squares on relative error from the
  collectives benchmark (:meth:`CommModel.from_benchmark`).
* A send is delivered its transfer time after it is issued (the executor posts
  every receive of the step at the first one, so no message waits for its
  receive); a receive ends no earlier than that, plus its own cost. Sends and
  receives pair in order per (sender, receiver, axis, what travels: the
  activation or gradient of a stage and micro-batch, or a tied weight).
  ``wait_sends`` and ``sum_tied`` wait until every send so far is delivered.
* The k-th collective a rank issues over an axis meets the k-th of every rank of
  its group there. An async one (gather, reduce_scatter, gather_params, the first
  reduce_metrics) starts when the last member has issued it and completes its
  transfer time later; its wait blocks the rank until then. A sync one (the later
  reduce_metrics, after the first is in) blocks until every member has arrived and
  the transfer is done.
* Nothing can wait forever: a rank that would is reported (:class:`PlanDeadlock`)
  with what it waits for; a send nobody receives, or a collective some member
  never issues, is :class:`PlanMismatch`.

Bubble, as for a pipeline schedule: ``1 - compute time / (ranks x makespan)``,
where compute is forward, backward (and I, W), loss and update. ``comm_wait`` is
the time each rank spends in blocking communication actions (receives, waits,
sync all-reduces). A measured run (``metrics["action_times"]`` of a step made
with ``pipeline(..., trace=True)``) gives the same :class:`PlanTimeline`
through :meth:`PlanTimeline.from_measured`, and :meth:`PlanCosts.fit` reads
compute costs from such runs, so simulated and measured compare the same way.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple

from .executor import FINISH_GRADS
from .plan import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FREE,
    GATHER,
    GATHER_PARAMS,
    LOSS,
    RECV_ACTIVATION,
    RECV_GRAD,
    RECV_TIED,
    REDUCE_METRICS,
    REDUCE_SCATTER,
    SEND_ACTIVATION,
    SEND_GRAD,
    SEND_TIED,
    SUM_TIED,
    UPDATE,
    WAIT_GATHER,
    WAIT_METRICS,
    WAIT_PARAMS,
    WAIT_REDUCE,
    WAIT_SENDS,
    Action,
    Plan,
)

# What an action is to the timeline: a compute, the issue of a transfer or collective, a wait
# for one, or local bookkeeping.
COMPUTE, ISSUE, WAIT, LOCAL = "compute", "issue", "wait", "local"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, LOSS, UPDATE)
KINDS = (*COMPUTE_KINDS, GATHER, WAIT_GATHER, FREE, REDUCE_SCATTER, WAIT_REDUCE, GATHER_PARAMS, WAIT_PARAMS,
         SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD, RECV_GRAD, SEND_TIED, RECV_TIED, SUM_TIED, WAIT_SENDS,
         FINISH_GRADS, REDUCE_METRICS, WAIT_METRICS)
_SENDS = (SEND_ACTIVATION, SEND_GRAD, SEND_TIED)
_RECVS = (RECV_ACTIVATION, RECV_GRAD, RECV_TIED)
_WAIT_OF = {WAIT_GATHER: GATHER, WAIT_REDUCE: REDUCE_SCATTER, WAIT_PARAMS: GATHER_PARAMS}
_ASYNC = tuple(_WAIT_OF.values())
DEFAULT_COSTS = MappingProxyType({FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0})
COMM_OPS = ("all_gather", "psum_scatter", "psum", "send")


def roles(actions: Sequence[Action]) -> tuple[str, ...]:
    """Each action's role on one rank; the first reduce_metrics is async (issued), later ones sync."""
    out: list[str] = []
    metrics_issued = False
    for a in actions:
        if a.kind in COMPUTE_KINDS:
            out.append(COMPUTE)
        elif a.kind in _SENDS or a.kind in _ASYNC or (a.kind == REDUCE_METRICS and not metrics_issued):
            out.append(ISSUE)
        elif a.kind in _RECVS or a.kind in _WAIT_OF or a.kind in (WAIT_SENDS, WAIT_METRICS, REDUCE_METRICS):
            out.append(WAIT)
        else:
            out.append(LOCAL)
        metrics_issued |= a.kind == REDUCE_METRICS
    return tuple(out)


def ring_shape(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bytes on one link per input byte) of ``op`` as a ring over ``n`` ranks."""
    if op == "send":
        return 1.0, 1.0
    if op not in COMM_OPS:
        raise ValueError(f"no communication model for op {op!r}; the model knows {COMM_OPS}")
    if n <= 1:
        return 0.0, 0.0  # a group of one moves nothing
    return {"all_gather": (n - 1, n - 1), "psum_scatter": (n - 1, (n - 1) / n), "psum": (2 * (n - 1), 2 * (n - 1) / n)}[op]


def _frozen(mapping: Mapping[Any, float], what: str) -> Mapping[Any, float]:
    for key, value in mapping.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{what}[{key!r}] = {value}: a time must be finite and >= 0")
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class CommModel:
    """Time of a collective or transfer: per op, ``alpha`` per latency step and ``beta`` per byte on a link.

    >>> model = CommModel(alpha={"send": 1e-5}, beta={"send": 1e-9})
    >>> round(model.time("send", 1000, 2), 9)
    1.1e-05
    """

    alpha: Mapping[str, float] = field(default_factory=dict)
    beta: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            table = getattr(self, name)
            if unknown := sorted(set(table) - set(COMM_OPS)):
                raise ValueError(f"CommModel.{name} has ops {unknown}; use {COMM_OPS}")
            object.__setattr__(self, name, _frozen(table, f"CommModel.{name}"))

    def time(self, op: str, nbytes: int, n: int) -> float:
        """One tensor of ``nbytes`` (one rank's input) through ``op`` over ``n`` ranks."""
        steps, factor = ring_shape(op, n)
        return self.alpha.get(op, 0.0) * steps + self.beta.get(op, 0.0) * factor * nbytes

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, int, int, float]]) -> CommModel:
        """Least squares on relative error over ``(op, bytes, ranks, seconds)`` samples, per op.

        A fit that would make alpha or beta negative keeps that term at 0 and fits the other;
        with a single message size beta cannot be told from alpha, and only alpha is fitted.
        """
        by_op: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for op, nbytes, n, seconds in samples:
            steps, factor = ring_shape(op, n)
            if seconds > 0 and steps > 0:
                by_op[op].append((steps, factor * nbytes, seconds))
        alpha, beta = {}, {}
        for op, rows in by_op.items():
            alpha[op], beta[op] = _fit_two(rows)
        return cls(alpha, beta)

    @classmethod
    def from_benchmark(cls, rows: Iterable[Mapping[str, Any]], backend: str = "gloo") -> CommModel:
        """Fit from ``benchmarks/collectives.py``'s JSON lines of ``backend`` (psum, all_gather,
        psum_scatter, and send_recv: a round trip, so two messages)."""
        samples = []
        for row in rows:
            if row.get("bench") != "collectives" or row.get("backend") != backend:
                continue
            op, seconds = row["op"], float(row["median_s"])
            if op == "send_recv":
                samples.append(("send", int(row["bytes"]), 2, seconds / 2))
            elif op in COMM_OPS:
                samples.append((op, int(row["bytes"]), int(row["world"]), seconds))
        if not samples:
            raise ValueError(f"no collectives benchmark rows of backend {backend!r} with ops psum, all_gather, "
                             "psum_scatter or send_recv: run python benchmarks/collectives.py --out FILE")
        return cls.fit(samples)


def _fit_two(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum(((a*s + b*x) - t) / t)^2 over rows (s, x, t)."""
    w = [1.0 / (t * t) for _, _, t in rows]
    ss = sum(wi * s * s for wi, (s, _, _) in zip(w, rows, strict=True))
    sx = sum(wi * s * x for wi, (s, x, _) in zip(w, rows, strict=True))
    xx = sum(wi * x * x for wi, (_, x, _) in zip(w, rows, strict=True))
    st = sum(wi * s * t for wi, (s, _, t) in zip(w, rows, strict=True))
    xt = sum(wi * x * t for wi, (_, x, t) in zip(w, rows, strict=True))
    det = ss * xx - sx * sx
    if det > 1e-9 * ss * xx:
        a, b = (st * xx - sx * xt) / det, (ss * xt - sx * st) / det
        if a >= 0 and b >= 0:
            return a, b
        if a < 0 and xx > 0:
            return 0.0, max(0.0, xt / xx)
    return max(0.0, st / ss), 0.0


@dataclass(frozen=True)
class PlanCosts:
    """What each action costs its rank, and the communication model.

    :meth:`of` looks up, first match wins: ``action`` by the action's text
    (``"F(stage0, mb=1)"``), ``stage`` by (kind, stage), ``layer`` by (kind, layer
    or unit), ``rank`` by (kind, rank), then ``kind``; ``kind`` defaults to
    forward 1, backward 2, I 1, W 1 and 0 for every other kind. ``unit_us``:
    microseconds per time unit in a Chrome trace (1e6 for costs in seconds).
    """

    kind: Mapping[str, float] = field(default_factory=dict)
    stage: Mapping[tuple[str, int], float] = field(default_factory=dict)
    layer: Mapping[tuple[str, str], float] = field(default_factory=dict)
    rank: Mapping[tuple[str, int], float] = field(default_factory=dict)
    action: Mapping[str, float] = field(default_factory=dict)
    comm: CommModel = field(default_factory=CommModel)
    unit_us: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("kind", "stage", "layer", "rank"):
            table = getattr(self, name)
            for key in table:
                kind = key if name == "kind" else key[0] if isinstance(key, tuple) and len(key) == 2 else None
                if kind not in KINDS:
                    raise ValueError(
                        f"PlanCosts.{name} key {key!r}: " + ("" if name == "kind" else "use (kind, value) with ")
                        + f"kind one of {', '.join(KINDS)}"
                    )
            object.__setattr__(self, name, _frozen(table, f"PlanCosts.{name}"))
        object.__setattr__(self, "action", _frozen(self.action, "PlanCosts.action"))
        if not isinstance(self.comm, CommModel):
            raise TypeError(f"PlanCosts.comm must be a CommModel, got {type(self.comm).__name__}")

    def of(self, action: Action, rank: int) -> float:
        """How long ``action`` keeps ``rank`` busy (waiting excluded)."""
        found = self.action.get(str(action))
        if found is None and action.stage is not None:
            found = self.stage.get((action.kind, action.stage))
        if found is None and action.layer is not None:
            found = self.layer.get((action.kind, action.layer))
        if found is None:
            found = self.rank.get((action.kind, rank))
        if found is not None:
            return found
        return self.kind.get(action.kind, DEFAULT_COSTS.get(action.kind, 0.0))

    @classmethod
    def fit(cls, plan: Plan, steps: Iterable[Sequence[Sequence[tuple[int, float, float]]]],
            comm: CommModel | None = None) -> PlanCosts:
        """Costs in seconds from measured steps (per step, per rank, ``metrics["action_times"]``).

        A compute, issue or bookkeeping action costs the median of its durations, by (kind, stage)
        where it has a stage, else by (kind, layer), else by (kind, rank); a blocking action the
        shortest of its durations by (kind, rank): the time it takes when its data is already in.
        Every kind also gets the median (shortest) over all its samples, for actions not seen.
        """
        samples: dict[tuple[str, Any], list[float]] = defaultdict(list)
        blocking: set[str] = set()
        for step in steps:
            _check_ranks(plan, step, "PlanCosts.fit")
            for r, times in enumerate(step):
                kinds_roles = roles(plan.actions[r])
                for pos, start, end in times:
                    a, role = plan.actions[r][pos], kinds_roles[pos]
                    if role == WAIT:
                        blocking.add(a.kind)
                        key: tuple[str, Any] = ("rank", (a.kind, r))
                    else:
                        key = ("stage", (a.kind, a.stage)) if a.stage is not None else \
                            ("layer", (a.kind, a.layer)) if a.layer is not None else ("rank", (a.kind, r))
                    samples[key].append(end - start)
                    samples[("kind", a.kind)].append(end - start)
        if not samples:
            raise ValueError("PlanCosts.fit: no measured actions (run the step with pipeline(..., trace=True))")
        tables: dict[str, dict[Any, float]] = {"kind": {}, "stage": {}, "layer": {}, "rank": {}}
        for (table, key), values in samples.items():
            kind = key if table == "kind" else key[0]
            tables[table][key] = min(values) if kind in blocking else statistics.median(values)
        return cls(**tables, comm=comm or CommModel(), unit_us=1e6)


def _check_ranks(plan: Plan, per_rank: Sequence[Sequence[tuple[int, float, float]]], what: str) -> None:
    if len(per_rank) != plan.mesh.size:
        raise ValueError(f"{what}: got action times of {len(per_rank)} ranks for a plan of {plan.mesh.size}")
    for r, times in enumerate(per_rank):
        for pos, start, end in times:
            if not 0 <= pos < len(plan.actions[r]):
                raise ValueError(f"{what}: rank {r} has {len(plan.actions[r])} actions, not one at position {pos}")
            if end < start:
                raise ValueError(f"{what}: rank {r}'s action {plan.actions[r][pos]} ends ({end}) before it starts ({start})")


# -- the timeline -------------------------------------------------------------------------------
_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}
_SHORT = {LOSS: "L", UPDATE: "U", GATHER: "G", WAIT_GATHER: "wG", FREE: "fr", REDUCE_SCATTER: "RS", WAIT_REDUCE: "wRS",
          GATHER_PARAMS: "GP", WAIT_PARAMS: "wGP", SEND_ACTIVATION: "sa", RECV_ACTIVATION: "ra", SEND_GRAD: "sg",
          RECV_GRAD: "rg", SEND_TIED: "st", RECV_TIED: "rt", SUM_TIED: "tie", WAIT_SENDS: "ws", FINISH_GRADS: "fin",
          REDUCE_METRICS: "M", WAIT_METRICS: "wM"}


def short_label(action: Action) -> str:
    """A few characters for a drawing: ``0F1`` (stage 0, forward, micro-batch 1), ``wG`` (wait_gather) ..."""
    if action.kind in _LETTER:
        stage = "" if action.stage is None else str(action.stage)
        return f"{stage}{_LETTER[action.kind]}{'' if action.microbatch is None else action.microbatch}"
    mb = "" if action.microbatch is None or action.kind != LOSS else str(action.microbatch)
    return _SHORT.get(action.kind, action.kind) + mb


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
    def from_measured(cls, plan: Plan, action_times: Sequence[Sequence[tuple[int, float, float]]],
                      name: str = "measured") -> PlanTimeline:
        """The timeline of one measured step: per rank, ``metrics["action_times"]`` (seconds, one clock)."""
        _check_ranks(plan, action_times, "PlanTimeline.from_measured")
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
        """Time each rank spends computing (forward, backward, I, W, loss, update)."""
        return tuple(sum(s.end - s.start for s in row if s.compute) for row in self.ranks)

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


# -- the simulation -----------------------------------------------------------------------------
class PlanDeadlock(RuntimeError):
    """Some ranks of a Plan wait forever; ``blocked`` maps each such rank to (index, action, why)."""

    def __init__(self, blocked: Mapping[int, tuple[int, Action, str]]) -> None:
        self.blocked = dict(blocked)
        lines = [f"  rank {r}: action {i} {a}: {why}" for r, (i, a, why) in sorted(self.blocked.items())]
        super().__init__("the plan deadlocks; these ranks wait forever:\n" + "\n".join(lines))


class PlanMismatch(ValueError):
    """The ranks' action lists do not fit together (a send nobody receives, collectives out of step)."""


@dataclass
class _Call:
    """One collective over one group: who has arrived when, and when it completes."""

    action: Action
    group: tuple[int, ...]
    arrived: dict[int, float] = field(default_factory=dict)
    issued_by: dict[int, int] = field(default_factory=dict)  # rank -> action index
    done: float | None = None


def _channel(rank: int, peer: int, a: Action) -> tuple[Any, ...]:
    """What a send or receive carries, the same on both ends: (sender, receiver, axis, payload)."""
    if a.kind in (SEND_TIED, RECV_TIED):
        payload: tuple[Any, ...] = ("tied", a.tied)
    elif a.kind == SEND_ACTIVATION:
        payload = ("activation", a.stage, a.microbatch)
    elif a.kind == RECV_ACTIVATION:
        payload = ("activation", None if a.stage is None else a.stage - 1, a.microbatch)
    elif a.kind == SEND_GRAD:
        payload = ("grad", a.stage, a.microbatch)
    else:
        payload = ("grad", None if a.stage is None else a.stage + 1, a.microbatch)
    src, dst = (rank, peer) if a.kind in _SENDS else (peer, rank)
    return (src, dst, a.axis, *payload)


class _Simulation:
    def __init__(self, plan: Plan, costs: PlanCosts) -> None:
        self.plan, self.costs, self.mesh = plan, costs, plan.mesh
        n = plan.mesh.size
        self.roles = [roles(actions) for actions in plan.actions]
        self.pos, self.clock = [0] * n, [0.0] * n
        self.rows: list[list[PlanSlot]] = [[] for _ in range(n)]
        self.transfers: list[list[Transfer]] = [[] for _ in range(n)]
        self.mail: dict[tuple[Any, ...], deque[float]] = defaultdict(deque)
        self.outbox: list[list[float]] = [[] for _ in range(n)]  # delivery times of undelivered sends
        self.calls: dict[tuple[Any, ...], _Call] = {}
        self.seq: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]
        self.pending: list[dict[tuple[str, str | None], _Call]] = [{} for _ in range(n)]
        self.first_metrics: list[_Call | None] = [None] * n
        self.joined: list[_Call | None] = [None] * n  # the sync collective a blocked rank has arrived at

    def run(self) -> PlanTimeline:
        actions = self.plan.actions
        while True:
            progressed = False
            for r in range(self.mesh.size):
                while self.pos[r] < len(actions[r]) and self._advance(r):
                    progressed = True
            if all(self.pos[r] == len(actions[r]) for r in range(self.mesh.size)):
                break
            if not progressed:
                raise PlanDeadlock({r: (self.pos[r], actions[r][self.pos[r]], self._why_blocked(r))
                                    for r in range(self.mesh.size) if self.pos[r] < len(actions[r])})
        self._check_all_matched()
        return PlanTimeline(self.plan, tuple(map(tuple, self.rows)), tuple(map(tuple, self.transfers)),
                            unit_us=self.costs.unit_us, name="simulated")

    def _peer_rank(self, r: int, a: Action) -> int:
        if a.axis is None or a.peer is None:
            raise PlanMismatch(f"rank {r}: {a} needs a mesh axis and a peer to pair with its other end")
        return self.mesh.rank_of({**self.mesh.coords_of(r), a.axis: a.peer})

    def _transfer_time(self, a: Action, op: str, n: int) -> float:
        sizes = [w.nbytes for w in a.wire] or [0]  # an unknown payload still costs its latency
        return sum(self.costs.comm.time(op, nbytes, n) for nbytes in sizes)

    def _advance(self, r: int) -> bool:
        """Run rank ``r``'s next action if nothing it needs is missing; False if it must wait."""
        i = self.pos[r]
        a, role = self.plan.actions[r][i], self.roles[r][i]
        start, cost = self.clock[r], self.costs.of(a, r)
        if a.kind in _SENDS:
            end = start + cost
            delivered = end + self._transfer_time(a, "send", 2)
            self.mail[_channel(r, self._peer_rank(r, a), a)].append(delivered)
            self.outbox[r].append(delivered)
            self.transfers[r].append(Transfer(r, i, a, end, delivered))
        elif a.kind in _RECVS:
            queue = self.mail.get(_channel(r, self._peer_rank(r, a), a))
            if not queue:
                return False
            end = max(start, queue.popleft()) + cost
        elif role == ISSUE:  # an async collective
            end = start + cost
            call = self._arrive(r, i, a, end)
            if a.kind == REDUCE_METRICS:
                self.first_metrics[r] = call
            else:
                self.pending[r][(a.kind, a.layer)] = call
        elif a.kind in _WAIT_OF or a.kind == WAIT_METRICS:
            call = self._issued_call(r, a)
            if call.done is None:
                return False
            end = max(start, call.done) + cost
            if a.kind == WAIT_METRICS:
                self.first_metrics[r] = None
            else:
                del self.pending[r][(_WAIT_OF[a.kind], a.layer)]
        elif a.kind == REDUCE_METRICS:  # sync: the first all-reduce must be in, then every member here
            first = self.first_metrics[r]
            if first is not None and first.done is None:
                return False
            if self.joined[r] is None:
                ready = start if first is None or first.done is None else max(start, first.done)
                self.joined[r] = self._arrive(r, i, a, ready)
            joined = self.joined[r]
            assert joined is not None
            if joined.done is None:
                return False
            self.first_metrics[r] = self.joined[r] = None
            end = joined.done + cost
        elif a.kind in (WAIT_SENDS, SUM_TIED):  # the executor waits for every send so far in both
            end = max([start, *self.outbox[r]]) + cost
            self.outbox[r].clear()
        else:
            end = start + cost
        self.rows[r].append(PlanSlot(r, i, a, start, end, role))
        self.clock[r], self.pos[r] = end, i + 1
        return True

    def _issued_call(self, r: int, a: Action) -> _Call:
        call = self.first_metrics[r] if a.kind == WAIT_METRICS else self.pending[r].get((_WAIT_OF[a.kind], a.layer))
        if call is None:
            raise PlanMismatch(f"rank {r}: {a} waits for a collective this rank never issued before it")
        return call

    def _arrive(self, r: int, i: int, a: Action, when: float) -> _Call:
        """Rank ``r`` issues collective ``a`` at ``when``: the k-th over its axis meets the group's k-th."""
        if a.axis is None:
            raise PlanMismatch(f"rank {r}: collective {a} names no mesh axis")
        group = self.mesh.group_ranks(a.axis, r)
        k = self.seq[r][a.axis]
        self.seq[r][a.axis] = k + 1
        call = self.calls.setdefault((a.axis, group, k), _Call(a, group))
        if (call.action.kind, call.action.layer) != (a.kind, a.layer):
            first = next(iter(call.issued_by))
            raise PlanMismatch(
                f"collective {k} over axis {a.axis!r} of ranks {list(group)}: rank {first} issues "
                f"{call.action} but rank {r} issues {a} (action {i}); every rank of a group must issue the same "
                "collectives in the same order"
            )
        call.arrived[r], call.issued_by[r] = when, i
        if len(call.arrived) == len(group):
            begin = max(call.arrived.values())
            nbytes_of = max(group, key=lambda m: self.plan.actions[m][call.issued_by[m]].nbytes)
            op = a.op or "psum"
            call.done = begin + self._transfer_time(self.plan.actions[nbytes_of][call.issued_by[nbytes_of]], op, len(group))
            for m in group:
                self.transfers[m].append(Transfer(m, call.issued_by[m], self.plan.actions[m][call.issued_by[m]],
                                                  begin, call.done))
        return call

    def _why_blocked(self, r: int) -> str:
        i = self.pos[r]
        a = self.plan.actions[r][i]
        if a.kind in _RECVS:
            src = self._peer_rank(r, a)
            return f"no matching send from rank {src} is ever issued ({self._where(src)})"
        if a.kind == REDUCE_METRICS and self.joined[r] is None:
            call = self.first_metrics[r]
        else:
            call = self.joined[r] if a.kind == REDUCE_METRICS else self._issued_call(r, a)
        assert call is not None
        missing = [m for m in call.group if m not in call.arrived]
        return (f"{call.action} over axis {call.action.axis!r} needs ranks {missing} too, which never issue it ("
                + "; ".join(self._where(m) for m in missing) + ")")

    def _where(self, r: int) -> str:
        actions = self.plan.actions[r]
        if self.pos[r] == len(actions):
            return f"rank {r} has finished"
        return f"rank {r} is stuck at action {self.pos[r]} {actions[self.pos[r]]}"

    def _check_all_matched(self) -> None:
        for (src, dst, axis, *payload), queue in self.mail.items():
            if queue:
                raise PlanMismatch(f"rank {src} sends {payload} over axis {axis!r} to rank {dst}, "
                                   f"which never receives it ({len(queue)} message(s) left)")
        for (axis, group, k), call in self.calls.items():
            if call.done is None:
                missing = [m for m in group if m not in call.arrived]
                raise PlanMismatch(f"collective {k} over axis {axis!r}: {call.action} is issued by ranks "
                                   f"{sorted(call.arrived)} but never by ranks {missing}")


def simulate(plan: Plan, costs: PlanCosts | None = None) -> PlanTimeline:
    """When every rank of ``plan`` runs each action under ``costs`` (see the module docstring).

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import mlp
    >>> chain, params = sw.functionalize(mlp([4, 8, 8, 2]))
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> plan = sw.pipeline(step, "pp", "1f1b", 2).plan(sw.Mesh(pp=2), params)
    >>> timeline = simulate(plan)
    >>> timeline.makespan, round(timeline.bubble_fraction, 3)
    (9.0, 0.333)
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"simulate(plan) needs a shardwise Plan (step.plan(mesh, params, batch)), got {type(plan).__name__}")
    if costs is None:
        costs = PlanCosts()
    elif not isinstance(costs, PlanCosts):
        raise TypeError(f"simulate(plan, costs): costs must be a PlanCosts, got {type(costs).__name__}")
    return _Simulation(plan, costs).run()
