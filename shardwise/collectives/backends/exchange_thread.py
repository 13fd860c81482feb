"""The thread a member set's exchanges run on, in issue order, and the caller's handle on each.

Both transports of the exchanges (``gloo_exchange.py`` over TCP, ``shared_memory_exchange.py``
through shared memory) hand an exchange that must progress while the caller computes to a thread
of the member set's: every member issues the same exchanges in the same order (the program is
SPMD), so running them in issue order on each member matches them up. A failed exchange fails
every later one on the set with the first error.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from ..errors import CollectiveError
from .base import Group, Rows, Work

ErrorFor = Callable[[str, Group, BaseException], CollectiveError]


class Job:
    """One exchange: what it takes (``rows``, the caller's own; ``out``, its result's buffer when
    made at issue; ``into``, an all-gather's destinations: the caller's pieces per member, its
    input already in this member's, of ``dtype``; ``pieces``, a reduce-scatter's input as the
    caller's pieces per member, to be summed in ``dtype``) and, once ``done``, its ``result`` or
    ``error``."""

    __slots__ = ("done", "dtype", "error", "group", "into", "kind", "op_name", "out", "pieces", "result", "rows",
                 "shape")

    def __init__(self, kind: str, op_name: str, group: Group, out: torch.Tensor | None, rows: torch.Tensor | None,
                 shape: torch.Size, into: Rows | None = None, pieces: Rows | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.kind, self.op_name, self.group, self.out, self.rows, self.shape = kind, op_name, group, out, rows, shape
        self.into, self.pieces, self.dtype = into, pieces, dtype
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class JobWork(Work):
    """The caller's handle on an exchange its set's thread runs."""

    def __init__(self, job: Job, timeout: float, error_for: ErrorFor) -> None:
        self._job, self._timeout, self._error_for = job, timeout, error_for

    def wait(self) -> torch.Tensor:
        job = self._job
        if not job.done.wait(self._timeout):
            raise self._error_for(job.op_name, job.group, TimeoutError(f"wait timed out after {self._timeout:g} s"))
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def is_completed(self) -> bool:
        return self._job.done.is_set()


class JobThread:
    """Runs ``run(job)`` for each submitted job in order on a daemon thread (started at the first);
    ``release()`` once closed and idle."""

    def __init__(self, name: str, run: Callable[[Job], None], timeout: float, error_for: ErrorFor,
                 release: Callable[[], None] = lambda: None) -> None:
        self._name, self._run, self._timeout, self._error_for, self._release = name, run, timeout, error_for, release
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._failure: CollectiveError | None = None
        self._closed = False
        self.thread: threading.Thread | None = None

    def submit(self, job: Job) -> Work:
        with self._cond:
            if self._failure is not None:
                raise CollectiveError(f"{job.op_name}: an earlier exchange on this group failed: {self._failure}")
            self._queue.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self.thread.start()
            self._cond.notify_all()
        return JobWork(job, self._timeout, self._error_for)

    def close(self) -> None:
        """Fail what is queued; release at once when the thread never started, else when it is idle."""
        with self._cond:
            self._failure = self._failure or CollectiveError("the exchange was closed")
            self._closed = True
            if self.thread is None:
                self._release()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        self._release()
                        return
                    self._cond.wait()
                job = self._queue[0]
            try:
                if self._failure is not None:
                    raise CollectiveError(f"{job.op_name}: an earlier exchange on this group failed: {self._failure}")
                self._run(job)
            except BaseException as exc:  # the caller's wait raises it
                error = exc if isinstance(exc, CollectiveError) else self._error_for(job.op_name, job.group, exc)
                # Without the traceback: its frames would hold this exchange's tensors for the set's life.
                error = error.with_traceback(None)
                exc.__traceback__ = None
                job.error = error
                with self._cond:
                    self._failure = self._failure or error
            finally:
                # Released here (a result is its own or a view), whatever the caller holds.
                job.rows = job.out = job.into = job.pieces = None
                with self._cond:
                    self._queue.popleft()
                job.done.set()
                # Not kept while this thread waits for the next one: the result is the caller's.
                del job
