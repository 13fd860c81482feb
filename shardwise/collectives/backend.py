"""The contract every communication backend fulfils.

A backend moves plain tensors between the ranks of a *group* (the global ranks
of one mesh axis slice, in axis order). It knows nothing of autograd, meshes or
the ledger: the differentiable collectives in ``ops.py`` sit on top of it, so a
new backend only has to implement these few primitives.

Every primitive is asynchronous: it returns a :class:`Work` whose ``wait()``
gives the result. The synchronous collectives simply wait at once; executors
that overlap communication with compute keep the handle.

Shape conventions (``n`` is the group size, ``i`` the caller's index in it):

* ``all_reduce(x)``        -> sum over ranks of ``x``, same shape.
* ``all_gather(x)``        -> ``stack([x_0, ..., x_{n-1}])``, shape ``(n, *x.shape)``.
* ``reduce_scatter(x)``    -> ``x`` has shape ``(n, *rest)``; result is
  ``sum_j x_j[i]``, shape ``rest``.
* ``all_to_all(x)``        -> ``x`` has shape ``(n, *rest)``; result ``out[j] = x_j[i]``.
* ``broadcast(x, root)``   -> the value of ``x`` on group index ``root``.
* ``permute(x, pairs)``    -> ``pairs`` are ``(src, dst)`` group indices; the
  caller receives ``x_src`` from the pair whose ``dst == i``, zeros if none.

Sums are taken in the tensor's own dtype. Results are new tensors: a backend
never writes into its input.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    """The global ranks that take part in one collective, in mesh-axis order."""

    axis: str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"Group for axis {self.axis!r} has no ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"Group for axis {self.axis!r} repeats a rank: {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """Position of global ``rank`` in this group."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in the group of axis {self.axis!r} {self.ranks}") from None


class CollectiveError(RuntimeError):
    """A collective could not complete (timeout, a peer failed, backend error)."""


class CollectiveTimeout(CollectiveError):
    """A collective waited longer than the timeout; the message names the op, axis and missing ranks."""


class RankAborted(CollectiveError):
    """Another rank failed, so this rank stopped waiting in a collective."""


class Work(abc.ABC):
    """Handle of an asynchronous collective; ``wait()`` returns its result."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the collective finished (or raise CollectiveError) and return the result."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True when ``wait()`` would not block."""


class CompletedWork(Work):
    """A Work whose result is already known (world of one, or computed eagerly)."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result

    def is_completed(self) -> bool:
        return True


class Backend(abc.ABC):
    """One rank's handle on a communication world.

    ``rank`` and ``world_size`` are global. ``timeout`` (seconds) bounds every
    wait, so a dead or diverged peer turns into a :class:`CollectiveTimeout`
    instead of a hang.
    """

    name: str
    rank: int
    world_size: int
    timeout: float

    @property
    def device(self) -> torch.device:
        """Device on which this backend expects tensors (cpu for threads and gloo)."""
        return torch.device("cpu")

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, group: Group, op_name: str = "psum") -> Work: ...

    @abc.abstractmethod
    def all_gather(self, x: torch.Tensor, group: Group, op_name: str = "all_gather") -> Work: ...

    @abc.abstractmethod
    def reduce_scatter(self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter") -> Work: ...

    @abc.abstractmethod
    def all_to_all(self, x: torch.Tensor, group: Group, op_name: str = "all_to_all") -> Work: ...

    @abc.abstractmethod
    def broadcast(self, x: torch.Tensor, root: int, group: Group, op_name: str = "broadcast") -> Work: ...

    @abc.abstractmethod
    def permute(
        self, x: torch.Tensor, pairs: Sequence[tuple[int, int]], group: Group, op_name: str = "ppermute"
    ) -> Work: ...

    def barrier(self, group: Group) -> None:
        """Wait until every rank of ``group`` arrives."""
        self.all_reduce(torch.zeros(1), group, op_name="barrier").wait()

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have nothing to release
        """Release resources held by this rank's handle."""
