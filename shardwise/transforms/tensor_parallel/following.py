"""This thread's reduced-form follower (partial.py), and ``quiet`` for shardwise's own collectives.

A module of its own so that comm.py, whose collectives run quietly, need not import partial.py,
which issues them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .partial import Follower

_current = threading.local()  # .follower: the one following this thread's layer call, if any


def current() -> Follower | None:
    """The follower of this thread's layer call, if any."""
    return getattr(_current, "follower", None)


def set_current(follower: Follower | None) -> Follower | None:
    """Make ``follower`` this thread's; returns the one before (to restore)."""
    outer = current()
    _current.follower = follower
    return outer


class quiet:
    """No following while shardwise's own collectives run (their insides are not the model's code)."""

    def __enter__(self) -> None:
        self.follower = current()
        if self.follower is not None:
            self.follower.quiet += 1

    def __exit__(self, *exc: Any) -> None:
        if self.follower is not None:
            self.follower.quiet -= 1
