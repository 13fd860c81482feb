"""From a schedule to one pipeline rank's actions: its computes, and the transfers placement implies.

A schedule says which stage computes which micro-batch when. Where two
neighbouring stages sit on different ranks, the activation of F(s, m) travels
from stage s to s+1 and the gradient of B/I(s+1, m) back to stage s: each
compute gets a receive before it and a send after it, naming the peer's index
along the pipeline axis. Stages on the same rank hand values over in memory.
The last stage's forward is followed by the micro-batch's loss. Stages before
``placement.backward_from`` (no trainable parameter up to them: a frozen
embedding in front) get no gradient, so their backward ops are dropped and no
gradient is sent down to them.
"""

from __future__ import annotations

from ...engine.layout.state_layout import Placement
from ...engine.plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    LOSS,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    Action,
)
from .schedule import PipeOp, Schedule

COMPUTE = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


def compute_action(op: PipeOp, placement: Placement) -> Action:
    return Action(COMPUTE[op.kind], placement.stages[op.stage][0], op.microbatch, op.stage, label=f"stage{op.stage}")


def rank_computes(schedule: Schedule, placement: Placement, axis: str, rank: int) -> list[Action]:
    """Pipeline rank ``rank``'s schedule ops with the receives and sends around them."""
    last = schedule.num_stages - 1
    place = schedule.placement
    out: list[Action] = []

    def transfer(kind: str, s: int, m: int, peer: int) -> Action:
        return Action(kind, placement.stages[s][0], m, s, axis=axis, peer=peer, label=f"stage{s}")

    first = placement.backward_from
    for op in schedule.ranks[rank]:
        s, m = op.stage, op.microbatch
        if op.kind != "F" and s < first:
            continue  # nothing flows back to it: it trains nothing and its input needs no gradient
        if op.kind == "F":
            if s > 0 and place[s - 1] != rank:
                out.append(transfer(RECV_ACTIVATION, s, m, place[s - 1]))
            out.append(compute_action(op, placement))
            if s == last:
                out.append(Action(LOSS, None, m))
            elif place[s + 1] != rank:
                out.append(transfer(SEND_ACTIVATION, s, m, place[s + 1]))
        elif op.kind in ("B", "I"):
            if s < last and place[s + 1] != rank:
                out.append(transfer(RECV_GRAD, s, m, place[s + 1]))
            out.append(compute_action(op, placement))
            if s > first and place[s - 1] != rank:
                out.append(transfer(SEND_GRAD, s, m, place[s - 1]))
        else:
            out.append(compute_action(op, placement))
    return out
