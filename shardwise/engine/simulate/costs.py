"""What a Plan's actions cost: :class:`PlanCosts` (per action on its rank) and :class:`CommModel`
(collectives and transfers), set by hand or fitted from measured runs.

The communication model is a ring's: ``alpha x steps + beta x bytes x factor``
per tensor, per op, over a group of ``n`` ranks: all-gather ``n-1`` steps moving
``n-1`` times its input (a shard), reduce-scatter ``n-1`` and ``(n-1)/n`` of its
input, all-reduce twice those, a send one message of its bytes.
:meth:`CommModel.from_benchmark` fits alpha and beta by least squares (on
relative error) to ``benchmarks/collectives.py``'s JSON lines;
:meth:`PlanCosts.fit` reads every action's cost from measured steps.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    INSIDE,
    REDUCE_METRICS,
    WAIT_METRICS,
    Action,
    Plan,
)
from .timeline import (
    COMPUTE_KINDS,
    ISSUE,
    KINDS,
    RECVS,
    SENDS,
    WAIT,
    WAIT_OF,
    ActionTimes,
    channel,
    check_action_times,
    peer_rank,
    roles,
)

DEFAULT_COSTS = MappingProxyType({FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0})


def _ring(steps: Callable[[int], float], factor: Callable[[int], float]) -> Callable[[int], tuple[float, float]]:
    """A collective's shape over ``n`` ranks; a group of one moves nothing."""
    return lambda n: (steps(n), factor(n)) if n > 1 else (0.0, 0.0)


