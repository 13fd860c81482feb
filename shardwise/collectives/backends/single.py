"""A world of one rank: what a program gets outside any launch and without torch.distributed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..timeout import DEFAULT_TIMEOUT_S
from .base import Backend, CheckedWork, CompletedWork, Group, Layout, Work, check_p2p
from .mailbox import LocalRecvWork, Mailbox


class SingleRankBackend(Backend):
    """A world of one rank: every collective is the identity (or zeros for an unmatched permute)."""

    name = "single"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
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
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True,
        donate: bool = False,
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

    def send(
        self, x: torch.Tensor, dst: int, tag: int, *, announce: bool = True, snapshot: bool = True,
        bounded: bool = True,
    ) -> Work:
        dst, tag = check_p2p("send", dst, tag, self.world_size, "dst")
        self._mailbox.put((0, 0, tag), x.detach().clone())  # the receiver's own tensor, snapshot or not
        return CompletedWork(x)

    def recv(self, src: int, tag: int, *, like: Layout | None = None) -> Work:
        src, tag = check_p2p("recv", src, tag, self.world_size, "src")
        key = (0, 0, tag)
        return CheckedWork(LocalRecvWork(self._mailbox, key, self._mailbox.claim(key)), like, src, tag)
