"""Hooks around a thread rank's blocking waits.

Thread ranks share one process, so a rank may hold something the others need
while it computes (the engine's random streams hold torch's shared generators
for a compute). A rank that blocks in a collective inside that compute must
lend it, or the peer it waits for could never run: each hook is a context
manager entered around every blocking wait of the threads backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

_hooks: list[Callable[[], AbstractContextManager[None]]] = []


def on_blocking_wait(hook: Callable[[], AbstractContextManager[None]]) -> None:
    """Enter ``hook()`` around every blocking wait of a thread rank (registering twice is once)."""
    if hook not in _hooks:
        _hooks.append(hook)


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """The registered hooks, entered in order, around one blocking wait."""
    if not _hooks:
        yield
        return
    with contextlib.ExitStack() as stack:
        for hook in _hooks:
            stack.enter_context(hook())
        yield


_poll_hooks: list[Callable[[], None]] = []


def on_poll(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever a thread rank polls a collective's completion (registering twice is once)."""
    if hook not in _poll_hooks:
        _poll_hooks.append(hook)


def polled() -> None:
    """A thread rank asked whether a collective completed: as much a wait as a blocking one."""
    for hook in _poll_hooks:
        hook()
