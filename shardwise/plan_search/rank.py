"""Pricing one candidate: apply it, plan it, check its memory, simulate its step.

Each stage can refuse: the transforms (``compose``: the stack cannot work), the lowering
(``plan``: e.g. a batch the mesh and micro-batches cannot cut), the memory budget
(``memory``) or the simulation (``simulate``). A refusal keeps its reason; nothing is
dropped silently. The Plan is made once per candidate, with the parameters on the meta
device (shapes are all it needs), and read three times: its memory, its bytes per axis, and
its actions, priced by :func:`plan_costs` and simulated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..engine.plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTES,
    LOSS,
    UPDATE,
    Action,
    Plan,
)
from ..engine.simulate.costs import CommModel, PlanCosts
from ..engine.simulate.simulation import simulate
from ..engine.simulate.timeline import ISSUE, SENDS, roles
from ..engine.step.step import Step
from .candidate import Candidate
from .compute import LayerCosts, MeasurementFailed
from .replicas import one_replica, replica_comm
from .units import format_bytes

COMPOSE, PLAN, MEMORY, MEASURE, SIMULATE, CERTIFY = "compose", "plan", "memory", "measure", "simulate", "certify"


@dataclass(frozen=True)
class Priced:
    """A candidate that fits: its ready ``step`` (the transforms applied to the base step) for
    ``mesh``, its simulated ``time`` per step (seconds), the ``peak`` bytes each rank holds and
    the bytes each rank puts on the wire per mesh axis (the busiest rank's)."""

    candidate: Candidate
    step: Step = field(repr=False)
    plan: Plan = field(repr=False)
    time: float
    peak: tuple[int, ...]
    bytes_per_axis: Mapping[str, int]
    certified: str | None = None

    @property
    def mesh(self) -> Any:
        return self.candidate.mesh

    @property
    def memory(self) -> int:
        """The largest predicted peak of any rank."""
        return max(self.peak)

    @property
    def unknown_bytes_on(self) -> tuple[str, ...]:
        """The axes with a transfer whose payload the plan does not know, counted 0 in ``bytes_per_axis``
        (a pipeline's boundary after a layer that ran on stand-ins: :meth:`Plan.why_unknown`)."""
        return tuple(sorted({a.axis for actions in self.plan.actions for a in actions
                             if a.op is not None and a.axis is not None and not a.wire}))

    def as_dict(self) -> dict[str, Any]:
        return {"stack": str(self.candidate), **self.candidate.as_dict(), "time_s": self.time,
                "peak_bytes": self.memory, "bytes_per_axis": dict(self.bytes_per_axis),
                "bytes_unknown_on": list(self.unknown_bytes_on), "certified": self.certified}


@dataclass(frozen=True)
class Refused:
    """A candidate left out at ``stage`` (compose, plan, memory, measure, simulate, certify), and why:
    ``reason`` is shared by the candidates left out alike, ``detail`` is this one's own."""

    candidate: Candidate
    stage: str
    reason: str
    detail: str = ""


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def bytes_per_axis(plan: Plan) -> dict[str, int]:
    """Per mesh axis, the most bytes any one rank sends over it in the step (all ops together)."""
    per_axis: dict[str, list[int]] = {}
    for (axis, _op), per_rank in plan.comm_bytes().items():
        totals = per_axis.setdefault(axis, [0] * len(per_rank))
        for r, n in enumerate(per_rank):
            totals[r] += n
    return {axis: max(totals) for axis, totals in sorted(per_axis.items())}


def _stage_layers(plan: Plan, names: Sequence[str]) -> dict[int, list[str]]:
    """Pipeline stage -> its layers: a stage's computes name its first layer, and stages are
    consecutive runs of the chain."""
    first: dict[int, str] = {}
    for actions in plan.actions:
        for a in actions:
            if a.kind in COMPUTES and a.stage is not None and a.layer is not None:
                first[a.stage] = a.layer
    starts = sorted((names.index(layer), stage) for stage, layer in first.items())
    bounds = [i for i, _ in starts] + [len(names)]
    return {stage: list(names[bounds[j]:bounds[j + 1]]) for j, (_, stage) in enumerate(starts)}


def _shares(step: Step, candidate: Candidate, params: Any, ranks: int) -> list[dict[str, float]]:
    """Per rank (the first ``ranks``), per layer: the share of the layer's parameters the rank
    computes with (tensor parallel splits them; 1 elsewhere), which a compute's cost scales with
    as with its batch."""
    mesh = candidate.mesh
    full = {layer: sum(t.numel() for t in tensors.values()) for layer, tensors in params.items()}
    shares = []
    for r in range(ranks):
        local = step.local_view(params, mesh, r) if step.split.axes else params
        shares.append({layer: (sum(t.numel() for t in local[layer].values()) / n if n else 1.0)
                       for layer, n in full.items()})
    return shares


def plan_costs(
    plan: Plan, step: Step, candidate: Candidate, costs: LayerCosts, params: Any, *,
    comm: CommModel, cores: int | None, base_opt_bytes: int,
) -> PlanCosts:
    """Every action of ``plan`` priced from single-device ``costs``: a compute at its share of
    the batch (``1 / (dp x replicas x ep x cp x micro-batches)``) times its layers' share of the parameters, the
    loss at its share of the batch, the update and the other bookkeeping at the rank's share
    of the optimizer state, each action also the executor's time per action; collectives and
    transfers by ``comm``, whose :meth:`~CommModel.issue_time` each send and async collective
    also costs its rank's CPU when issued. ``plan`` may be :func:`~shardwise.plan_search.replicas.one_replica`'s
    (its ranks are the first of the candidate's mesh)."""
    names = list(step.chain.names)
    per_stage = _stage_layers(plan, names) if candidate.pp > 1 else {}
    shares = _shares(step, candidate, params, len(plan.actions))
    batch_share = 1.0 / (candidate.batch_ways * candidate.microbatches)
    opt = plan.memory.get("opt_state")
    state_bytes = plan.memory.get("params")
    by_kind: dict[str, float] = {}
    for (kind, _layer), seconds in costs.full.items():
        if kind not in COMPUTES:
            by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    slot: dict[tuple[int, int], float] = {}
    for r, actions in enumerate(plan.actions):
        slot.update({(r, pos): costs.per_action for pos in range(len(actions))})
        if base_opt_bytes and opt is not None:
            state_share = opt[r] / base_opt_bytes
        else:  # a stateless optimizer (plain SGD): the parameters' share instead
            state_share = 1.0 if state_bytes is None else state_bytes[r] / max(1, sum(
                t.numel() * t.element_size() for tensors in params.values() for t in tensors.values()))
        parts = _update_parts(actions, params)
        issuing = roles(actions)
        for pos, a in enumerate(actions):
            if a.kind in COMPUTES and a.layer is not None:
                layers = per_stage.get(a.stage, [a.layer]) if a.stage is not None and per_stage else [a.layer]
                # Zero-bubble schedules split a backward in two: each half of the measured one.
                kind, half = (BACKWARD, 0.5) if a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) else (a.kind, 1.0)
                slot[(r, pos)] += half * sum(
                    costs.at(kind, layer, batch_share * shares[r].get(layer, 1.0)) for layer in layers)
            elif a.kind == LOSS:
                slot[(r, pos)] += costs.at(LOSS, None, batch_share)
            elif a.kind in by_kind:
                slot[(r, pos)] += by_kind[a.kind] * min(1.0, state_share) * parts.get(pos, 1.0)
            if issuing[pos] == ISSUE and a.op is not None:  # each call's own: its copy, the hand-off
                op = "send" if a.kind in SENDS else a.op
                slot[(r, pos)] += sum(comm.issue_time(op, w.nbytes) for w in a.wire) if a.wire \
                    else comm.issue_time(op, 0)
    return PlanCosts(slot=slot, comm=comm.covering(plan)[0], cores=cores, unit_us=1e6)


