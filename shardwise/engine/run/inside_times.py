"""A traced step's timing of the collectives its computes issue inside their layers (tensor parallel).

The Plan lists them as actions right after their compute (``lower.insert_inside``),
but the executor runs only the compute: the layers issue them while it runs. So
that ``metrics["action_times"]`` gives every action of the Plan at its Plan
position, the executor opens :func:`recording` around each compute of a traced
step, and the code that issues such a collective issues it through :func:`timed`.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_log: contextvars.ContextVar[list[tuple[float, float]] | None] = contextvars.ContextVar(
    "shardwise_inside_times", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[float, float]]]:
    """The (start, end) of every collective :func:`timed` inside this block, in order."""
    log: list[tuple[float, float]] = []
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)


def timed(issue: Callable[[], T]) -> T:
    """``issue()``, one collective issued inside a compute: timed when a traced step is recording.
    Untraced it costs one context-variable read (it runs on every in-layer collective)."""
    log = _log.get()
    if log is None:
        return issue()
    start = time.perf_counter()
    out = issue()
    log.append((start, time.perf_counter()))
    return out
