"""Running one function on the rank threads of a :class:`~.threads.ThreadsWorld`."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import RankFailed
from .current import use_backend
from .threads import ThreadsBackend, ThreadsWorld

T = TypeVar("T")


def run_on_threads(fn: Callable[..., T], world: int, timeout: float, args: tuple[Any, ...]) -> list[T]:
    threads_world = ThreadsWorld(world, timeout)
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            with use_backend(ThreadsBackend(threads_world, rank)):
                results[rank] = fn(*args)
        except BaseException as exc:
            threads_world.abort(rank, exc)

    threads = []
    for rank in range(world):
        # Each rank runs in a copy of the caller's context, so a comm_ledger()
        # opened around launch() sees every rank's collectives.
        ctx = contextvars.copy_context()
        t = threading.Thread(
            target=ctx.run, args=(body, rank), name=f"shardwise-rank-{rank}", daemon=True
        )
        threads.append(t)
        t.start()

    _join_threads(threads, threads_world, timeout)
    if threads_world.failure is not None:
        # The first failure recorded is the root cause: later ones are RankAborted reactions.
        rank, error = threads_world.failure
        raise RankFailed(rank, f"{type(error).__name__}: {error}") from error
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise RankFailed(stuck[0], f"ranks {stuck} did not finish within the timeout of {timeout:g} s")
    return results


def _join_threads(threads: list[threading.Thread], world: ThreadsWorld, timeout: float) -> None:
    # Ranks in a collective stop on abort or timeout by themselves. A rank stuck
    # outside any collective cannot be killed: once another rank has failed we
    # give it one timeout to finish, then report it (it is a daemon thread).
    failed_at: float | None = None
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.05)
        if world.failure is not None and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > timeout:
            return

