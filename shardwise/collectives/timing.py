"""When each synchronous collective ran: what a traced step reads of the collectives its computes issue.

Inside :func:`timing`, every synchronous collective (``psum``, ``all_gather``, ... and the ones their
backward issues) notes its ``(start, end)`` on ``time.perf_counter``'s clock, in the order it ran,
whoever called it: a layer's own code, a library function (ring attention's ppermutes) or autograd's
transposes. The engine's executor opens it around each compute of a traced step; the Plan lists the
same collectives after that compute (the ledger contract holds them equal), so each finds its Plan
position. Asynchronous collectives (``*_async``) are not timed: their actions are. Outside
:func:`timing` a collective pays one context-variable read.

>>> import torch
>>> from shardwise.collectives import Mesh, launch, psum
>>> def main():
...     with timing() as times:
...         psum(torch.ones(2), "dp", mesh=Mesh(dp=2))
...     return len(times)
>>> launch(main, 2)
[1, 1]
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_times: contextvars.ContextVar[list[tuple[float, float]] | None] = contextvars.ContextVar(
    "shardwise_collective_times", default=None
)


@contextlib.contextmanager
def timing() -> Iterator[list[tuple[float, float]]]:
    """The (start, end) of every synchronous collective run inside this block, in order."""
    times: list[tuple[float, float]] = []
    token = _times.set(times)
    try:
        yield times
    finally:
        _times.reset(token)


def timed(run: Callable[[], T]) -> T:
    """``run()``, one synchronous collective: its start and end noted inside :func:`timing`."""
    times = _times.get()
    if times is None:
        return run()
    start = time.perf_counter()
    out = run()
    times.append((start, time.perf_counter()))
    return out
