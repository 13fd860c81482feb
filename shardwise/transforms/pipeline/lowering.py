"""From a schedule to per-rank actions: the sends and receives the placement implies.

A schedule says which stage computes which micro-batch when. Where two
neighbouring stages sit on different ranks, the activation of F(s, m) travels
from stage s to s+1 and the gradient of B/I(s+1, m) back to stage s: each
compute gets a receive before it and a send after it. Stages on the same rank
hand values over in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.plan import Action
from .schedule import PipeOp, Schedule

RECV_ACTIVATION = "recv_activation"
SEND_ACTIVATION = "send_activation"
RECV_GRAD = "recv_grad"
SEND_GRAD = "send_grad"
COMPUTE = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
FINISH_GRADS = "finish_grads"  # wait for sends; sum tied copies; reduce over data parallel; local metrics
REDUCE_METRICS = "reduce_metrics"  # starts one all-reduce of what the step exchanges (engine.metrics)
UPDATE = "update"


@dataclass(frozen=True)
class Transfer:
    """One point-to-point hand-over: what, between which stages, for which micro-batch."""

    kind: str  # "activation" or "grad"
    stage: int  # the stage that produces the value
    microbatch: int


def compute_action(op: PipeOp) -> Action:
    return Action(COMPUTE[op.kind], f"stage{op.stage}", op.microbatch)


def lower_rank(schedule: Schedule, rank: int) -> tuple[Action, ...]:
    """The actions of pipeline rank ``rank``: its schedule ops with receives and sends around them.

    The step ends with its gradients finished, the metrics' all-reduce started (a no-op for a
    step that reports no metric and needs none) and the update. The update waits for the
    all-reduce only when it depends on it (clipping by the global norm, skipping on a
    non-finite gradient anywhere); otherwise the all-reduce completes while the rank
    updates, and a rank whose last compute comes early (the last stage, in 1F1B) updates
    while the others still compute instead of waiting for them.
    """
    last = schedule.num_stages - 1
    place = schedule.placement
    out: list[Action] = []
    for op in schedule.ranks[rank]:
        s, m = op.stage, op.microbatch
        if op.kind == "F":
            if s > 0 and place[s - 1] != rank:
                out.append(Action(RECV_ACTIVATION, f"stage{s}", m, (("from", place[s - 1]),)))
            out.append(compute_action(op))
            if s < last and place[s + 1] != rank:
                out.append(Action(SEND_ACTIVATION, f"stage{s}", m, (("to", place[s + 1]),)))
        elif op.kind in ("B", "I"):
            if s < last and place[s + 1] != rank:
                out.append(Action(RECV_GRAD, f"stage{s}", m, (("from", place[s + 1]),)))
            out.append(compute_action(op))
            if s > 0 and place[s - 1] != rank:
                out.append(Action(SEND_GRAD, f"stage{s}", m, (("to", place[s - 1]),)))
        else:
            out.append(compute_action(op))
    out += [Action(FINISH_GRADS), Action(REDUCE_METRICS), Action(UPDATE)]
    return tuple(out)


def tag_of(kind: str, stage: int, microbatch: int, microbatches: int, leaf: int = 0) -> int:
    """A distinct non-negative message tag per transfer and per tensor in it (gloo needs ints >= 0)."""
    direction = 0 if kind == "activation" else 1
    return (((stage * microbatches + microbatch) * 2 + direction) << 5) + leaf
