"""``simulate(plan, costs) -> PlanTimeline``: every rank's actions of a Plan on paper.

The model, and what it assumes:

* Each rank runs its actions in the Plan's order, one at a time. An action may
  first wait (for a message, a collective, its sends), then keeps its rank's CPU
  busy for :meth:`PlanCosts.of` (a compute its compute time; a send or an async
  collective the time to issue it; a wait its bookkeeping once the data is in).
* Ranks are independent processors, unless ``PlanCosts.cores`` says they share
  fewer cores than there are ranks: then the ranks that are busy at a moment
  share the cores equally (processor sharing; a waiting rank uses none).
  Messages do not slow each other down.
* A transfer or collective takes :meth:`CommModel.time` (``engine/simulate/costs.py``:
  a ring's latency and bandwidth terms per op), over the link its group crosses: a
  two-level model prices a group within one node by its own figures, one spanning
  nodes by its ``inter`` figures.
* A send is delivered its transfer time after it is issued (the executor posts
  each receive ``RECEIVES_AHEAD`` receives before its wait, taken as in time: no
  message waits for its receive); a receive ends no earlier than that, plus its own cost. A send of
  several tensors (a Hugging Face layer's output and its position embeddings)
  puts them on the wire to its one peer back to back: one latency, all their
  bytes. A collective of several tensors runs one collective per tensor. Sends and
  receives pair in order per (sender, receiver, axis, what travels: the
  activation or gradient of a stage and micro-batch, or a tied weight).
  ``wait_sends`` and ``sum_tied`` wait until every send so far is delivered.
* The k-th collective a rank issues over an axis meets the k-th of every rank of
  its group there. A group runs its collectives one at a time, in that order (a
  process group's collectives run in order on one stream on NCCL; on gloo, four
  reduce-scatters issued back to back were measured landing one after another).
  An async one (gather, reduce_scatter, gather_params, the first reduce_metrics)
  starts when the last member has issued it and the group's previous one is
  done, and completes its transfer time later; its wait blocks the rank until
  then. A sync one (the later reduce_metrics, a split layer's in-layer one) blocks
  until every member has arrived and the transfer is done.
* A ``wait_params`` listed before its ``gather_params`` (ZeRO-1/2 with ``overlap_gather``)
  waits for the gather the previous step issued at its end: the Plan is simulated in its
  steady state, those gathers on their group's link from time 0, one after another in the
  order the Plan issues them, so the first forward that needs a bucket waits for what is left
  of its transfer.
* Nothing waits forever: ranks that would are reported (:class:`PlanDeadlock`)
  with what each waits for; a send nobody receives, or a collective some member
  never issues, is a :class:`PlanMismatch`.

With one core per rank this is a plain dependency computation (every action ends
at ``max(start, when its data is in) + cost``), so integer costs give integer
times, and a pipelined step's Plan times its computes exactly as
``simulate(schedule)`` does under the same costs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..plan.actions import (
    GATHER_PARAMS,
    INSIDE,
    REDUCE_METRICS,
    SUM_TIED,
    WAIT_METRICS,
    WAIT_PARAMS,
    WAIT_SENDS,
    Action,
    Plan,
)
from .costs import PlanCosts
from .timeline import (
    ISSUE,
    RECVS,
    SENDS,
    WAIT_OF,
    PlanMismatch,
    PlanSlot,
    PlanTimeline,
    Transfer,
    channel,
    peer_rank,
    roles,
)


class PlanDeadlock(RuntimeError):
    """Some ranks of a Plan wait forever; ``blocked`` maps each such rank to (position, action, why)."""

    def __init__(self, blocked: Mapping[int, tuple[int, Action, str]]) -> None:
        self.blocked = dict(blocked)
        lines = [f"  rank {r}: action {i} {a}: {why}" for r, (i, a, why) in sorted(self.blocked.items())]
        super().__init__("the plan deadlocks; these ranks wait forever:\n" + "\n".join(lines))


@dataclass
class _Call:
    """One collective over one group: who has arrived when, and when it completes."""

    action: Action
    group: tuple[int, ...]
    arrived: dict[int, float] = field(default_factory=dict)
    issued_by: dict[int, int] = field(default_factory=dict)  # rank -> action position
    done: float | None = None


@dataclass
class _Rank:
    """Where one rank is: its action, when that began, and its CPU phase (``remaining`` work)."""

    pos: int = 0
    start: float = 0.0
    busy_since: float | None = None  # in its CPU phase since (None: still waiting)
    remaining: float = 0.0
    shared: bool = False  # the CPU phase ran slower than alone at some point
    received: float | None = None  # a receive's delivery time, once paired


class _Simulation:
    def __init__(self, plan: Plan, costs: PlanCosts) -> None:
        self.plan, self.costs, self.mesh = plan, costs, plan.mesh
        n = plan.mesh.size
        self.roles = [roles(actions) for actions in plan.actions]
        self.state = [_Rank() for _ in range(n)]
        self.rows: list[list[PlanSlot]] = [[] for _ in range(n)]
        self.transfers: list[list[Transfer]] = [[] for _ in range(n)]
        self.mail: dict[tuple[Any, ...], deque[float]] = defaultdict(deque)
        self.outbox: list[list[float]] = [[] for _ in range(n)]  # delivery times of undelivered sends
        self.calls: dict[tuple[Any, ...], _Call] = {}
        self.group_free: dict[tuple[Any, ...], float] = {}  # (axis, group) -> when its last collective is done
        self.seq: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]
        self.pending: list[dict[tuple[str, str | None, str | None], _Call]] = [{} for _ in range(n)]
        self.first_metrics: list[_Call | None] = [None] * n
        self.joined: list[_Call | None] = [None] * n  # the sync collective a rank has arrived at
        carried: dict[tuple[Any, ...], float] = {}  # (axis, group, k): when its k-th carried gather is done
        for r in range(n):
            self._carried_gathers(r, carried)

    def _carried_gathers(self, r: int, carried: dict[tuple[Any, ...], float]) -> None:
        """The previous step's gathers that rank ``r``'s Plan waits for before it issues its own (see
        the module docstring): in flight from time 0 on their group's link, in issue order; the
        k-th of a group is one collective, timed once for all its ranks (``carried``)."""
        actions = self.plan.actions[r]
        issued: set[tuple[str | None, str | None]] = set()
        waited: set[tuple[str | None, str | None]] = set()
        for a in actions:
            if a.kind == GATHER_PARAMS:
                issued.add((a.layer, a.axis))
            elif a.kind == WAIT_PARAMS and (a.layer, a.axis) not in issued:
                waited.add((a.layer, a.axis))
        k: dict[str, int] = defaultdict(int)
        for a in actions:
            if a.kind != GATHER_PARAMS or (a.layer, a.axis) not in waited:
                continue
            if a.axis is None:
                raise PlanMismatch(f"rank {r}: collective {a} names no mesh axis")
            group = self.mesh.group_ranks(a.axis, r)
            key = (a.axis, group, k[a.axis])
            k[a.axis] += 1
            if key not in carried:
                begin = self.group_free.get((a.axis, group), 0.0)
                carried[key] = self.group_free[(a.axis, group)] = (
                    begin + self._transfer_time(a, a.op or "all_gather", group))
            self.pending[r][(GATHER_PARAMS, a.layer, a.axis)] = _Call(a, group, done=carried[key])

    def _done(self, r: int) -> bool:
        return self.state[r].pos == len(self.plan.actions[r])

    def run(self) -> PlanTimeline:
        now = 0.0
        ranks = range(self.mesh.size)
        while True:
            self._settle(now)
            if all(self._done(r) for r in ranks):
                break
            busy = [r for r in ranks if not self._done(r) and self.state[r].busy_since is not None]
            cores = self.costs.cores
            rate = 1.0 if cores is None or len(busy) <= cores else cores / len(busy)
            ends = {r: self._busy_until(r, now, rate) for r in busy}
            wakes = [t for r in ranks if not self._done(r) and r not in ends
                     and (t := self._ready_time(r)) is not None and t > now]
            if not ends and not wakes:
                raise PlanDeadlock(
                    {
                        r: (self.state[r].pos, self.plan.actions[r][self.state[r].pos], self._why_blocked(r))
                        for r in ranks
                        if not self._done(r)
                    }
                )
            later = min([*ends.values(), *wakes])
            for r, end in ends.items():
                s = self.state[r]
                s.remaining = 0.0 if end == later else s.remaining - (later - now) * rate
                s.shared |= rate < 1.0
            now = later
        self._check_all_matched()
        return PlanTimeline(self.plan, tuple(map(tuple, self.rows)), tuple(map(tuple, self.transfers)),
                            unit_us=self.costs.unit_us, name="simulated")

    def _busy_until(self, r: int, now: float, rate: float) -> float:
        s = self.state[r]
        if rate == 1.0 and not s.shared:  # alone all along: exactly its start plus its cost
            assert s.busy_since is not None
            return s.busy_since + self.costs.of(self.plan.actions[r][s.pos], r, s.pos)
        return now + s.remaining / rate

    def _settle(self, now: float) -> None:
        """Everything that happens at ``now``: waits that end, CPU phases that begin or end."""
        changed = True
        while changed:
            changed = False
            for r in range(self.mesh.size):
                while not self._done(r):
                    s = self.state[r]
                    if s.busy_since is None:
                        ready = self._ready_time(r)
                        if ready is None or ready > now:
                            break
                        s.busy_since, s.shared = now, False
                        s.remaining = self.costs.of(self.plan.actions[r][s.pos], r, s.pos)
                    if s.remaining > 0:
                        break
                    self._finish(r, now)
                    changed = True

    def _transfer_time(self, a: Action, op: str, group: tuple[int, ...]) -> float:
        """``a``'s time over ``group`` (global ranks), priced by the link it crosses (a two-level
        CommModel: within a node, or across nodes)."""
        comm = self.costs.comm.level(group)
        if (comm.alpha or comm.beta) and op not in comm.alpha and op not in comm.beta:
            # A model with figures for some ops and not this one would price it free, silently.
            raise ValueError(
                f"simulate: the plan's {a} needs a communication time for op {op!r}, and the CommModel has "
                f"figures only for {sorted({*comm.alpha, *comm.beta})}; give it alpha (and beta) for {op!r} "
                f"(0.0 to make it free), e.g. fitted from runs that waited for it, or use CommModel() for free "
                "communication throughout"
            )
        if not a.wire and comm.beta.get(op):
            # Priced at its latency alone, the less the plan was told the faster its step would look.
            raise ValueError(
                f"simulate: the plan's {a} carries a payload the plan does not know ({self.plan.why_unknown(a)}), "
                f"and the CommModel prices op {op!r} by the byte; simulate with a CommModel without a per-byte "
                "cost for it"
            )
        sizes = [w.nbytes for w in a.wire] or [0]  # a payload-free model: its latency alone
        if op == "send":  # its tensors go to one peer back to back, one stream: the latency once
            return comm.time(op, sum(sizes), len(group))
        return sum(comm.time(op, nbytes, len(group)) for nbytes in sizes)

    def _ready_time(self, r: int) -> float | None:
        """When rank ``r``'s current action may start its CPU phase (None: not known yet)."""
        s = self.state[r]
        a = self.plan.actions[r][s.pos]
        if a.kind in RECVS:
            if s.received is None:
                queue = self.mail.get(channel(r, peer_rank(self.mesh, r, a), a))
                if not queue:
                    return None
                s.received = queue.popleft()
            return max(s.start, s.received)
        if a.kind in WAIT_OF or a.kind == WAIT_METRICS:
            done = self._issued_call(r, a).done
            return None if done is None else max(s.start, done)
        if a.kind == REDUCE_METRICS and self.roles[r][s.pos] != ISSUE:  # sync, once the first one is in
            if self.joined[r] is None:
                first = self.first_metrics[r]
                if first is not None and first.done is None:
                    return None
                self.joined[r] = self._arrive(
                    r, s.pos, a, s.start if first is None else max(s.start, first.done or 0.0)
                )
            joined = self.joined[r]
            assert joined is not None
            return joined.done
        if a.kind == INSIDE:  # a layer's collective (a split's): sync, the group meets
            if self.joined[r] is None:
                self.joined[r] = self._arrive(r, s.pos, a, s.start)
            return self.joined[r].done  # type: ignore[union-attr]
        if a.kind in (WAIT_SENDS, SUM_TIED):  # the executor waits for every send so far in both
            return max([s.start, *self.outbox[r]])
        return s.start

    def _finish(self, r: int, now: float) -> None:
        """Rank ``r``'s current action ends at ``now``: its effects, its slot, the next action."""
        s = self.state[r]
        i = s.pos
        a, role = self.plan.actions[r][i], self.roles[r][i]
        if a.kind in SENDS:
            delivered = now + self._transfer_time(a, "send", (r, peer_rank(self.mesh, r, a)))
            self.mail[channel(r, peer_rank(self.mesh, r, a), a)].append(delivered)
            self.outbox[r].append(delivered)
            self.transfers[r].append(Transfer(r, i, a, now, delivered))
        elif role == ISSUE:  # an async collective
            call = self._arrive(r, i, a, now)
            if a.kind == REDUCE_METRICS:
                self.first_metrics[r] = call
            else:
                self.pending[r][(a.kind, a.layer, a.axis)] = call
        elif a.kind in WAIT_OF:
            del self.pending[r][(WAIT_OF[a.kind], a.layer, a.axis)]
        elif a.kind in (WAIT_METRICS, REDUCE_METRICS):
            self.first_metrics[r] = self.joined[r] = None
        elif a.kind == INSIDE:
            self.joined[r] = None
        elif a.kind in (WAIT_SENDS, SUM_TIED):
            self.outbox[r].clear()
        self.rows[r].append(PlanSlot(r, i, a, s.start, now, role))
        self.state[r] = _Rank(pos=i + 1, start=now)

    def _issued_call(self, r: int, a: Action) -> _Call:
        call = (
            self.first_metrics[r] if a.kind == WAIT_METRICS else self.pending[r].get((WAIT_OF[a.kind], a.layer, a.axis))
        )
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
        if (call.action.kind, call.action.op, call.action.layer) != (a.kind, a.op, a.layer):
            first = next(iter(call.issued_by))
            raise PlanMismatch(
                f"collective {k} over axis {a.axis!r} of ranks {list(group)}: rank {first} issues "
                f"{call.action} but rank {r} issues {a} (action {i}); every rank of a group must issue the same "
                "collectives in the same order"
            )
        call.arrived[r], call.issued_by[r] = when, i
        if len(call.arrived) == len(group):
            begin = max([*call.arrived.values(), self.group_free.get((a.axis, group), 0.0)])
            issued = {m: self.plan.actions[m][call.issued_by[m]] for m in group}
            largest = max(issued.values(), key=lambda action: action.nbytes)
            call.done = begin + self._transfer_time(largest, a.op or "psum", group)
            self.group_free[(a.axis, group)] = call.done
            for m in group:
                self.transfers[m].append(Transfer(m, call.issued_by[m], issued[m], begin, call.done))
        return call

    def _why_blocked(self, r: int) -> str:
        s = self.state[r]
        a = self.plan.actions[r][s.pos]
        if a.kind in RECVS:
            src = peer_rank(self.mesh, r, a)
            return f"no matching send from rank {src} is ever issued ({self._where(src)})"
        call = (self.joined[r] or self.first_metrics[r]) if a.kind == REDUCE_METRICS else self._issued_call(r, a)
        assert call is not None
        missing = [m for m in call.group if m not in call.arrived]
        return (f"{call.action} over axis {call.action.axis!r} needs ranks {missing} too, which never issue it ("
                + "; ".join(self._where(m) for m in missing) + ")")

    def _where(self, r: int) -> str:
        if self._done(r):
            return f"rank {r} has finished"
        pos = self.state[r].pos
        return f"rank {r} is stuck at action {pos} {self.plan.actions[r][pos]}"

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
    >>> simulate(plan, PlanCosts(cores=1)).makespan  # both ranks on one core: every compute in turn
    12.0
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"simulate(plan) needs a shardwise Plan (step.plan(mesh, params, batch)), got {type(plan).__name__}"
        )
    if costs is None:
        costs = PlanCosts()
    elif not isinstance(costs, PlanCosts):
        raise TypeError(f"simulate(plan, costs): costs must be a PlanCosts, got {type(costs).__name__}")
    _check_costs_match(plan, costs)
    return _Simulation(plan, costs).run()


