"""The rank's head count taken by math's or numpy's functions, which read it in C: refused while a module is watched.

A number read from a per-head view's heads dim (``q.size(1)``) or a count a Region divides is a
:class:`~.head_numbers.HeadCount`, judged where a torch call takes it. math's and numpy's functions read an ``int``
subclass's value in C and ask it nothing (``math.sqrt(h)``, ``math.log2(h)``, ``np.linspace(0, 1, h)``): what they
return is a plain number, or an array, of the rank's count H/tp where one device's is H. A custom attention whose
projections are split without a Region (no probe runs it whole) trained another model without an error: a scale
``math.sqrt(q.size(1))`` (1.2% apart in the loss after one step of the tests' tiny attention at tp 2), per-head
values from ``np.linspace(0.5, 1, q.size(1))`` (0.24%), ALiBi slopes from ``math.log2`` of it (0.21%).

While :class:`~.split_watch.SplitWatch` watches a module's first call, the engine's stand-ins stand
(``engine/stack/host_calls.py``); a marked count given to one of math's or numpy's functions by the model's code
(not torch's or shardwise's) is refused here, naming the line and the fix. Inside a Region's first call it is left
to the Region's probe, which runs the module whole and refuses the values that differ (a result used as a size
computes the same there). ``range(h)`` and itertools' counts are let pass: a loop over the rank's heads takes each
in its place (what the loop computes is judged by head_loop_values.py), and ``math.ceil``, ``floor``, ``trunc`` and
``prod`` are not stand-ins.
"""

from __future__ import annotations

from typing import Any

from ...engine.stack.host_calls import register
from .head_numbers import Marked
from .model_frames import innermost_model_line
from .rank_flow import flow
from .read_refusals import head_count_message

_JUDGED = frozenset({"math", "numpy"})
_OWN = ("torch.", "shardwise.")


def _judge(number: Any, caller: str, call: str, kind: str) -> None:
    if getattr(flow, "in_region", 0):
        return  # a Region's first call: its probe runs the module whole and compares the values it computes
    if kind in _JUDGED and (not caller.startswith(_OWN) or caller.startswith("shardwise.testing")):
        raise ValueError(head_count_message(
            f"the model's code at {innermost_model_line()} passes {number.origin} to {call}, whose result (a plain "
            "number, or a numpy array) cannot be followed"))


register(Marked, _judge)
