"""``simulate(schedule, costs) -> Timeline``: when each action runs, the bubble and the activation peak.

``simulate(plan, costs)`` takes a whole step's Plan instead (any composition:
``step.plan(mesh, params, batch)``) and returns the engine's ``PlanTimeline``
(``shardwise/engine/simulate/``: computes, transfers and collectives, with a
latency + bandwidth model); a schedule's ``Costs`` apply to it too.

Each rank runs its actions in order; an action starts when its rank is free
and every action it needs has finished, plus ``comm`` for a result that
comes from another rank. Durations come from ``Costs`` (by default F=1, B=2,
I=1, W=1, comm=0: a backward costs two forwards, as in the 1F1B and
zero-bubble analyses). Integer costs give integer times, so bubble figures
can be checked exactly.

A measured run gives the same ``Timeline`` through ``Timeline.from_measured``,
so the drawings and the bubble figure work on runtime traces too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple, overload

from ...engine.plan.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Plan
from ...engine.simulate.costs import CommModel, PlanCosts
from ...engine.simulate.simulation import simulate as simulate_plan
from ...engine.simulate.timeline import PlanTimeline, chrome_event, thread_name
from .schedule import KINDS, B, F, I, PipeOp, Schedule, W
from .validate import validate


@dataclass(frozen=True)
class Costs:
    """Duration of each kind of action, optionally per stage, and of a cross-rank transfer.

    ``per_stage`` maps ``(stage, kind)`` to a duration that overrides the
    kind's default for that stage (measured costs of unbalanced stages).
    """

    forward: float = 1
    backward: float = 2
    backward_input: float = 1
    backward_weight: float = 1
    comm: float = 0
    per_stage: Mapping[tuple[int, str], float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "comm"):
            if not _duration(getattr(self, name)):
                raise ValueError(f"Costs.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        for key, value in self.per_stage.items():
            stage, kind = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
            if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0 or kind not in KINDS or (
                    not _duration(value)):
                raise ValueError(
                    f"Costs.per_stage[{key!r}] = {value!r}: the key is (stage, kind), a stage >= 0 and a kind of "
                    f"{'/'.join(KINDS)}, and the cost a finite number >= 0"
                )
        object.__setattr__(self, "per_stage", MappingProxyType(dict(self.per_stage)))

    @classmethod
    def from_mapping(cls, costs: Mapping[Any, float]) -> Costs:
        """``{"F": 1, "B": 2, "I": 1, "W": 1, "comm": 0, (stage, "F"): 1.5, ...}``; missing keys keep defaults."""
        by_kind = {F: "forward", B: "backward", I: "backward_input", W: "backward_weight", "comm": "comm"}
        kwargs: dict[str, float] = {}
        per_stage: dict[tuple[int, str], float] = {}
        for key, value in costs.items():
            if isinstance(key, tuple) and len(key) == 2:
                per_stage[(int(key[0]), str(key[1]))] = value
            elif key in by_kind:
                kwargs[by_kind[key]] = value
            else:
                raise ValueError(f"unknown cost key {key!r}: use F, B, I, W, comm or (stage, kind)")
        return cls(**kwargs, per_stage=per_stage)

    def of(self, op: PipeOp) -> float:
        """How long ``op`` takes."""
        override = self.per_stage.get((op.stage, op.kind))
        if override is not None:
            return override
        return {F: self.forward, B: self.backward, I: self.backward_input, W: self.backward_weight}[op.kind]


def _duration(value: Any) -> bool:
    """A finite number >= 0 (not a bool, not a string)."""
    return isinstance(value, int | float | Fraction) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0)


class Slot(NamedTuple):
    """One action on a timeline: ``op`` ran from ``start`` to ``end``."""

    op: PipeOp
    start: float
    end: float

    # What the drawings read of any slot (a Plan's slots have the same): label, colour key, roles.
    @property
    def label(self) -> str:
        return str(self.op)

    @property
    def kind(self) -> str:
        return self.op.kind

    @property
    def compute(self) -> bool:
        return True

    @property
    def waiting(self) -> bool:
        return False


@dataclass(frozen=True)
class Timeline:
    """Per-rank ``(op, start, end)`` lists, in execution order, with time 0 the earliest start.

    ``unit_us`` is how many microseconds one time unit lasts in a Chrome trace
    (simulated units are drawn as milliseconds; measured times are seconds).
    """

    schedule: Schedule
    ranks: tuple[tuple[Slot, ...], ...]
    unit_us: float = 1000.0

    @classmethod
    def from_measured(
        cls, schedule: Schedule, events: Iterable[tuple[int, PipeOp | str, float, float]]
    ) -> Timeline:
        """A timeline from measured ``(rank, op, start_s, end_s)`` events (any clock, in seconds)."""
        rows: list[list[Slot]] = [[] for _ in range(schedule.num_ranks)]
        for rank, op, start, end in events:
            if not 0 <= rank < schedule.num_ranks:
                raise ValueError(f"event for {op} on rank {rank}, but the schedule has {schedule.num_ranks} ranks")
            if end < start:
                raise ValueError(f"event for {op} on rank {rank} ends ({end}) before it starts ({start})")
            rows[rank].append(Slot(op if isinstance(op, PipeOp) else PipeOp.parse(op), start, end))
        origin = min((slot.start for row in rows for slot in row), default=0.0)
        ranks = tuple(
            tuple(Slot(s.op, s.start - origin, s.end - origin) for s in sorted(row, key=lambda s: s.start))
            for row in rows
        )
        return cls(schedule, ranks, unit_us=1e6)

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def transfers(self) -> tuple[()]:
        """Nothing is drawn in flight: a schedule's transfers are its ``comm`` cost between ranks."""
        return ()

    @property
    def makespan(self) -> float:
        """When the last action ends."""
        return max((slot.end for row in self.ranks for slot in row), default=0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank spends computing."""
        return tuple(sum(slot.end - slot.start for slot in row) for row in self.ranks)

    @property
    def bubble_fraction(self) -> float:
        """``1 - busy / (ranks * makespan)``: the idle share of the ranks' time, rounded once."""
        span = Fraction(self.makespan) * len(self.ranks)
        if span == 0:
            return 0.0
        return float(1 - sum(Fraction(b) for b in self.busy) / span)

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the most (stage, microbatch) forward activations held at once.

        Convention: an activation is held from its F until its B, or until its
        W when the backward is split (W still needs the stage's inputs), and
        counted in execution order; stage sizes are not weighed.
        """
        peaks = []
        for row in self.ranks:
            held = peak = 0
            for slot in row:
                held += 1 if slot.op.kind == F else -1 if slot.op.kind in (B, W) else 0
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def to_chrome_trace(self, unit_us: float | None = None) -> dict[str, Any]:
        """Chrome trace JSON (Perfetto, chrome://tracing): one complete ("X") event per action, tid = rank."""
        scale = self.unit_us if unit_us is None else unit_us
        events = [thread_name(rank, f"rank {rank}") for rank in range(len(self.ranks))]
        for rank, row in enumerate(self.ranks):
            events += [
                chrome_event(str(slot.op), slot.op.kind, rank, slot.start, slot.end, scale,
                             {"stage": slot.op.stage, "microbatch": slot.op.microbatch})
                for slot in row
            ]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": self.schedule.name}}


_PLAN_KIND = {F: FORWARD, B: BACKWARD, I: BACKWARD_INPUT, W: BACKWARD_WEIGHT}


def plan_costs(costs: Costs) -> PlanCosts:
    """A schedule's ``Costs`` for a Plan: the same compute times, and ``comm`` as each transfer's latency."""
    return PlanCosts(
        kind={FORWARD: costs.forward, BACKWARD: costs.backward, BACKWARD_INPUT: costs.backward_input,
              BACKWARD_WEIGHT: costs.backward_weight},
        stage={(_PLAN_KIND[kind], stage): value for (stage, kind), value in costs.per_stage.items()},
        # A schedule knows no metrics all-reduce: free here, so that both simulations agree.
        comm=CommModel(alpha={"send": costs.comm, "psum": 0.0}),
    )


@overload
def simulate(schedule: Schedule, costs: Costs | Mapping[Any, float] | None = None) -> Timeline: ...
@overload
def simulate(schedule: Plan, costs: PlanCosts | Costs | Mapping[Any, float] | None = None) -> PlanTimeline: ...
def simulate(
    schedule: Schedule | Plan, costs: PlanCosts | Costs | Mapping[Any, float] | None = None
) -> Timeline | PlanTimeline:
    """Run ``schedule`` on paper under ``costs``; raises ``ScheduleError`` if it is invalid.

    Given a ``Plan`` (``step.plan(mesh, params, batch)``), simulate the whole step instead
    (a ``sw.plan.PlanTimeline``) under ``sw.plan.PlanCosts``, or a schedule's ``Costs``.
    """
    if isinstance(schedule, Plan):
        if isinstance(costs, Mapping):
            costs = Costs.from_mapping(costs)
        return simulate_plan(schedule, plan_costs(costs) if isinstance(costs, Costs) else costs)
    if isinstance(costs, PlanCosts):
        raise TypeError("simulate(schedule, costs): PlanCosts are for a Plan; give a schedule Costs")
    if not isinstance(schedule, Schedule):
        hint = (f"; a built-in's name needs its shape: get_schedule({schedule!r}, ranks, stages, microbatches)"
                if isinstance(schedule, str) else "")
        raise TypeError(f"simulate(schedule): a Schedule or a Plan, got {type(schedule).__name__}{hint}")
    validate(schedule)
    if costs is None:
        costs = Costs()
    elif isinstance(costs, Mapping):
        costs = Costs.from_mapping(costs)
    elif not isinstance(costs, Costs):
        raise TypeError(f"simulate(schedule, costs): Costs or a mapping such as {{'F': 1, 'B': 2}}, got "
                        f"{type(costs).__name__}")
    if unknown := sorted({stage for stage, _ in costs.per_stage} - set(range(schedule.num_stages))):
        raise ValueError(f"simulate: Costs.per_stage names stages {unknown}, but the schedule has stages 0.."
                         f"{schedule.num_stages - 1}: those costs would price nothing")
    finish: dict[PipeOp, float] = {}
    rows: list[list[Slot]] = [[] for _ in range(schedule.num_ranks)]
    free: list[float] = [0] * schedule.num_ranks
    progress = True
    while progress:  # validate() guarantees every pass until the end makes progress
        progress = False
        for rank, ops in enumerate(schedule.ranks):
            while len(rows[rank]) < len(ops):
                op = ops[len(rows[rank])]
                deps = schedule.dependencies(op)
                if any(d not in finish for d in deps):
                    break
                ready = [finish[d] + (costs.comm if schedule.placement[d.stage] != rank else 0) for d in deps]
                start = max([free[rank], *ready])
                end = start + costs.of(op)
                finish[op] = free[rank] = end
                rows[rank].append(Slot(op, start, end))
                progress = True
    return Timeline(schedule, tuple(tuple(row) for row in rows))
