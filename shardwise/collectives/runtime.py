"""Which backend the calling rank talks through.

Each rank (a thread of the threads backend, or a process on torch.distributed)
has its own current backend in a context variable: threads do not share it,
and nothing global is mutated. Outside any launch, a program runs as a world of
one, unless torch.distributed is already initialised (torchrun), in which case
the distributed backend is created for it on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .backend import (
    Backend,
    CheckedWork,
    CollectiveError,
    CompletedWork,
    Group,
    Layout,
    Work,
    check_p2p,
)

if TYPE_CHECKING:
    from .threads import Mailbox

_current: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "shardwise_backend", default=None
)


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` the current rank's backend inside the block."""
    token = _current.set(backend)
    try:
        yield backend
    finally:
        _current.reset(token)


def current_backend() -> Backend:
    """The calling rank's backend (see the module docstring for the fallbacks)."""
    backend = _current.get()
    if backend is not None:
        return backend
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .distributed import TorchDistributedBackend

        backend = TorchDistributedBackend.from_initialized()
    else:
        backend = SingleRankBackend()
    _current.set(backend)
    return backend


class SingleRankBackend(Backend):
    """A world of one rank: every collective is the identity (or zeros for an unmatched permute)."""

    name = "single"

    def __init__(self, timeout: float = 60.0) -> None:
        from .threads import Mailbox

        self.rank = 0
        self.world_size = 1
        self.timeout = timeout
        self._mailbox = Mailbox()  # messages this rank sent to itself

    # Results are copies whatever ``snapshot`` says: they must never be the input.
    def all_reduce(
        self, x: torch.Tensor, group: Group, op_name: str = "psum", *, snapshot: bool = True
    ) -> Work:
        return CompletedWork(x.clone())

    def all_gather(
        self, x: torch.Tensor, group: Group, op_name: str = "all_gather", *, snapshot: bool = True
    ) -> Work:
        return CompletedWork(x.unsqueeze(0).clone())

    def reduce_scatter(
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True
    ) -> Work:
        return CompletedWork(x[0].clone())

    def all_to_all(
        self, x: torch.Tensor, group: Group, op_name: str = "all_to_all", *, snapshot: bool = True
    ) -> Work:
        return CompletedWork(x.clone())

    def broadcast(
        self, x: torch.Tensor, root: int, group: Group, op_name: str = "broadcast", *, snapshot: bool = True
    ) -> Work:
        return CompletedWork(x.clone())

    def permute(
        self,
        x: torch.Tensor,
        pairs: Sequence[tuple[int, int]],
        group: Group,
        op_name: str = "ppermute",
        *,
        snapshot: bool = True,
    ) -> Work:
        received = (0, 0) in [tuple(p) for p in pairs]
        return CompletedWork(x.clone() if received else torch.zeros_like(x))

    def send(self, x: torch.Tensor, dst: int, tag: int, *, announce: bool = True, snapshot: bool = True) -> Work:
        dst, tag = check_p2p("send", dst, tag, self.world_size, "dst")
        self._mailbox.put((0, 0, tag), x.detach().clone())  # the receiver's own tensor, snapshot or not
        return CompletedWork(x)

    def recv(self, src: int, tag: int, *, like: Layout | None = None) -> Work:
        src, tag = check_p2p("recv", src, tag, self.world_size, "src")
        key = (0, 0, tag)
        return CheckedWork(LocalRecvWork(self._mailbox, key, self._mailbox.claim(key)), like, src, tag)


class LocalRecvWork(Work):
    """A receive by a rank from itself: the message is in its local mailbox already, or never comes."""

    def __init__(self, mailbox: Mailbox, key: tuple[int, int, int], seq: int) -> None:
        self._mailbox, self._key, self._seq = mailbox, key, seq
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            rank, _, tag = self._key

            def nothing_sent() -> CollectiveError:
                return CollectiveError(
                    f"recv from rank {rank} (tag {tag}) on rank {rank}: this rank has not sent itself "
                    f"message #{self._seq} with tag {tag}, and no other rank can; send to yourself "
                    "before waiting on the receive"
                )

            self._result = self._mailbox.take(self._key, self._seq, 0.0, nothing_sent)
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._mailbox.has(self._key, self._seq)
