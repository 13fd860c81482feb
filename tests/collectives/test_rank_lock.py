"""RankLock: a lock thread ranks take with an explicit acquire, free again once its holder ended.

The threads launcher stops a rank by raising RankStopped in its thread (PyThreadState_SetAsyncExc),
which lands at the thread's next bytecode: with a threading.Lock taken by ``acquire()``, right
after the lock came to it, so the rank ended holding it and every later taker waited out its
timeout. These tests stop threads the launcher's way, at exactly those points.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import shardwise
from shardwise.collectives.backends.rank_lock import _CHECK_S, RankLock
from shardwise.collectives.backends.thread_ranks import RankStopped
from shardwise.engine.run import rng


def _stop(thread: threading.Thread) -> None:
    """What the launcher does to a rank it gave up on."""
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RankStopped))


def _in_thread(body: Callable[[], None]) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(RankStopped):
            body()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _stopped_while_waiting(lock: threading.Lock | RankLock, take: Callable[[], None]) -> threading.Thread:
    """A thread stopped while it waits for ``lock`` (held here), which is then let go."""
    waiter = _in_thread(take)
    time.sleep(0.2)  # it waits for the lock by now
    _stop(waiter)
    time.sleep(0.1)
    lock.release()
    waiter.join(2.0)
    assert not waiter.is_alive()
    return waiter


def test_a_lock_module_level_code_takes_by_acquire_stays_taken_when_its_thread_is_stopped() -> None:
    # Why RankLock exists: the stop lands right after acquire() returns, before any finally.
    lock = threading.Lock()
    lock.acquire()

    def take() -> None:
        if lock.acquire(timeout=5.0):
            try:
                pass
            finally:
                lock.release()

    _stopped_while_waiting(lock, take)
    assert lock.locked()


def test_a_lock_taken_by_with_is_let_go_when_its_thread_is_stopped() -> None:
    # What RankLock's guard and the package's other locks rely on (CPython 3.11: the exit is set up
    # before any bytecode runs after the acquire).
    lock = threading.Lock()
    lock.acquire()

    def take() -> None:
        with lock:
            time.sleep(0)

    _stopped_while_waiting(lock, take)
    assert not lock.locked()


def test_a_rank_lock_whose_holder_ended_without_letting_go_is_taken_at_once() -> None:
    lock = RankLock()
    holder = _in_thread(lambda: lock.acquire(timeout=1.0) and None)  # ends holding it, as a stopped rank
    holder.join(2.0)
    started = time.monotonic()
    assert lock.acquire(timeout=2.0)
    assert time.monotonic() - started < 1.0
    lock.release()
    assert not lock.locked()


def test_a_rank_lock_waiter_takes_it_soon_after_its_holder_is_stopped_holding_it() -> None:
    lock, taken = RankLock(), threading.Event()

    def hold() -> None:
        assert lock.acquire(timeout=1.0)
        taken.set()
        while True:  # computes until stopped, never letting go
            time.sleep(0.01)

    holder = _in_thread(hold)
    assert taken.wait(2.0)
    assert not lock.acquire(timeout=0.2)  # a live holder keeps it
    got: list[float] = []
    waiter = _in_thread(lambda: got.append(time.monotonic()) if lock.acquire(timeout=5.0) else None)
    time.sleep(0.1)
    stopped = time.monotonic()
    _stop(holder)
    waiter.join(2.0)
    assert got and got[0] - stopped < 20 * _CHECK_S  # it looks every _CHECK_S


def test_a_rank_lock_waiter_stopped_while_waiting_leaves_it_free() -> None:
    lock = RankLock()
    assert lock.acquire(timeout=1.0)
    _stopped_while_waiting(lock, lambda: lock.acquire(timeout=5.0) and None)
    assert not lock.locked()
    assert lock.acquire(timeout=0.1)
    lock.release()


def test_a_rank_lock_is_handed_to_a_waiter_when_let_go() -> None:
    lock, order = RankLock(), []
    assert lock.acquire(timeout=1.0)
    waiter = _in_thread(lambda: order.append("waiter") if lock.acquire(timeout=5.0) else None)
    time.sleep(0.1)
    order.append("released")
    released = time.monotonic()
    lock.release()
    waiter.join(2.0)
    assert order == ["released", "waiter"]
    assert time.monotonic() - released < 1.0


def test_a_rank_lock_refuses_a_second_take_and_a_release_by_another_thread() -> None:
    lock = RankLock()
    assert lock.acquire(timeout=1.0)
    with pytest.raises(RuntimeError, match="holds already: it is not reentrant"):
        lock.acquire(timeout=1.0)
    errors: list[BaseException] = []

    def release() -> None:
        try:
            lock.release()
        except RuntimeError as exc:
            errors.append(exc)

    _in_thread(release).join(2.0)
    assert len(errors) == 1 and "released a RankLock that thread MainThread holds" in str(errors[0])
    lock.release()
    with pytest.raises(RuntimeError, match="released a RankLock that nobody holds"):
        lock.release()


def test_no_module_takes_a_lock_by_acquire_but_through_a_rank_lock() -> None:
    # Thread ranks run the whole package: a lock taken by acquire() outside a RankLock leaks when a
    # rank is stopped (take locks by `with`, or make them RankLocks).
    root = Path(shardwise.__file__).parent
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.acquire\(", line)
    ]
    rank_locks = {"engine/run/rng.py:": "_SHARED.acquire(",
                  "collectives/backends/thread_ranks.py:": "held_by_one.acquire("}
    assert all(any(f.startswith(path) and taken in f for path, taken in rank_locks.items()) for f in found), found
    assert isinstance(rng._SHARED, RankLock)
    assert "self.held_by_one = RankLock()" in (root / "collectives/backends/thread_ranks.py").read_text()
