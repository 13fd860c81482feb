"""shard_params' lowering pass: when each unit is gathered, freed and its gradient reduced.

A *unit* is a chain layer's parameters held by this rank, gathered and reduced
as one flat buffer. A compute *needs* the units of its stage's layers and the
units holding the weights they tie to (a GPT head needs the embedding's unit).

Before a compute, the gathers of its units and of the units the next
``prefetch`` computes need are issued (async), so the next units travel while
the current one computes; a unit is freed after a compute unless the next
compute needs or prefetches it. Without a pipeline, forward and backward of
each micro-batch are two passes: with ``reshard`` every unit is freed at the
end of the forward and gathered again in backward (the ZeRO paper's 3Ψ per
step), except the units the backward starts with (the last forward's): those
are kept across the loss rather than freed and gathered again at once (FSDP2
keeps its root's parameters the same way). Without ``reshard``, units stay
from their forward until their last backward use (2Ψ). Under a pipeline the rank's whole compute sequence is one
pass (``engine/stack/compose.py`` says when it reshards). A unit's gradient is
complete after the last compute that adds to it, so its reduce-scatter is
issued right there (stages 2 and 3); the engine issues the deferred ones
(stage 1, and units holding a weight tied across pipeline ranks, whose copies
are summed first) at the end of the step, after the frees that follow that compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...engine.plan.actions import (
    COMPUTES,
    FORWARD,
    FREE,
    GATHER,
    GRAD_COMPUTES,
    LOSS,
    REDUCE_SCATTER,
    WAIT_GATHER,
    Action,
)


def _upcoming(needs: Sequence[tuple[str, ...]], i: int, count: int) -> list[str]:
    """The first ``count`` distinct units that computes after ``i`` need, in order of need."""
    found: list[str] = []
    for later in needs[i + 1 :]:
        for unit in later:
            if len(found) == count:
                return found
            if unit not in found:
                found.append(unit)
    return found


def gathered_pass(
    actions: Sequence[Action],
    stage_needs: Mapping[int, tuple[str, ...]],
    live: set[str],
    prefetch: int,
    free: str,
    axis: str,
    prefetch_after: bool = False,
    keep_at_end: frozenset[str] | set[str] = frozenset(),
) -> list[Action]:
    """``actions`` with the gathers, waits and frees their computes need, updating ``live`` in place.

    Actions that compute nothing (loss, transfers) stay where they are. ``free`` says when a
    live unit is dropped: "never"; "window" as soon as the next compute neither needs nor
    prefetches it (it may be gathered again later); "after_forward" as "window", and a
    forward not followed by another forward also frees the units it used (FSDP's reshard
    after forward, per micro-batch: least memory, most traffic); "last_use" after the last compute
    that needs it. With ``prefetch_after`` a compute's
    prefetches are issued after it and its frees (so after the reduce-scatters that follow it), not
    before it: they overlap those reductions instead of the compute. ``keep_at_end``: units the
    last compute does not free (what comes after the pass starts with them).
    """
    computes = [i for i, a in enumerate(actions) if a.kind in COMPUTES]
    needs = [stage_needs[actions[i].stage or 0] for i in computes]
    out: list[Action] = []
    in_flight: list[str] = []
    position = {at: n for n, at in enumerate(computes)}
    for at, action in enumerate(actions):
        i = position.get(at)
        if i is None:
            out.append(action)
            continue
        upcoming = _upcoming(needs, i, prefetch)
        for unit in (*needs[i], *([] if prefetch_after else upcoming)):
            if unit not in live and unit not in in_flight:
                out.append(Action(GATHER, unit, axis=axis))
                in_flight.append(unit)
        for unit in needs[i]:
            if unit in in_flight:
                out.append(Action(WAIT_GATHER, unit, axis=axis))
                in_flight.remove(unit)
                live.add(unit)
        out.append(action)
        if free != "never":
            # Keep what the next compute will want gathered (its units and its prefetch):
            # freeing it here would only gather it again at once.
            nxt = needs[i + 1] if i + 1 < len(needs) else tuple(keep_at_end)
            keep = {*nxt, *_upcoming(needs, i + 1, prefetch)}
            next_is_forward = i + 1 < len(computes) and actions[computes[i + 1]].kind == FORWARD
            if free == "after_forward" and action.kind == FORWARD and not next_is_forward:
                keep -= set(needs[i])  # reshard what this forward used; the rest as in "window"
            if free == "last_use":
                keep |= {u for later in needs[i + 1 :] for u in later}
            for unit in sorted(live - keep - set(in_flight)):
                out.append(Action(FREE, unit, axis=axis))
                live.discard(unit)
        if prefetch_after:
            for unit in upcoming:
                if unit not in live and unit not in in_flight:
                    out.append(Action(GATHER, unit, axis=axis))
                    in_flight.append(unit)
    assert not in_flight, f"gathers issued but never used: {in_flight}"
    return out


def _passes(actions: Sequence[Action]) -> list[list[Action]]:
    """Cut a plain compute sequence into its passes: each micro-batch's forwards, its loss, its backwards."""
    out: list[list[Action]] = []
    for action in actions:
        kind = _kind_of(action)
        if out and _kind_of(out[-1][0]) == kind and kind != "loss":
            out[-1].append(action)
        else:
            out.append([action])
    return out


