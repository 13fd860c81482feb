"""Which of a pipeline rank's gradient sends a receive proves delivered, from the schedule alone.

A rank sends a stage's input gradient to the rank of the stage before, which receives it just before
that stage's backward (its input pass, when split). No message answers it, and waiting for the send
before the step's end could wait for a receive the peer posts only after one from this rank (each
receive is posted a few before its wait: ``transfers.RECEIVES_AHEAD``). But every later message from
that peer was sent after its receive completed, where the peer's order has it so: from its schedule,
each receive of this rank from a peer names the gradient sends to that peer it proves delivered, and
those are let go of there (held to ``wait_sends``, every micro-batch's stayed resident through the
step: 16 x 0.5 MiB on a middle rank of tests/engine/test_plan_peak_memory.py's 1F1B of 16).
"""

from __future__ import annotations

from typing import Any

Key = tuple[str, int, int]  # ("activation" | "grad", this rank's stage, micro-batch): a receive, or a send


def grad_sends_delivered(schedule: Any, index: int, backward_from: int = 0) -> dict[Key, tuple[Key, ...]]:
    """Per receive of pipeline rank ``index`` (keyed by what it receives, for which of its stages, and the
    micro-batch), the gradient sends of that rank (``("grad", stage, micro-batch)``) whose delivery it proves
    and that no earlier receive proved. ``schedule``: a ``transforms.pipeline.Schedule`` (``ranks``, per rank
    its ops in order, each with ``stage``, ``microbatch`` and ``kind`` in F/B/I/W; ``placement``, each stage's
    rank). ``backward_from``: the first stage that runs a backward (``Placement.backward_from``): the stages
    before it receive no gradient and their successors send none, whatever the schedule's ops say (a proof
    pinned to such a receive would never come: its sends were held to ``wait_sends``)."""
    placement = schedule.placement
    position = [
        {(op.stage, op.microbatch, op.kind): i for i, op in enumerate(ops)} for ops in schedule.ranks
    ]

    def consumed_at(peer: int, stage: int, mb: int) -> int | None:
        """Where ``peer`` waits for the gradient of ``stage``'s output: before its input pass, or its backward."""
        at = position[peer]
        return at.get((stage, mb, "I"), at.get((stage, mb, "B")))

    sends: dict[int, list[tuple[int, Key]]] = {}  # peer -> (where the peer takes it, the send)
    for op in schedule.ranks[index]:
        if op.kind in ("B", "I") and op.stage - 1 >= backward_from and placement[op.stage - 1] != index:
            peer = placement[op.stage - 1]
            taken = consumed_at(peer, op.stage - 1, op.microbatch)
            if taken is not None:
                sends.setdefault(peer, []).append((taken, ("grad", op.stage, op.microbatch)))
    proven: set[Key] = set()
    out: dict[Key, tuple[Key, ...]] = {}
    for op in schedule.ranks[index]:  # this rank's receives, in its order
        s, m = op.stage, op.microbatch
        if op.kind == "F" and s > 0 and placement[s - 1] != index:
            peer, sent_at, key = placement[s - 1], position[placement[s - 1]].get((s - 1, m, "F")), ("activation", s, m)
        elif op.kind in ("B", "I") and backward_from <= s and s + 1 < len(placement) and placement[s + 1] != index:
            peer, key = placement[s + 1], ("grad", s, m)
            sent_at = consumed_at(peer, s + 1, m)
        else:
            continue
        if key in out or sent_at is None:
            continue  # (a split backward receives at its input pass only)
        found = tuple(send for taken, send in sends.get(peer, ()) if taken < sent_at and send not in proven)
        proven.update(found)
        if found:
            out[key] = found
    return out
