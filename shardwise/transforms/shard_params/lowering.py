"""From a sharded step to per-rank actions: when each unit is gathered, freed and reduced.

A *unit* is a chain layer that owns parameters; it is gathered and reduced as
one flat buffer. A layer *needs* its own unit and the units that own the
weights it ties to (a GPT head needs the embedding's unit).

Forward and backward are each a sequence of compute actions. Before a compute
the gathers of its units and of the next ``prefetch`` units are issued
(async), so the next units travel while the current one computes; a unit is
freed after a compute unless the next compute needs or prefetches it. With
``reshard_after_forward`` every unit is freed at the end of the forward (and
gathered again in backward, as the ZeRO paper counts: 3Ψ per step); without
it, units stay from their forward until their last backward use (2Ψ).
A unit's gradient is complete after the backward of its owner (ties point to
earlier layers), so its reduce-scatter is issued right there (stage 2 and 3),
or after the whole backward (stage 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...engine.chain import Chain
from ...engine.plan import BACKWARD, FORWARD, LOSS, UPDATE, Action

GATHER = "gather"  # issue an async all-gather of a unit's shards
WAIT_GATHER = "wait_gather"  # wait for it; the unit's parameters are now usable
FREE = "free"  # drop a gathered unit
REDUCE_SCATTER = "reduce_scatter"  # issue an async reduce-scatter of a unit's gradient
WAIT_REDUCE = "wait_reduce"  # wait for it; this rank holds its gradient shard
REDUCE_METRICS = "reduce_metrics"  # one all-reduce of what the step exchanges (engine.metrics)
GATHER_PARAMS = "gather_params"  # stage 1/2: all-gather a unit's updated shard into full params
WAIT_PARAMS = "wait_params"


@dataclass(frozen=True)
class ShardingOptions:
    """The options of shard_params that decide the action order."""

    stage: int
    reshard_after_forward: bool
    prefetch: int
    accumulation: int


def layer_needs(chain: Chain, units: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """For every layer: the units that must be gathered for it to run."""
    unit_set = set(units)
    needs: dict[str, tuple[str, ...]] = {}
    for layer in chain.layers:
        wanted = [layer.name] if layer.name in unit_set else []
        for owner, _ in layer.ties.values():
            if owner in unit_set and owner not in wanted:
                wanted.append(owner)
        needs[layer.name] = tuple(wanted)
    return needs


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


def _gathered_pass(
    computes: Sequence[Action],
    needs: Sequence[tuple[str, ...]],
    live: set[str],
    prefetch: int,
    free: str,
) -> list[Action]:
    """Computes with the gathers, waits and frees they need, updating ``live`` in place.

    ``free`` says when a live unit is dropped: "never"; "window" as soon as the
    next compute neither needs nor prefetches it (least memory; it may be
    gathered again later); "last_use" after the last compute that needs it.
    """
    out: list[Action] = []
    in_flight: list[str] = []
    for i, compute in enumerate(computes):
        for unit in (*needs[i], *_upcoming(needs, i, prefetch)):
            if unit not in live and unit not in in_flight:
                out.append(Action(GATHER, unit))
                in_flight.append(unit)
        for unit in needs[i]:
            if unit in in_flight:
                out.append(Action(WAIT_GATHER, unit))
                in_flight.remove(unit)
                live.add(unit)
        out.append(compute)
        if free != "never":
            # Keep what the next compute will want gathered (its units and its prefetch):
            # freeing it here would only gather it again at once.
            nxt = needs[i + 1] if i + 1 < len(computes) else ()
            keep = {*nxt, *_upcoming(needs, i + 1, prefetch)}
            if free == "last_use":
                keep |= {u for later in needs[i + 1 :] for u in later}
            for unit in sorted(live - keep - set(in_flight)):
                out.append(Action(FREE, unit))
                live.discard(unit)
    assert not in_flight, f"gathers issued but never used: {in_flight}"
    return out


def lower_rank(chain: Chain, units: Sequence[str], options: ShardingOptions) -> tuple[Action, ...]:
    """The actions of one rank (every rank of the data-parallel axis runs the same list)."""
    needs = layer_needs(chain, units)
    names = list(chain.names)
    actions: list[Action] = []
    for mb in range(options.accumulation):
        last = mb == options.accumulation - 1
        forward = [Action(FORWARD, n, microbatch=mb) for n in names]
        backward = [Action(BACKWARD, n, microbatch=mb) for n in reversed(names)]
        if options.stage == 3:
            live: set[str] = set()
            reshard = options.reshard_after_forward
            actions += _gathered_pass(
                forward, [needs[n] for n in names], live, options.prefetch, "window" if reshard else "never"
            )
            if reshard:
                actions += [Action(FREE, u) for u in sorted(live)]
                live.clear()
            actions.append(Action(LOSS, microbatch=mb))
            actions += _gathered_pass(
                backward, [needs[n] for n in reversed(names)], live, options.prefetch,
                "window" if reshard else "last_use",
            )
            actions += [Action(FREE, u) for u in sorted(live)]
        else:
            actions += [*forward, Action(LOSS, microbatch=mb), *backward]
        if last:
            actions = _insert_reduces(actions, units, options.stage, mb)
    # Wait in the order the reduce-scatters were issued: the first one is likeliest done.
    actions += [Action(WAIT_REDUCE, a.layer) for a in actions if a.kind == REDUCE_SCATTER]
    actions.append(Action(REDUCE_METRICS))
    actions.append(Action(UPDATE))
    if options.stage in (1, 2):
        actions += [Action(GATHER_PARAMS, u) for u in units] + [Action(WAIT_PARAMS, u) for u in units]
    return tuple(actions)


def _insert_reduces(actions: list[Action], units: Sequence[str], stage: int, mb: int) -> list[Action]:
    """Stage 1 reduces after the whole backward; 2 and 3 right after each unit's own backward."""
    if stage == 1:
        return actions + [Action(REDUCE_SCATTER, u) for u in units]
    out: list[Action] = []
    for action in actions:
        out.append(action)
        if action.kind == BACKWARD and action.microbatch == mb and action.layer in units:
            out.append(Action(REDUCE_SCATTER, action.layer))
    return out


def peak_gathered_units(actions: Sequence[Action], unit_bytes: Mapping[str, int]) -> int:
    """Largest total bytes of gathered (and in-flight) units at any point of ``actions``."""
    held: set[str] = set()
    peak = 0
    for action in actions:
        if action.kind == GATHER and action.layer is not None:
            held.add(action.layer)
        elif action.kind == FREE and action.layer is not None:
            held.discard(action.layer)
        peak = max(peak, sum(unit_bytes[u] for u in held))
    return peak
