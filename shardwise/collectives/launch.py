"""SPMD launch: run the same program on every rank.

``launch(main, world=4)`` runs ``main`` on four ranks as threads of this
process (the default, for verification); ``backend="processes"`` starts local
processes on torch.distributed with gloo. Under torchrun there is nothing to
launch: call ``main()`` directly, and the Mesh uses the existing process group.

An exception on any rank stops every rank (peers waiting in a collective stop
at once) and is raised in the caller as :class:`RankFailed` naming the rank.
``launch`` always returns or raises: a rank that never arrives where the
others wait for it, or that is still running ``timeout`` seconds after the
first rank returned, is :class:`RankHung`; Ctrl-C stops every rank and
propagates. Rank processes never outlive the launcher (``backends/processes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .backends.processes import launch_processes
from .backends.thread_ranks import run_on_threads
from .errors import RankFailed, RankHung
from .timeout import DEFAULT_TIMEOUT_S, check_timeout

T = TypeVar("T")

__all__ = ["DEFAULT_TIMEOUT_S", "RankFailed", "RankHung", "launch"]


def launch(
    fn: Callable[..., T],
    world: int,
    *,
    backend: str = "threads",
    timeout: float = DEFAULT_TIMEOUT_S,
    args: Sequence[Any] = (),
    max_processes: int | None = None,
) -> list[T]:
    """Run ``fn(*args)`` on ``world`` ranks and return each rank's result, in rank order.

    ``timeout`` (seconds, default 300) bounds
    every wait of every rank: a rank that dies, hangs or never arrives makes
    the run fail after at most that long, with an error naming it.
    ``backend="processes"`` refuses a world larger than ``max_processes``
    (default: 4 per CPU, at least 8); pass a larger one if you mean it.

    >>> import torch, shardwise as sw
    >>> def main():
    ...     mesh = sw.Mesh(dp=2)
    ...     return sw.collectives.psum(torch.tensor([1.0 + mesh.rank]), "dp", mesh=mesh)
    >>> sw.launch(main, world=2, timeout=60)
    [tensor([3.]), tensor([3.])]
    """
    if isinstance(world, bool) or not isinstance(world, int) or world <= 0:
        raise ValueError(f"launch(world={world!r}): world must be a positive int")
    timeout = check_timeout("launch", timeout)
    if backend == "threads":
        if max_processes is not None:
            raise ValueError("launch(max_processes=...) bounds backend='processes'; threads start no process")
        return run_on_threads(fn, world, timeout, tuple(args))
    if backend == "processes":
        return launch_processes(fn, world, timeout=timeout, args=tuple(args), max_processes=max_processes)
    raise ValueError(f"launch(backend={backend!r}): choose 'threads' or 'processes'")
