"""SPMD launch: run the same program on every rank.

``launch(main, world=4)`` runs ``main`` on four ranks as threads of this
process (the default, for verification); ``backend="processes"`` spawns local
processes on torch.distributed with gloo. Under torchrun there is nothing to
launch: call ``main()`` directly, and the Mesh uses the existing process group.

An exception on any rank stops every rank (peers waiting in a collective stop
at once) and is raised in the caller as :class:`RankFailed` naming the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .backends.processes import launch_processes
from .backends.thread_ranks import run_on_threads
from .errors import RankFailed

T = TypeVar("T")

DEFAULT_TIMEOUT = 120.0

__all__ = ["DEFAULT_TIMEOUT", "RankFailed", "launch"]


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
        return run_on_threads(fn, world, timeout, tuple(args))
    if backend == "processes":
        return launch_processes(fn, world, timeout=timeout, args=tuple(args))
    raise ValueError(f"launch(backend={backend!r}): choose 'threads' or 'processes'")
