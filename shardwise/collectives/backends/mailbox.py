"""Point-to-point messages inside one process, matched per (src, dst, tag).

The threads backend keeps every rank's messages in one :class:`Mailbox`; the
single-rank and torch.distributed backends keep the messages a rank sends to
itself in one of their own (gloo cannot send to itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ..errors import CollectiveError
from .base import Work

MailKey = tuple[int, int, int]  # (src, dst, tag), global ranks


class Mailbox:
    """Point-to-point messages, matched per (src, dst, tag) in the order sends and receives were issued.

    A receive claims a sequence number when it is issued and takes exactly the
    message sent with that number, so the n-th receive gets the n-th message
    whatever order the receives are waited in. Thread-safe; every method takes
    the condition, which may be shared (the threads world shares its own, so
    an abort wakes waiting receives).
    """

    def __init__(self, cond: threading.Condition | None = None) -> None:
        self._cond = cond if cond is not None else threading.Condition()
        self._messages: dict[MailKey, dict[int, torch.Tensor]] = {}
        self._sent: dict[MailKey, int] = {}
        self._claimed: dict[MailKey, int] = {}

    def put(self, key: MailKey, tensor: torch.Tensor) -> None:
        with self._cond:
            seq = self._sent.get(key, 0)
            self._sent[key] = seq + 1
            self._messages.setdefault(key, {})[seq] = tensor
            self._cond.notify_all()

    def claim(self, key: MailKey) -> int:
        """The sequence number of the next receive on ``key``."""
        with self._cond:
            seq = self._claimed.get(key, 0)
            self._claimed[key] = seq + 1
            return seq

    def has(self, key: MailKey, seq: int) -> bool:
        with self._cond:
            return seq in self._messages.get(key, {})

    def take(
        self,
        key: MailKey,
        seq: int,
        timeout: float,
        on_timeout: Callable[[], BaseException],
        check: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """Wait up to ``timeout`` s for message ``seq`` on ``key`` and remove it.

        ``check`` runs while waiting (under the condition) and may raise, e.g.
        when the world aborted; ``on_timeout()`` is raised when time runs out.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                box = self._messages.get(key)
                if box is not None and seq in box:
                    tensor = box.pop(seq)
                    if not box:
                        del self._messages[key]
                    return tensor
                check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise on_timeout()
                self._cond.wait(remaining)


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