# The one table of what each op costs, whoever issues it (ZeRO, the metrics, a split's layers, a
# pipeline's transfers): (latency steps, bytes on one link per input byte) as a ring over n ranks.
RING_SHAPES: Mapping[str, Callable[[int], tuple[float, float]]] = MappingProxyType({
    "all_gather": _ring(lambda n: n - 1, lambda n: n - 1),
    "psum_scatter": _ring(lambda n: n - 1, lambda n: (n - 1) / n),
    "psum": _ring(lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    # n - 1 pairwise steps, each rank sending the (n - 1) / n of its input that other ranks own
    "all_to_all": _ring(lambda n: n - 1, lambda n: (n - 1) / n),
    "ppermute": lambda n: (1.0, 1.0),  # each rank sends its input to one peer (a ring's pass)
    "send": lambda n: (1.0, 1.0),
})
COMM_OPS = tuple(RING_SHAPES)


def ring_shape(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bytes on one link per input byte) of ``op`` as a ring over ``n`` ranks."""
    shape = RING_SHAPES.get(op)
    if shape is None:
        raise ValueError(f"no communication model for op {op!r}; the model knows {COMM_OPS}")
    return shape(n)


def _frozen(mapping: Mapping[Any, float], what: str) -> Mapping[Any, float]:
    for key, value in mapping.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{what}[{key!r}] = {value}: a time must be finite and >= 0")
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class CommModel:
    """Time of a collective or transfer: per op, ``alpha`` per latency step and ``beta`` per byte on a link.
    ``issue`` and ``issue_per_byte``: what issuing one call costs the issuing rank's CPU
    (:meth:`issue_time`; the search charges it to the send or async collective's issue).

    Two levels (:meth:`two_level`): ``alpha`` and ``beta`` price a group whose ranks all sit on one
    node, ``inter``'s figures a group that spans nodes (a ring runs at its slowest link); global
    rank ``r`` sits on node ``r // ranks_per_node``. A mesh's last axis varies fastest, so in
    ``Mesh(node=8, dp=8)`` with 8 ranks per node every ``dp`` group is one node and every ``node``
    group spans eight.

    >>> model = CommModel(alpha={"send": 1e-5}, beta={"send": 1e-9})
    >>> round(model.time("send", 1000, 2), 9)
    1.1e-05
    """

    alpha: Mapping[str, float] = field(default_factory=dict)
    beta: Mapping[str, float] = field(default_factory=dict)
    inter: CommModel | None = None  # two levels: the figures of a group that spans nodes
    ranks_per_node: int | None = None  # two levels: rank r sits on node r // ranks_per_node
    # What issuing one call costs the issuing rank's CPU (seconds per call, and per byte of its
    # input), apart from the transfer: on gloo the call's copy and its hand-off to gloo's threads.
    issue: Mapping[str, float] = field(default_factory=dict)
    issue_per_byte: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "issue", "issue_per_byte"):
            table = getattr(self, name)
            if unknown := sorted(set(table) - set(COMM_OPS)):
                raise ValueError(f"CommModel.{name} has ops {unknown}; use {COMM_OPS}")
            object.__setattr__(self, name, _frozen(table, f"CommModel.{name}"))
        if (self.inter is None) != (self.ranks_per_node is None):
            raise ValueError(
                "CommModel: a two-level model needs both inter (the figures across nodes) and ranks_per_node; "
                "use CommModel.two_level(intra=..., inter=..., ranks_per_node=...)"
            )
        if self.inter is not None:
            if not isinstance(self.inter, CommModel) or self.inter.inter is not None:
                raise TypeError(f"CommModel(inter={self.inter!r}): the figures across nodes are a one-level CommModel")
            rpn = self.ranks_per_node
            if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
                raise ValueError(f"CommModel(ranks_per_node={rpn!r}): the number of ranks on a node is an int >= 1")

    @classmethod
    def two_level(cls, intra: CommModel, inter: CommModel, ranks_per_node: int) -> CommModel:
        """A model of nodes of ``ranks_per_node`` ranks: ``intra`` prices a group within one node
        (NVLink), ``inter`` one that spans nodes (the network).

        >>> fast, slow = CommModel.link(bandwidth=400e9), CommModel.link(bandwidth=40e9)
        >>> model = CommModel.two_level(intra=fast, inter=slow, ranks_per_node=8)
        >>> within = model.time("psum", 8e9, 8, ranks=range(8))  # ranks 0-7: node 0
        >>> across = model.time("psum", 8e9, 8, ranks=range(0, 64, 8))  # one rank on each of 8 nodes
        >>> round(within, 6), round(across, 6)  # 2 x 7/8 of 8 GB at 400 and at 40 GB/s
        (0.035, 0.35)
        """
        for name, model in (("intra", intra), ("inter", inter)):
            if not isinstance(model, CommModel) or model.inter is not None:
                raise TypeError(f"CommModel.two_level({name}=...): a one-level CommModel, got {model!r}")
        return replace(intra, inter=inter, ranks_per_node=ranks_per_node)

    @classmethod
    def link(cls, bandwidth: float, latency: float = 0.0) -> CommModel:
        """Every op over links of ``bandwidth`` bytes per second each way per rank, ``latency``
        seconds per ring step: beta is ``1 / bandwidth``, alpha ``latency``.

        >>> CommModel.link(bandwidth=1e9, latency=1e-5).time("all_gather", 1000, 4)  # 3 steps, 3000 bytes
        3.3e-05
        """
        for name, value in (("bandwidth", bandwidth), ("latency", latency)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (name == "bandwidth" and value == 0):
                raise ValueError(f"CommModel.link({name}={value!r}): a finite number, " +
                                 ("> 0 bytes per second" if name == "bandwidth" else ">= 0 seconds"))
        return cls(dict.fromkeys(COMM_OPS, float(latency)), dict.fromkeys(COMM_OPS, 1.0 / bandwidth))

    def level(self, ranks: Iterable[int] | None) -> CommModel:
        """The one-level figures that price a group of global ``ranks``: this model's own (one level,
        or a group within one node), or ``inter`` (a group that spans nodes)."""
        if self.inter is None:
            return self
        if ranks is None:
            raise ValueError("a two-level CommModel prices a group by where its ranks are: pass ranks=")
        assert self.ranks_per_node is not None
        nodes = {r // self.ranks_per_node for r in ranks}
        return self.inter if len(nodes) > 1 else self._intra

    @functools.cached_property
    def _intra(self) -> CommModel:
        return replace(self, inter=None, ranks_per_node=None)

    def issue_time(self, op: str, nbytes: int) -> float:
        """What issuing one ``op`` of ``nbytes`` (the rank's input) costs the issuing rank's CPU,
        before the transfer runs on its own (0 where the model has no figure for ``op``).

        >>> CommModel(issue={"send": 1e-4}, issue_per_byte={"send": 1e-9}).issue_time("send", 1000)
        0.000101
        """
        ring_shape(op, 2)  # an unknown op is refused, as in time()
        return self.issue.get(op, 0.0) + self.issue_per_byte.get(op, 0.0) * nbytes

    def time(self, op: str, nbytes: int, n: int, ranks: Iterable[int] | None = None) -> float:
        """One tensor of ``nbytes`` (one rank's input) through ``op`` over ``n`` ranks (the global
        ``ranks`` of the group: a two-level model needs them)."""
        model = self.level(ranks)
        steps, factor = ring_shape(op, n)
        return model.alpha.get(op, 0.0) * steps + model.beta.get(op, 0.0) * factor * nbytes

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, int, int, float]]) -> CommModel:
        """Least squares on relative error over ``(op, bytes, ranks, seconds)`` samples, per op.

        Each sample counts at the mean of its (op, bytes, ranks): what transfers of that size take
        on average, which is what they add up to along a step's critical path (a noisy run's
        slow tails included). A size seen often weighs more than one seen once, and a transfer
        that seemed to take microseconds (its wait began just as the data came in) moves its
        size's mean a little, where on its own, in a fit on relative error, it would set the
        fit. A fit that would make alpha or beta negative keeps that term at 0 and fits the
        other; with a single message size beta cannot be told from alpha, and only alpha is fitted.

        >>> fitted = CommModel.fit([("send", 64, 2, t) for t in (1e-6, 3e-4, 4e-4, 5e-4)])
        >>> round(fitted.alpha["send"], 6)
        0.0003
        """
        seen: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        for op, nbytes, n, seconds in samples:
            if seconds > 0:
                seen[(op, nbytes, n)].append(seconds)
        by_op: dict[str, list[tuple[float, float, float, int]]] = defaultdict(list)
        for (op, nbytes, n), times in seen.items():
            steps, factor = ring_shape(op, n)
            if steps > 0:
                by_op[op].append((steps, factor * nbytes, statistics.fmean(times), len(times)))
        alpha, beta = {}, {}
        for op, rows in by_op.items():
            alpha[op], beta[op] = _fit_two(rows)
        return cls(alpha, beta)

    def covering(self, plan: Plan) -> tuple[CommModel, tuple[str, ...]]:
        """This model with a figure for every op ``plan`` moves: those it has none for at 0 (free),
        and which they were. ``simulate`` refuses a model that has figures for some ops and not for
        one the plan moves; a fit from a run knows only the transfers some rank waited for.

        >>> import torch, shardwise as sw
        >>> from shardwise.testing.models import mlp
        >>> chain, params = sw.functionalize(mlp([4, 8, 2]))
        >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
        >>> plan = sw.shard_params(step, "dp", 3).plan(sw.Mesh(dp=2), params, (torch.randn(4, 4), torch.randn(4, 2)))
        >>> CommModel(alpha={"all_gather": 1e-4}).covering(plan)[1]
        ('psum', 'psum_scatter')
        """
        needed = {"send" if a.op in ("send", "recv") else a.op for actions in plan.actions for a in actions if a.op}
        unknown = tuple(sorted(needed - set(self.alpha) - set(self.beta)))
        covered = replace(self, alpha={**self.alpha, **dict.fromkeys(unknown, 0.0)})
        if self.inter is None:
            return covered, unknown
        inter, across = self.inter.covering(plan)  # each level covers the plan's ops on its own
        return replace(covered, inter=inter), tuple(sorted({*unknown, *across}))

    @classmethod
    def from_benchmark(cls, rows: Iterable[Mapping[str, Any]], backend: str = "gloo") -> CommModel:
        """Fit from ``benchmarks/collectives.py``'s JSON lines of ``backend`` (psum, all_gather,
        psum_scatter, and send_recv: a round trip, so two messages). Rows of ``bench:
        "collectives_issue"`` (``op``, ``bytes``, ``issue_s``: the mean time one call took to
        return, measured while the ranks compute between calls, as a step's ranks do) set
        :attr:`issue` and :attr:`issue_per_byte`, fitted per op as alpha and beta are.

        An issue row may say ``core_share``: the share of a core each rank had while it was
        measured (``cores / ranks`` when every rank computed at once on fewer cores than ranks;
        default 1). Its ``issue_s`` is a wall time, stretched by that contention; the model keeps
        what the call costs the rank's CPU, ``issue_s x core_share``, because the simulation
        stretches a rank's work by the contention of the moment itself (``PlanCosts.cores``),
        and would otherwise stretch the call twice."""
        samples = []
        issued: dict[str, list[tuple[float, float, float, int]]] = defaultdict(list)
        for row in rows:
            if row.get("bench") == "collectives_issue" and row.get("backend") == backend and row["op"] in COMM_OPS:
                share = float(row.get("core_share", 1.0))
                if not share > 0:
                    raise ValueError(f"collectives_issue row {dict(row)}: core_share is a rank's share of a core "
                                     "while measured, above 0 (cores / ranks, or 1 with a core each)")
                if float(row["issue_s"]) > 0:
                    issued[row["op"]].append((1.0, float(row["bytes"]), float(row["issue_s"]) * min(1.0, share), 1))
                continue
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
        fitted = {op: _fit_two(points) for op, points in issued.items()}
        return replace(cls.fit(samples), issue={op: a for op, (a, _) in fitted.items()},
                       issue_per_byte={op: b for op, (_, b) in fitted.items()})


def _fit_two(rows: Sequence[tuple[float, float, float, int]]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum(n * (((a*s + b*x) - t) / t)^2) over rows (s, x, t, n)."""
    w = [n / (t * t) for _, _, t, n in rows]
    ss = sum(wi * s * s for wi, (s, _, _, _) in zip(w, rows, strict=True))
    sx = sum(wi * s * x for wi, (s, x, _, _) in zip(w, rows, strict=True))
    xx = sum(wi * x * x for wi, (_, x, _, _) in zip(w, rows, strict=True))
    st = sum(wi * s * t for wi, (s, _, t, _) in zip(w, rows, strict=True))
    xt = sum(wi * x * t for wi, (_, x, t, _) in zip(w, rows, strict=True))
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

    :meth:`of` looks up, first match wins: ``slot`` by (rank, position in its
    list) (:meth:`of_step` fills it), ``action`` by the action's text
    (``"F(stage0, mb=1)"``), ``stage`` by (kind, stage), ``layer`` by (kind, layer
    or unit), ``rank`` by (kind, rank), then ``kind``; ``kind`` defaults to
    forward 1, backward 2, I 1, W 1 and 0 for every other kind. ``cores``: how
    many cores the ranks share (None: one each; fewer than the ranks: the busy
    ranks share them equally). ``unit_us``: microseconds per time unit in a
    Chrome trace (1e6 for costs in seconds).
    """

    kind: Mapping[str, float] = field(default_factory=dict)
    stage: Mapping[tuple[str, int], float] = field(default_factory=dict)
    layer: Mapping[tuple[str, str], float] = field(default_factory=dict)
    rank: Mapping[tuple[str, int], float] = field(default_factory=dict)
    action: Mapping[str, float] = field(default_factory=dict)
    slot: Mapping[tuple[int, int], float] = field(default_factory=dict)
    comm: CommModel = field(default_factory=CommModel)
    cores: int | None = None
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
        object.__setattr__(self, "slot", _frozen(self.slot, "PlanCosts.slot"))
        if self.cores is not None and (
            isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1
        ):
            raise ValueError(f"PlanCosts.cores must be a positive int (or None: a core per rank), got {self.cores!r}")
        if not isinstance(self.comm, CommModel):
            raise TypeError(f"PlanCosts.comm must be a CommModel, got {type(self.comm).__name__}")

    def of(self, action: Action, rank: int, position: int | None = None) -> float:
        """How long ``action`` (at ``position`` of ``rank``'s list, if given) keeps ``rank`` busy, waiting excluded."""
        found = None if position is None else self.slot.get((rank, position))
        if found is None:
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
    def fit(cls, plan: Plan, steps: Iterable[Sequence[ActionTimes]],
            comm: CommModel | None = None, statistic: str = "median", cores: int | None = None) -> PlanCosts:
        """Costs in seconds from measured steps (per step, per rank, ``metrics["action_times"]``).

        A compute, issue or bookkeeping action costs the ``statistic`` (median or mean) of its
        durations, by (kind, stage) where it has a stage, else by (kind, layer), else by (kind,
        rank); a blocking action the shortest of its durations by (kind, rank): the time it takes
        when its data is already in. Every kind also gets the same over all its samples, for
        actions not seen. With ``cores`` (the run's ranks shared that many), a duration counts
        only the share of a core the action had: while ``k > cores`` ranks were busy, ``cores / k``.
        A compute's duration leaves out the collectives it issued inside its layers (a split's:
        the Plan lists them after it, each costed as a wait), and its rank counts as idle while
        in them.
        """
        samples: dict[tuple[str, Any], list[float]] = defaultdict(list)
        blocking: set[str] = set()
        for step in steps:
            check_action_times(plan, step, "PlanCosts.fit")
            own = _own_times(plan, step, cores)
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
                    took = end - start if role == WAIT else own[(r, pos)]
                    samples[key].append(took)
                    samples[("kind", a.kind)].append(took)
        if statistic not in ("median", "mean"):
            raise ValueError(f"PlanCosts.fit(statistic={statistic!r}): use 'median' or 'mean'")
        average = statistics.median if statistic == "median" else statistics.fmean
        if not samples:
            raise ValueError("PlanCosts.fit: no measured actions (run the step traced: step.with_trace())")
        tables: dict[str, dict[Any, float]] = {"kind": {}, "stage": {}, "layer": {}, "rank": {}}
        for (table, key), values in samples.items():
            kind = key if table == "kind" else key[0]
            tables[table][key] = min(values) if kind in blocking else average(values)
        return cls(**tables, comm=comm or CommModel(), cores=cores, unit_us=1e6)

    def of_step(self, plan: Plan, step: Sequence[ActionTimes]) -> PlanCosts:
        """These costs, with every compute, issue and bookkeeping action of one measured ``step``
        at what it cost there (its core time under ``cores``, as :meth:`fit` counts it).

        Simulating each measured step's own costs keeps what one set of averages loses: actions
        vary from step to step, a step's critical path runs through its slow ones, and the
        critical path of average costs is shorter than the average critical path. Waits keep
        these costs (a wait's own cost once its data is in) and transfers the comm model, so the
        simulation still decides when every rank waits; an action missing from ``step`` keeps
        these costs too.

        >>> import shardwise as sw
        >>> f = sw.plan.Action("forward", "x", 0, 0)
        >>> plan = sw.plan.Plan(sw.Mesh(dp=2), ((f,), (f,)))  # two ranks, one forward each
        >>> measured = [[[(0, 0.0, 1.0)], [(0, 0.0, 3.0)]], [[(0, 0.0, 3.0)], [(0, 0.0, 1.0)]]]
        >>> costs = sw.plan.PlanCosts.fit(plan, measured, statistic="mean")
        >>> sw.simulate(plan, costs).makespan  # every forward at the mean, 2
        2.0
        >>> [sw.simulate(plan, costs.of_step(plan, step)).makespan for step in measured]  # as measured
        [3.0, 3.0]
        """
        check_action_times(plan, step, "PlanCosts.of_step")
        return replace(self, slot=_own_times(plan, step, self.cores))


def _own_times(plan: Plan, step: Sequence[ActionTimes], cores: int | None) -> dict[tuple[int, int], float]:
    """Per (rank, position), what each compute, issue and bookkeeping action of a measured step
    cost its rank: its core time (:func:`_core_time`), less the time of the collectives it issued
    inside its layers (a split's) while it ran, which the Plan lists, and a simulation runs,
    after it."""
    work = _core_time(plan, step, cores)
    own: dict[tuple[int, int], float] = {}
    for r, times in enumerate(step):
        kinds_roles = roles(plan.actions[r])
        own.update({(r, pos): work(start, end) for pos, start, end in times if kinds_roles[pos] != WAIT})
        for outer, start, end in _nested(plan, r, times):
            own[(r, outer)] -= work(start, end)
    return own


def _nested(plan: Plan, r: int, times: ActionTimes) -> list[tuple[int, float, float]]:
    """The collectives rank ``r``'s computes issued inside their layers, measured within them:
    (the compute's position, the part of the collective's time inside the compute's)."""
    found, outer = [], None
    for pos, start, end in sorted(times):
        kind = plan.actions[r][pos].kind
        if kind == INSIDE:
            if outer is not None and min(end, outer[2]) > max(start, outer[1]):
                found.append((outer[0], max(start, outer[1]), min(end, outer[2])))
        else:
            outer = (pos, start, end) if kind in COMPUTE_KINDS else None
    return found


def _core_time(plan: Plan, step: Sequence[ActionTimes], cores: int | None) -> Callable[[float, float], float]:
    """``work(start, end)``: the core time a rank had from ``start`` to ``end`` (two of its action
    boundaries) when the busy (not waiting) ranks of ``step`` shared ``cores`` equally. A wait
    counts as idle throughout: its own cost once its data is in (small) cannot be told apart from
    its waiting in a measured step. So does a collective a compute issues inside its layers."""
    if cores is None:
        return lambda start, end: end - start
    change: dict[float, int] = defaultdict(int)
    for r, times in enumerate(step):
        kinds_roles = roles(plan.actions[r])
        for pos, start, end in times:
            change[start] += 0
            change[end] += 0
            if kinds_roles[pos] != WAIT:
                change[start] += 1
                change[end] -= 1
        for _, start, end in _nested(plan, r, times):  # idle inside its busy compute
            change[start] -= 1
            change[end] += 1
    had: dict[float, float] = {}
    busy, total, before = 0, 0.0, None
    for t in sorted(change):
        if before is not None:
            total += (t - before) * (1.0 if busy <= cores else cores / busy)
        had[t], busy, before = total, busy + change[t], t
    return lambda start, end: had[end] - had[start]


def measured_transfers(plan: Plan, steps: Iterable[Sequence[ActionTimes]], costs: PlanCosts) -> list[
        tuple[str, int, int, float]]:
    """``(op, bytes, ranks, seconds)`` of the transfers and collectives of measured steps that some
    rank was seen waiting for: the input :meth:`CommModel.fit` takes.

    A message takes from the end of its send to the end of the receive that waited for it, less
    the receive's own cost (``costs``). A collective takes from when it could begin to the
    earliest end of a wait for it that did wait, less that wait's cost; it could begin at the
    last member's issue (the start of a synchronous one), or later, when the group's previous
    collective came in (a group runs its collectives in order, as ``simulate`` does). Where that
    previous one is known only to have been in by some time after the last issue (its waits
    found it in), the start is unknown and the sample is left out. Only actions moving one
    tensor are counted, and one clock must serve every rank (``time.perf_counter`` on one
    machine does). Under CPU contention the figures include the time a woken rank waited for a
    core.
    """
    samples: list[tuple[str, int, int, float]] = []
    for step in steps:
        check_action_times(plan, step, "measured_transfers")
        when = [{pos: (start, end) for pos, start, end in times} for times in step]
        sent: dict[tuple[Any, ...], deque[float]] = defaultdict(deque)
        calls: dict[tuple[Any, ...], list[tuple[float, float | None, float | None, int]]] = defaultdict(list)
        ops: dict[tuple[Any, ...], str] = {}
        for r, actions in enumerate(plan.actions):
            for pos, a in enumerate(actions):
                if a.kind in SENDS and pos in when[r]:
                    sent[channel(r, peer_rank(plan.mesh, r, a), a)].append(when[r][pos][1])
            for key, issued, waited, a in _collectives_of(plan, r):
                if issued in when[r]:
                    done = in_by = None
                    if waited is not None and waited in when[r]:
                        start, end = when[r][waited]
                        own = costs.of(actions[waited], r)
                        done = end - own if end - own > start else None  # it did wait for the data
                        in_by = start if done is None else None  # it did not: in by its start
                    # A synchronous collective (issued where it is waited for) is there from its start.
                    arrived = when[r][issued][0] if issued == waited else when[r][issued][1]
                    calls[key].append((arrived, done, in_by, a.nbytes if len(a.wire) == 1 else -1))
                    ops[key] = a.op or "psum"
        for r, actions in enumerate(plan.actions):
            for pos, a in enumerate(actions):
                if a.kind not in RECVS or pos not in when[r]:
                    continue
                queue = sent.get(channel(r, peer_rank(plan.mesh, r, a), a))
                if not queue:
                    continue
                send_end, (start, end) = queue.popleft(), when[r][pos]
                took = end - costs.of(a, r) - send_end
                if start < send_end and took > 0 and len(a.wire) == 1:
                    samples.append(("send", a.nbytes, 2, took))
        for (axis, group, k), members in calls.items():
            dones = [d for _, d, _, _ in members if d is not None]
            if len(members) == len(group) and dones and min(b for *_, b in members) >= 0:
                began = _could_begin(max(i for i, *_ in members), calls.get((axis, group, k - 1), ()))
                if began is not None and min(dones) > began:
                    samples.append((ops[(axis, group, k)], max(b for *_, b in members), len(group),
                                    min(dones) - began))
    return samples


def _could_begin(last_issue: float, previous: Sequence[tuple[float, float | None, float | None, int]]) -> float | None:
    """When a collective issued last at ``last_issue`` could begin, behind the group's ``previous``
    one ((issue, came in, in by, bytes) per member); None where that is unknown."""
    came_in = [d for _, d, _, _ in previous if d is not None]
    if came_in:  # some member waited for it: it came in then
        return max(last_issue, min(came_in))
    in_by = [t for _, _, t, _ in previous if t is not None]
    if not in_by or min(in_by) <= last_issue:  # it was in before this one was issued (or never seen)
        return last_issue
    return None  # in somewhere between the last issue and min(in_by): the start is unknown


def _collectives_of(plan: Plan, r: int) -> Iterator[tuple[tuple[Any, ...], int, int | None, Action]]:
    """Per collective of rank ``r``: (its group's key, the issuing position, the waiting position)."""
    actions, kinds_roles = plan.actions[r], roles(plan.actions[r])
    seq: dict[str, int] = defaultdict(int)
    for pos, a in enumerate(actions):
        if a.op is None or a.axis is None or a.kind in SENDS or a.kind in RECVS:
            continue
        group = plan.mesh.group_ranks(a.axis, r)
        key = (a.axis, group, seq[a.axis])
        seq[a.axis] += 1
        if kinds_roles[pos] != ISSUE:  # a sync all-reduce waits in itself
            yield key, pos, pos, a
            continue
        wait = WAIT_METRICS if a.kind == REDUCE_METRICS else next(k for k, v in WAIT_OF.items() if v == a.kind)
        later = (j for j in range(pos + 1, len(actions))
                 if actions[j].kind == wait and (actions[j].layer, actions[j].axis) == (a.layer, a.axis))
        yield key, pos, next(later, None), a
