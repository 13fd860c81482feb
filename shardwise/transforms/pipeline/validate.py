"""``validate(schedule)``: refuse a schedule that cannot run, naming the rank, the action and the rule.

Rules, checked in this order (the first broken one is reported):

1. placement: one entry per stage, each a rank of the schedule;
2. indices: every action's stage and microbatch are in range;
3. placement: every action of a stage is on the rank ``placement`` says;
4. completeness: every (stage, microbatch) has exactly one F and either one B
   or one I and one W;
5. order on a rank: an action comes after every action of its own rank it
   needs (F before I/B and I before W on a stage; F(s, m) after F(s-1, m) and
   the backward of (s, m) after that of (s+1, m) when both stages share a rank);
6. no deadlock: executing every rank's list in order, where an action waits
   for the actions it needs from other ranks (sends never block), finishes.
"""

from __future__ import annotations

from collections import Counter

from .schedule import B, F, I, PipeOp, Schedule, ScheduleError, W

__all__ = ["ScheduleError", "validate"]


def _at(rank: int, index: int, op: PipeOp) -> str:
    return f"rank {rank}, action {index} ({op})"


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` if ``schedule`` breaks a rule (see the module docstring)."""
    _check_shape(schedule)
    _check_actions(schedule)
    _check_complete(schedule)
    _check_local_order(schedule)
    _check_deadlock(schedule)


def _check_shape(schedule: Schedule) -> None:
    if schedule.num_ranks < 1:
        raise ScheduleError("the schedule has no ranks")
    if schedule.microbatches < 1:
        raise ScheduleError(f"the schedule needs at least one microbatch, got microbatches={schedule.microbatches}")
    if schedule.num_stages < 1:
        raise ScheduleError("the schedule has no stages: placement is empty")
    for stage, rank in enumerate(schedule.placement):
        if not 0 <= rank < schedule.num_ranks:
            raise ScheduleError(
                f"placement[{stage}] = {rank}, but the schedule has ranks 0..{schedule.num_ranks - 1}"
            )


def _check_actions(schedule: Schedule) -> None:
    seen: dict[PipeOp, tuple[int, int]] = {}
    for rank, ops in enumerate(schedule.ranks):
        for index, op in enumerate(ops):
            where = _at(rank, index, op)
            if not 0 <= op.stage < schedule.num_stages:
                raise ScheduleError(
                    f"{where}: stage {op.stage} out of range: the schedule has stages 0..{schedule.num_stages - 1}"
                )
            if not 0 <= op.microbatch < schedule.microbatches:
                raise ScheduleError(
                    f"{where}: microbatch {op.microbatch} out of range: "
                    f"the schedule has microbatches 0..{schedule.microbatches - 1}"
                )
            owner = schedule.placement[op.stage]
            if owner != rank:
                raise ScheduleError(
                    f"{where}: stage {op.stage} is placed on rank {owner}, so its actions belong on rank {owner}"
                )
            if op in seen:
                first_rank, first_index = seen[op]
                raise ScheduleError(
                    f"{where}: a second {op.kind} of stage {op.stage}, microbatch {op.microbatch} "
                    f"(the first is rank {first_rank}, action {first_index}); each runs exactly once"
                )
            seen[op] = (rank, index)


def _check_complete(schedule: Schedule) -> None:
    kinds: dict[tuple[int, int], Counter[str]] = {}
    for op in schedule.ops():
        kinds.setdefault((op.stage, op.microbatch), Counter())[op.kind] += 1
    for stage in range(schedule.num_stages):
        rank = schedule.placement[stage]
        for mb in range(schedule.microbatches):
            have = kinds.get((stage, mb), Counter())
            where = f"rank {rank}, stage {stage}, microbatch {mb}"
            if not have[F]:
                raise ScheduleError(f"{where}: no forward; add {PipeOp(stage, mb, F)} to rank {rank}")
            if have[B] and (have[I] or have[W]):
                raise ScheduleError(
                    f"{where}: both a full backward (B) and a split one (I/W); keep either "
                    f"{PipeOp(stage, mb, B)} or {PipeOp(stage, mb, I)} + {PipeOp(stage, mb, W)}"
                )
            if not (have[B] or have[I] or have[W]):
                raise ScheduleError(
                    f"{where}: no backward; add {PipeOp(stage, mb, B)}, or {PipeOp(stage, mb, I)} "
                    f"and {PipeOp(stage, mb, W)}, to rank {rank}"
                )
            if have[I] != have[W]:
                lacking = PipeOp(stage, mb, W if have[I] else I)
                raise ScheduleError(f"{where}: a split backward needs both I and W; add {lacking} to rank {rank}")


def _rule(op: PipeOp, dep: PipeOp) -> str:
    if dep.stage == op.stage:
        return "on a stage, F comes before B or I" if dep.kind == F else "on a stage, I comes before W"
    if op.kind == F:
        return "F(s, m) needs F(s-1, m)"
    return "the backward of (s, m) needs that of (s+1, m)"


def _check_local_order(schedule: Schedule) -> None:
    for rank, ops in enumerate(schedule.ranks):
        position = {op: index for index, op in enumerate(ops)}
        for index, op in enumerate(ops):
            for dep in schedule.dependencies(op):
                later = position.get(dep)
                if later is not None and later > index:
                    raise ScheduleError(
                        f"{_at(rank, index, op)} comes before {dep} (action {later}), which it needs: {_rule(op, dep)}"
                    )


def _check_deadlock(schedule: Schedule) -> None:
    done: set[PipeOp] = set()
    pointer = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(schedule.ranks):
            while pointer[rank] < len(ops) and all(d in done for d in schedule.dependencies(ops[pointer[rank]])):
                done.add(ops[pointer[rank]])
                pointer[rank] += 1
                progress = True
    stuck = [r for r, ops in enumerate(schedule.ranks) if pointer[r] < len(ops)]
    if not stuck:
        return
    waits_on: dict[int, int] = {}
    lines = []
    for rank in stuck:
        op = schedule.ranks[rank][pointer[rank]]
        missing = next(d for d in schedule.dependencies(op) if d not in done)
        holder = schedule.placement[missing.stage]
        waits_on[rank] = holder
        blocking = schedule.ranks[holder][pointer[holder]]
        after = (
            f"which rank {holder} has reached but cannot run yet"
            if blocking == missing
            else f"which rank {holder} reaches only after {blocking}"
        )
        lines.append(f"  rank {rank} waits at {op} (action {pointer[rank]}) for {missing}, {after}")
    cycle = [stuck[0]]
    while cycle.count(cycle[-1]) < 2:
        cycle.append(waits_on[cycle[-1]])
    cycle = cycle[cycle.index(cycle[-1]) :]
    raise ScheduleError(
        "the schedule deadlocks (every rank runs its list in order; receives block, sends do not):\n"
        + "\n".join(lines)
        + "\n  cycle: "
        + " -> ".join(f"rank {r}" for r in cycle)
    )