def _update_parts(actions: Sequence[Action], params: Any) -> dict[int, float]:
    """Each update's share of its rank's update, by its units' parameter counts (ZeRO-1/2 update
    bucket by bucket; equal shares where a unit is not a layer of ``params``)."""
    parts = {pos: a.units or (a.layer,) for pos, a in enumerate(actions) if a.kind == UPDATE}
    if len(parts) < 2:
        return {}
    sizes = {pos: sum(t.numel() for u in units for t in params.get(u, {}).values()) for pos, units in parts.items()}
    total = sum(sizes.values())
    if not total or not all(sizes.values()):
        return dict.fromkeys(parts, 1.0 / len(parts))
    return {pos: size / total for pos, size in sizes.items()}


def simulated_time(
    plan: Plan, step: Step, candidate: Candidate, costs: LayerCosts, params: Any, *,
    comm: CommModel, cores: int | None, base_opt_bytes: int,
) -> float:
    """The simulated makespan of ``plan``: of one data-parallel replica when the ranks have a core
    each (the same time, ``dp x`` fewer ranks to walk: ``replicas.py``), else of every rank."""
    if candidate.dp > 1 and candidate.replicate == 1 and cores is None:
        reduced = one_replica(plan, candidate.dp)
        priced = plan_costs(reduced, step, candidate, costs, params, comm=comm, cores=None,
                            base_opt_bytes=base_opt_bytes)
        priced = replace(priced, comm=replica_comm(priced.comm, candidate.dp, reduced.mesh.size))
        return float(simulate(reduced, priced).makespan)
    priced = plan_costs(plan, step, candidate, costs, params, comm=comm, cores=cores, base_opt_bytes=base_opt_bytes)
    return float(simulate(plan, priced).makespan)


def price(
    candidate: Candidate, base: Step, params: Any, batch: Any, *,
    budget: int, tp_plan: Mapping[str, Any] | None, compute: Callable[[Candidate], LayerCosts],
    comm: CommModel, cores: int | None, base_opt_bytes: int, applied: Step | None = None,
) -> Priced | Refused:
    """``candidate`` priced, or refused with the stage and reason (``applied``: its transforms on
    ``base`` already, when the caller has them)."""
    try:
        step = applied if applied is not None else candidate.apply(base, tp_plan)
    except (ValueError, TypeError) as err:
        return Refused(candidate, COMPOSE, first_line(err))
    try:
        plan = step.plan(candidate.mesh, params, batch)
    except (ValueError, TypeError, RuntimeError) as err:
        return Refused(candidate, PLAN, first_line(err))
    peak = plan.memory["peak"]
    if max(peak) > budget:
        return Refused(candidate, MEMORY, f"a rank's predicted peak is over the budget of {format_bytes(budget)}",
                       f"peak {max(peak)} bytes on rank {peak.index(max(peak))}")
    try:
        costs = compute(candidate)
    except MeasurementFailed as err:
        return Refused(candidate, MEASURE, str(err))
    try:
        seconds = simulated_time(plan, step, candidate, costs, params, comm=comm, cores=cores,
                                 base_opt_bytes=base_opt_bytes)
    except (ValueError, RuntimeError) as err:
        return Refused(candidate, SIMULATE, first_line(err))
    return Priced(candidate, step, plan, float(seconds), tuple(peak), bytes_per_axis(plan))


def meta(params: Any) -> Any:
    """``params`` on the meta device: what planning needs (shapes and dtypes), no data."""
    return {layer: {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in tensors.items()}
            for layer, tensors in params.items()}