def _first_backward_needs(after: Sequence[list[Action]], stage_needs: Mapping[int, tuple[str, ...]]) -> set[str]:
    """The units of the first backward compute when ``after`` opens with a loss and then that
    backward (a forward pass's micro-batch goes on to its own backward); else none."""
    if len(after) < 2 or after[0][0].kind != LOSS or _kind_of(after[1][0]) != "backward":
        return set()
    first = next((a for a in after[1] if a.kind in COMPUTES), None)
    return set(stage_needs[first.stage or 0]) if first is not None else set()


def _kind_of(action: Action) -> str:
    return "forward" if action.kind == FORWARD else "loss" if action.kind == LOSS else "backward"


def insert_gathers(
    actions: Sequence[Action],
    stage_needs: Mapping[int, tuple[str, ...]],
    *,
    stage: int,
    reshard: bool,
    prefetch: int,
    pipelined: bool,
    axis: str,
    prefetch_backward_after: bool = False,
    holds_shards: bool = False,
) -> list[Action]:
    """The gathers and frees around the computes of a state that holds shards (``holds_shards``:
    ZeRO-3, and ZeRO-1/2 under a narrowing precision policy; otherwise stages 1 and 2 hold whole
    parameters and gather none); with ``prefetch_backward_after`` a backward pass's prefetches are
    issued after each compute and its frees, not before it (see
    ``ShardSpec.prefetches_backward_after``).

    At stages 1-2 every unit is gathered (in the compute dtype) before its first forward of the step
    and kept to its last backward: the compute copies ZeRO-1/2 holds through the step anyway, built
    from the shards instead of cast from whole float32 parameters, so each unit travels once a step,
    however many micro-batches it has."""
    if not holds_shards and stage != 3:
        return list(actions)
    live: set[str] = set()
    if stage != 3:
        out = gathered_pass(actions, stage_needs, live, prefetch, "last_use", axis)
    elif pipelined:
        out = gathered_pass(actions, stage_needs, live, prefetch, "after_forward" if reshard else "last_use", axis)
    else:
        out = []
        passes = _passes(actions)
        for n, part in enumerate(passes):
            # What the backward after this micro-batch's loss starts with (the last forward's units):
            # kept across the loss, where freeing it would only gather it again at once (FSDP2
            # keeps its root's parameters across the loss for the same reason).
            loss_at = n if part[0].kind == LOSS else n + 1
            starts_backward = _first_backward_needs(passes[loss_at:], stage_needs) if reshard else set()
            if part[0].kind == LOSS:
                if reshard:  # every other unit is freed at the end of the forward
                    out += [Action(FREE, u, axis=axis) for u in sorted(live - starts_backward)]
                    live &= starts_backward
                out += part
                continue
            forward = part[0].kind == FORWARD
            mode = "window" if reshard else ("never" if forward else "last_use")
            out += gathered_pass(part, stage_needs, live, prefetch, mode, axis,
                                 prefetch_after=not forward and prefetch_backward_after,
                                 keep_at_end=starts_backward if forward else frozenset())
            if not forward:
                out += [Action(FREE, u, axis=axis) for u in sorted(live)]
                live.clear()
    out += [Action(FREE, u, axis=axis) for u in sorted(live)]
    return out


def insert_reduces(
    actions: Sequence[Action], stage_needs: Mapping[int, tuple[str, ...]], deferred: set[str], axis: str,
    *, each_microbatch: bool = False,
) -> list[Action]:
    """Each unit's reduce-scatter right after the last compute that adds to its gradient; with
    ``each_microbatch``, also after each earlier micro-batch's last one: a micro-batch's share, which names its
    micro-batch (``reduce_scatter(2, mb=0)``), is summed into the shard the last one completes."""
    last: dict[str, int] = {}
    earlier: dict[int, list[str]] = {}
    for i, action in enumerate(actions):
        if action.kind in GRAD_COMPUTES:
            for unit in stage_needs[action.stage or 0]:
                # A share is a whole micro-batch's: a unit two computes of one micro-batch add to (a weight
                # tied across stages: the head's backward, then the embedding's) is reduced after the last.
                if each_microbatch and unit in last and unit not in deferred and actions[last[unit]].mb != action.mb:
                    earlier.setdefault(last[unit], []).append(unit)
                last[unit] = i
    after: dict[int, list[Action]] = {}
    for unit, i in last.items():
        if unit not in deferred:
            after.setdefault(i, []).append(Action(REDUCE_SCATTER, unit, axis=axis))
    for i, units in earlier.items():
        mb = actions[i].mb
        after.setdefault(i, []).extend(Action(REDUCE_SCATTER, u, microbatch=mb, axis=axis) for u in units)
    # Each goes after the frees that follow its compute: the unit's gathered parameters are
    # released before its gradient is flattened for the reduce-scatter (one full unit less at
    # the backward's peak).
    order = {unit: k for k, unit in enumerate(last)}
    out: list[Action] = []
    waiting: list[Action] = []
    for i, action in enumerate(actions):
        if waiting and action.kind != FREE:
            out += waiting
            waiting = []
        out.append(action)
        waiting += sorted(after.get(i, []), key=lambda a: order[a.require("layer")])
    return out + waiting
