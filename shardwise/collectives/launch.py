"""SPMD launch: run the same program on every rank.

``launch(main, world=4)`` runs ``main`` on four ranks as threads of this
process (the default, for verification); ``backend="processes"`` spawns local
processes on torch.distributed with gloo. Under torchrun there is nothing to
launch: call ``main()`` directly, and the Mesh uses the existing process group.

An exception on any rank stops every rank (peers waiting in a collective stop
at once) and is raised in the caller as :class:`RankFailed` naming the rank.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .runtime import use_backend
from .threads import ThreadsBackend, ThreadsWorld

T = TypeVar("T")

DEFAULT_TIMEOUT = 120.0


class RankFailed(RuntimeError):
    """A rank raised; ``rank`` names it and ``__cause__`` is its exception (when it could be carried)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


def launch(
    fn: Callable[..., T],
    world: int,
    *,
    backend: str = "threads",
    timeout: float = DEFAULT_TIMEOUT,
    args: Sequence[Any] = (),
) -> list[T]:
    """Run ``fn(*args)`` on ``world`` ranks and return each rank's result, in rank order.

    ``timeout`` (seconds) bounds every collective wait; a rank that dies or
    never arrives makes the others fail after at most that long.

    >>> import torch, shardwise as sw
    >>> def main():
    ...     mesh = sw.Mesh(dp=2)
    ...     return sw.psum(torch.tensor([1.0 + mesh.rank]), "dp", mesh=mesh)
    >>> sw.launch(main, world=2)
    [tensor([3.]), tensor([3.])]
    """
    if isinstance(world, bool) or not isinstance(world, int) or world <= 0:
        raise ValueError(f"launch(world={world!r}): world must be a positive int")
    if timeout <= 0:
        raise ValueError(f"launch(timeout={timeout!r}): timeout must be positive seconds")
    if backend == "threads":
        return _launch_threads(fn, world, timeout, tuple(args))
    if backend == "processes":
        from .processes import launch_processes

        return launch_processes(fn, world, timeout=timeout, args=tuple(args))
    raise ValueError(f"launch(backend={backend!r}): choose 'threads' or 'processes'")


def _launch_threads(fn: Callable[..., T], world: int, timeout: float, args: tuple[Any, ...]) -> list[T]:
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

