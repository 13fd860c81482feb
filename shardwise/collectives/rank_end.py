"""Work a launched rank finishes when its function returns, while its backend is still there.

A checkpoint saved with ``blocking=False`` is written by a thread and committed by ``handle.wait()``,
a collective. A program that returns without waiting left its last checkpoint uncommitted (it does
not load), and the interpreter often aborted at exit (SIGABRT) with the writer thread still inside
torch. ``sw.launch`` runs each rank's :func:`at_rank_end` callbacks after its function returns, in
the order they were registered, on every rank alike (as SPMD programs register them), with the
collectives still up; a callback that fails fails the rank. A program that is not launched
(torchrun) has no such end: its callbacks never run here (checkpoints warn at exit instead).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

_callbacks: contextvars.ContextVar[list[Callable[[], object]] | None] = contextvars.ContextVar(
    "shardwise_rank_end", default=None
)


def at_rank_end(callback: Callable[[], object]) -> None:
    """Run ``callback`` when the calling launched rank's function returns (no-op outside a launch)."""
    callbacks = _callbacks.get()
    if callbacks is not None:
        callbacks.append(callback)


def run_rank(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)``, then the callbacks it registered (each launcher's rank body calls this)."""
    token = _callbacks.set([])
    try:
        result = fn(*args)
        callbacks = _callbacks.get() or []
        while callbacks:
            callbacks.pop(0)()
        return result
    finally:
        _callbacks.reset(token)


def in_launched_rank() -> bool:
    """Whether the caller runs inside a launched rank's function (its callbacks will run)."""
    return _callbacks.get() is not None
