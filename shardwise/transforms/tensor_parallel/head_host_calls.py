"""The rank's head count taken by math's or numpy's functions, which read it in C: refused while a module is watched.

A number read from a per-head view's heads dim (``q.size(1)``) or a count a Region divides is a
:class:`~.head_numbers.HeadCount`, judged where a torch call takes it. math's and numpy's functions read an ``int``
subclass's value in C and ask it nothing (``math.sqrt(h)``, ``math.log2(h)``, ``np.linspace(0, 1, h)``): what they
return is a plain number, or an array, of the rank's count H/tp where one device's is H. A custom attention whose
projections are split without a Region (no probe runs it whole) trained another model without an error: a scale
``math.sqrt(q.size(1))`` (1.2% apart in the loss after one step of the tests' tiny attention at tp 2), per-head
values from ``np.linspace(0.5, 1, q.size(1))`` (0.24%), ALiBi slopes from ``math.log2`` of it (0.21%).

While :class:`~.split_watch.SplitWatch` watches a module's first call, the engine's stand-ins stand
(``engine/stack/host_calls.py``); a marked count given by the model's code (not torch's or shardwise's) to one of
math's or numpy's functions, or as ``enumerate``'s ``start``, is refused here, naming the line and the fix. Inside a
Region's first call it is left to the Region's probe, which runs the module whole and refuses the values that differ
(a result used as a size computes the same there). Outside one, ``range(h)`` returns a
:class:`~.head_numbers.HeadRange` of head numbers (a loop over the rank's heads takes each in its place, and a number
of it used as a value is refused: head_numbers.py; ``isinstance(r, range)`` holds for it); ``enumerate`` over it, or
over one item per head (``[x] * h``, ``q.unbind(1)``), numbers its counter so; ``len`` and ``sum`` of one item per
head return the rank's count, marked; ``operator.index`` of a marked number returns it, its mark kept (a plain
``int`` otherwise, since Python 3.10). itertools' counts are let pass (what a loop computes from the heads it reads
is judged by head_loop_values.py), and ``math.ceil``, ``floor``, ``trunc`` and ``prod`` are not stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ...engine.stack.host_calls import reads_as, register
from .head_numbers import HeadCount, HeadIndex, HeadRange, HeadValue, Marked, Numbered, PerHeadItems
from .model_frames import innermost_model_line
from .rank_flow import flow
from .read_refusals import head_count_message, head_value_message

_JUDGED = frozenset({"math", "numpy", "enumerate"})
_OWN = ("torch.", "shardwise.")
_SEQUENCES = (HeadRange, *PerHeadItems)  # (a range of head numbers, a list or tuple of one item per head)


def _judge(number: Any, caller: str, call: str, kind: str) -> Callable[[Any], Any] | None:
    if getattr(flow, "in_region", 0):
        return None  # a Region's first call: its probe runs the module whole and compares the values it computes
    if caller.startswith(_OWN) and not caller.startswith("shardwise.testing"):
        return None
    if kind == "range":
        origin = number.origin if isinstance(number, Numbered) else f"a head number of range() over {number.origin}"
        return lambda numbers: HeadRange(numbers, origin)  # each a HeadIndex: an index, refused as a value
    if kind == "operator":
        return lambda _: number  # operator.index(h): the number itself, its mark kept (an exact int otherwise)
    if kind == "enumerate" and isinstance(number, _SEQUENCES):
        origin = f"a head number of enumerate() over {number.origin}"
        return lambda pairs: _numbered(pairs, origin)
    if kind == "builtins" and isinstance(number, _SEQUENCES):
        if call == "builtins.sum" and any(isinstance(item, torch.Tensor) for item in number):
            raise ValueError(
                f"tensor_parallel: the model's code at {innermost_model_line()} sums {number.origin} with Python's "
                "sum(): over this rank's heads alone. Each rank holds 1/tp of the heads, so a sum across them is the "
                "rank's heads' where one device's is all of them, another model trained without an error. Compute "
                "it within each head, or leave this module's projections out of the plan (replicated)")
        return lambda result: _counted(result, f"{call.partition('.')[2]}() of {number.origin}")
    if kind in _JUDGED:
        what = "numbers (plain ints counted on from it)" if kind == "enumerate" else (
            "result (a plain number, or a numpy array)")
        message = head_value_message if isinstance(number, (*Numbered, HeadRange)) else head_count_message
        raise ValueError(message(
            f"the model's code at {innermost_model_line()} passes {number.origin} to {call}, whose {what} cannot be "
            "followed"))
    return None


def _numbered(pairs: Iterable[tuple[int, Any]], origin: str) -> Iterator[tuple[HeadIndex, Any]]:
    """``enumerate`` over one item per head: each counter a head number."""
    return ((HeadIndex(i, origin), item) for i, item in pairs)


def _counted(result: Any, origin: str) -> Any:
    """``len`` or ``sum`` of one item per head: the rank's count, or a total over its heads, marked as computed from
    the count (a value made of it is refused where torch takes it); a marked result keeps its own mark."""
    if isinstance(result, (*Marked, bool)) or not isinstance(result, (int, float)):
        return result
    return HeadCount(result, origin) if isinstance(result, int) else HeadValue(result, origin)


register((*Marked, *_SEQUENCES), _judge)  # (given whole: np.array(range(h)), len([1.0] * h))
reads_as("range", HeadRange)  # (isinstance(range(h), range) holds for the range of head numbers made in its place)
