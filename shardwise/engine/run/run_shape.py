"""What one rank's actions join, read once per actions list: runs of whole backwards of one micro-batch
on consecutive stages that run as one autograd call, and the forwards of those stages that then run as
one loop (the executor's fast path; a traced step runs every compute alone, :data:`ALONE`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..plan.actions import BACKWARD, FORWARD, Action


def joined_backwards(actions: Sequence[Action]) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]]]:
    """Runs of adjacent whole backwards of one micro-batch on consecutive stages (``B(s) B(s-1) ...``,
    nothing between them), which then run as one autograd call: (stage at the top, micro-batch) ->
    the run's lowest stage, and the (stage, micro-batch) backwards that call covers (all but the top).

    Their forwards leave each input above the lowest on the previous stage's graph instead of cutting
    it, so the one call goes through them as ``loss.backward()`` would; nothing between the backwards
    (a ZeRO reduce-scatter, a free, a send) needed them apart. Without a pipeline every layer is its
    own stage, so a ZeRO-1 backward is one call instead of one per layer, a ZeRO-2 one one per bucket.
    """
    tops: dict[tuple[int, int], int] = {}
    covered: set[tuple[int, int]] = set()
    top: tuple[int, int] | None = None
    previous: Action | None = None
    for action in actions:
        if (
            action.kind == BACKWARD and previous is not None and previous.kind == BACKWARD
            and top is not None and previous.microbatch == action.microbatch
            and previous.stage is not None and action.stage == previous.stage - 1
        ):
            s, m = action.require("stage"), action.mb
            tops[top] = s
            covered.add((s, m))
        elif action.kind == BACKWARD:
            top = (action.require("stage"), action.mb)
        else:
            top = None
        previous = action
    return tops, covered


def joined_forwards(actions: Sequence[Action], joined: set[tuple[int, int]]) -> dict[int, int]:
    """Runs of adjacent forwards of one micro-batch on consecutive stages whose inputs stay on the
    graph (``joined``: their backwards run as one call), which then run as one loop: the position of
    a run's first forward -> the position after its last. Nothing between them in the Plan needed
    them apart, and each keeps its own seed."""
    runs: dict[int, int] = {}
    i, n = 0, len(actions)
    while i < n:
        j = i + 1
        if actions[i].kind == FORWARD:
            while (
                j < n and actions[j].kind == FORWARD and actions[j].microbatch == actions[i].microbatch
                and actions[j].stage == actions[j - 1].require("stage") + 1
                and (actions[j].stage, actions[j].mb) in joined
            ):
                j += 1
            if j - i > 1:
                runs[i] = j
        i = j
    return runs


@dataclass(frozen=True)
class RunShape:
    """What one rank's actions join (:func:`joined_backwards`, :func:`joined_forwards`), read once per
    actions list: the same list (a layout's cached Plan actions) runs every step."""

    tops: Mapping[tuple[int, int], int]  # (top stage, micro-batch) -> the lowest stage its call covers
    covered: frozenset[tuple[int, int]]  # the backwards a call above runs
    joined: frozenset[tuple[int, int]]  # (stage, micro-batch) whose input stays on the graph
    forward_runs: Mapping[int, int]  # position of a run's first forward -> position after its last
    skipped: frozenset[int]  # positions of the covered backwards, which run nothing


ALONE = RunShape({}, frozenset(), frozenset(), {}, frozenset())  # a traced step: every compute alone


_SHAPES: dict[int, tuple[Sequence[Action], RunShape]] = {}


_SHAPES_KEPT = 64  # the lists of as many layouts and ranks; beyond that the cache starts again


def run_shape(actions: Sequence[Action]) -> RunShape:
    """The :class:`RunShape` of ``actions``, made once per list."""
    known = _SHAPES.get(id(actions))
    if known is not None and known[0] is actions:
        return known[1]
    tops, covered = joined_backwards(actions)
    joined = frozenset((s + 1, m) for s, m in covered)
    skipped = frozenset(
        i for i, a in enumerate(actions) if a.kind == BACKWARD and (a.stage, a.mb) in covered
    )
    shape = RunShape(tops, frozenset(covered), joined, joined_forwards(actions, set(joined)), skipped)
    if len(_SHAPES) >= _SHAPES_KEPT:
        _SHAPES.clear()
    _SHAPES[id(actions)] = (actions, shape)
    return shape
