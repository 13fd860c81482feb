"""What a pipeline rank's transfers hold at each action beyond the stages' own figures (the Plan's
``transfer_buffers``), as ``engine/run/transfers.py`` holds them.

The stages' figures (``planning._kept_levels``) count a stage's input from its forward to its
backward and its output's gradient at its backward. Besides, the run holds:

* each receive, posted when the rank waits for the receive ``RECEIVES_AHEAD - 1`` before it (at its
  first receive, the first ``RECEIVES_AHEAD``): an activation's buffer until its forward, a gradient's
  until its backward (its input pass, when the backward is split);
* a stage output sent, from its send to that micro-batch's backward, which starts from it (to
  ``wait_sends`` for a stage without a backward); less what its last layer keeps of it itself, which
  the stage's figure counts already (a ReLU's result);
* an input gradient sent, to the first receive from its peer that proves it delivered
  (``run/send_delivery.py``), else to ``wait_sends``.

Left out, GPipe's middle ranks were planned 0.92 of their measured peak (tests/engine/
test_plan_peak_memory.py's language model: four micro-batches' received gradients, outputs and input
gradients, 0.5 MiB each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate

from ..plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    FORWARD,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    WAIT_SENDS,
    Action,
)
from ..run.send_delivery import Key
from ..run.transfers import RECEIVES_AHEAD


def transfer_levels(
    actions: Sequence[Action], own_output: Sequence[int], delivered_by: Mapping[Key, tuple[Key, ...]],
) -> list[int]:
    """At each action, the bytes the transfers hold (see the module docstring); ``own_output``, per stage, the
    bytes of its output that its last layer keeps itself; ``delivered_by``, the rank's receives and the gradient
    sends each proves delivered (``send_delivery.grad_sends_delivered``). All zero where the actions carry no
    ``wire`` (a Plan made without a batch, or transfers whose layouts were not predicted)."""
    n = len(actions)
    change = [0] * (n + 1)  # held from i to j (exclusive): +at i, -at j

    def hold(start: int, end: int, nbytes: int) -> None:
        if nbytes > 0 and end > start:
            change[start] += nbytes
            change[end] -= nbytes

    forward: dict[tuple[int | None, int], int] = {}  # (stage, micro-batch) -> the index of its forward
    backward: dict[tuple[int | None, int], int] = {}  # ... of its backward, or its input pass
    for i, a in enumerate(actions):
        if a.kind == FORWARD:
            forward.setdefault((a.stage, a.mb), i)
        elif a.kind in (BACKWARD, BACKWARD_INPUT):
            backward.setdefault((a.stage, a.mb), i)
    receives = [i for i, a in enumerate(actions) if a.kind in (RECV_ACTIVATION, RECV_GRAD)]
    posted = {i: receives[max(k - RECEIVES_AHEAD + 1, 0)] for k, i in enumerate(receives)}
    let_go = [n] * n  # where each send is let go of at the latest: the next wait_sends
    next_wait = n
    for i in range(n - 1, -1, -1):
        let_go[i] = next_wait
        if actions[i].kind == WAIT_SENDS:
            next_wait = i
    proven_at: dict[Key, int] = {}  # a gradient send -> the receive that lets it go
    for i in receives:
        a = actions[i]
        for sent in delivered_by.get(("activation" if a.kind == RECV_ACTIVATION else "grad", a.require("stage"), a.mb),
                                     ()):
            proven_at.setdefault(sent, i)
    for i, a in enumerate(actions):
        key = (a.stage, a.mb)
        if a.kind == RECV_ACTIVATION:
            hold(posted[i], forward.get(key, n), a.nbytes)
        elif a.kind == RECV_GRAD:
            hold(posted[i], backward.get(key, n), a.nbytes)
        elif a.kind == SEND_ACTIVATION:
            if key in backward:
                hold(i, backward[key] + 1, a.nbytes - own_output[a.require("stage")])
            else:
                hold(i, let_go[i], a.nbytes)
        elif a.kind == SEND_GRAD:
            proof = proven_at.get(("grad", a.require("stage"), a.mb), n)
            hold(i, min(proof, let_go[i]) if proof > i else let_go[i], a.nbytes)
    return list(accumulate(change[:n]))