def _check_costs_match(plan: Plan, costs: PlanCosts) -> None:
    """Refuse a cost keyed by what the plan does not have (a layer name with a typo, a rank or stage
    beyond the mesh's, an action or slot that is not there): it would price nothing, and the step would
    be simulated at the default costs, silently. A table may price kinds the plan does not run (a
    pipeline's costs for I and W under 1F1B), as ``kind`` does: only the layer, stage or rank is asked."""
    if not (costs.slot or costs.action or costs.stage or costs.layer or costs.rank):
        return
    have: dict[str, set[Any]] = {"slot": set(), "action": set(), "stage": set(), "layer": set(), "rank": set()}
    for r, actions in enumerate(plan.actions):
        have["rank"].add(r)
        for pos, a in enumerate(actions):
            have["slot"].add((r, pos))
            have["action"].add(str(a))
            if a.stage is not None:
                have["stage"].add(a.stage)
            if a.layer is not None:
                have["layer"].add(a.layer)
    for name, found in have.items():
        keyed = getattr(costs, name)
        missing = [key for key in keyed if (key if name in ("slot", "action") else key[1]) not in found]
        if missing:
            shown = sorted(map(str, found))
            raise ValueError(
                f"simulate: PlanCosts.{name} key {missing[0]!r} names no {name} of the plan, so it would price "
                f"nothing and the step would take the default costs, silently; the plan's {name}s are "
                f"{shown[:10]}{' ...' if len(shown) > 10 else ''}"
            )
