"""A lock thread ranks take with an explicit ``acquire``, which a stopped rank cannot leak.

The threads launcher stops a rank it gave up on by raising RankStopped in its thread
(``thread_ranks.py``). It lands at the thread's next bytecode, and Python cannot take a
``threading.Lock`` and note that it did atomically: a rank blocked in ``acquire`` stops
right after the lock comes to it, before its ``finally`` that would let go is set up. The
lock then stays taken by a thread that no longer exists, and the next launch in the process
waits out its timeout for it. (A ``with lock:`` block is safe: the release is set up before
any bytecode runs after the acquire.)

So the lock here *is* the note of its holder: taking it is one assignment of the holder,
made under a guard that is only ever taken by ``with``. A holder that has ended (stopped
wherever it was) holds nothing: the next waiter takes the lock, at once or within
``_CHECK_S`` if it was already waiting (an ended thread wakes nobody).
"""

from __future__ import annotations

import threading
import time

_CHECK_S = 0.05  # how often a waiter looks whether the holder has ended


class RankLock:
    """A non-reentrant lock held by a thread, and free again once that thread has ended."""

    def __init__(self) -> None:
        self._guard = threading.Condition()  # taken by `with` only (see the module docstring)
        self._holder: threading.Thread | None = None  # changed under the guard only

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting at most ``timeout`` seconds; whether it was taken."""
        me = threading.current_thread()
        deadline = time.monotonic() + timeout
        with self._guard:
            if self._holder is me:
                raise RuntimeError(f"thread {me.name} took a RankLock it holds already: it is not reentrant")
            while self._holder is not None and self._holder.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._guard.wait(min(remaining, _CHECK_S))
            self._holder = me  # one assignment: taken, and who took it, at once
            return True

    def release(self) -> None:
        """Let go of the lock, which the calling thread holds."""
        me = threading.current_thread()
        with self._guard:
            if self._holder is not me:
                holder = "nobody" if self._holder is None else f"thread {self._holder.name}"
                raise RuntimeError(f"thread {me.name} released a RankLock that {holder} holds")
            self._holder = None
            self._guard.notify()

    def locked(self) -> bool:
        """Whether a live thread holds the lock."""
        with self._guard:
            return self._holder is not None and self._holder.is_alive()
