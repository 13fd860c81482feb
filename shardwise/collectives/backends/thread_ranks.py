"""Running one function on the rank threads of a :class:`~.threads.ThreadsWorld`, and always
coming back.

* A rank that raises stops every rank waiting in a collective at once
  (:class:`RankAborted`); the launcher raises :class:`RankFailed` for it.
* A rank that waits longer than the timeout for a peer raises
  :class:`CollectiveTimeout` naming the peers that never arrived. Peers still
  running a moment later are hung: :class:`RankHung` names them and quotes
  the collective and axis they were awaited in.
* The end of the function is a last rendezvous: a rank still running
  ``timeout`` seconds after the first rank returned is hung after its last
  collective (:class:`RankHung`).
* KeyboardInterrupt (Ctrl-C) or SystemExit (a signal handler) in the
  launcher stops every rank, then propagates.

Ranks start one at a time: rank r + 1 starts when rank r first waits in a collective (or
polls one, or returns), or at the latest a few seconds after rank r started (a fraction of
the timeout, so waiting for a late start never uses it up). Code before a rank's first
collective (seeding torch and building a model) therefore does not interleave with another
rank's, so ranks that seed alike build alike, run to run, although thread ranks share
torch's one global generator; a build that takes longer than the turn may interleave, and
``step.init`` then refuses ranks that built different models. A rank inside :func:`holding_turn`
(``functionalize``, which sets the generators back after tracing and checking the model and refuses a
model whose glue code drew from them) does not spend its turn there, up to a second turn of
``timeout / (4 * world)``: the next rank's seeding and build start after it, not in the middle of it,
and the last rank still starts within half the timeout. Ranks inside it take turns (a rank started
meanwhile waits at its own ``functionalize`` for the other's to end, at most the timeout).

Python cannot kill a thread. The launcher stops a rank it gives up on by
raising :class:`RankStopped` in its thread (``PyThreadState_SetAsyncExc``),
which takes effect at the thread's next Python bytecode: a rank looping,
polling or computing tensor ops stops within moments; one blocked in a single
C call (a long ``time.sleep``, a lock) cannot, and stays behind as a daemon
thread, which the error says. No rank thread is left running otherwise, so
the interpreter never exits under a thread busy in torch (torch 2.13 then
aborts with "terminate called without an active exception").
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import CollectiveError, CollectiveTimeout, RankFailed, RankHung
from ..rank_end import run_rank
from .blocking import on_blocking_wait, on_poll
from .current import use_backend
from .rank_lock import RankLock
from .threads import ThreadsBackend, ThreadsWorld

_POLL_S = 0.05  # the launcher checks its ranks this often (and reacts to Ctrl-C as soon)
_GRACE_S = 1.0  # after a failure, how long the other ranks have to stop before they count as hung
_SETTLE_S = 0.2  # how long cancelled ranks have to stop by themselves before RankStopped is raised in them
_STOP_WAIT_S = 2.0  # how long stopped ranks have to leave their threads


_baton = threading.local()  # .release: starts the next rank, at this rank's first wait


def _release_baton() -> None:
    """At a rank's first wait (or poll), start the next rank (see the module docstring)."""
    release = getattr(_baton, "release", None)
    if release is not None:
        _baton.release = None
        release()


@contextlib.contextmanager
def _pass_baton() -> Iterator[None]:
    _release_baton()
    yield


@contextlib.contextmanager
def _lend_the_hold() -> Iterator[None]:
    """A rank inside :func:`holding_turn` that waits in a collective (its model's own parallel layer, run by
    functionalize's check) lets the other ranks in meanwhile: the peer it waits for may be waiting at its own
    functionalize to get there."""
    lend = getattr(_baton, "lend", None)
    if lend is None:
        yield
        return
    with lend():
        yield


on_blocking_wait(_pass_baton)
on_blocking_wait(_lend_the_hold)
on_poll(_release_baton)


def _generator_states() -> tuple[Any, ...]:
    """torch's CPU generator's, Python's ``random``'s and numpy's global one's state (numpy where imported)."""
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), None if numpy is None else numpy.random.get_state()


def _set_generator_states(states: tuple[Any, ...]) -> None:
    cpu, python, numpy_state = states
    torch.set_rng_state(cpu)
    random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def holding_turn() -> contextlib.AbstractContextManager[None]:
    """Around engine code that reads the process's random generators and sets them back (``functionalize``):
    on a thread rank, the time spent inside does not count against the rank's turn, so the next rank does not
    start its own setup (seeding torch, building a model) in the middle of it, and ranks inside take turns (a
    rank waiting in a collective there lets the others in; see the module docstring). Elsewhere it does
    nothing."""
    hold = getattr(_baton, "hold", None)
    return contextlib.nullcontext() if hold is None else hold()


def start_turn(timeout: float, world: int) -> float:
    """The longest a rank waits for the one before it to reach its first collective: a fraction of
    the timeout, so that waiting for the last rank to start never takes the timeout up."""
    return min(5.0, timeout / (4 * max(world, 1)))


class RankStopped(BaseException):
    """Raised in a rank thread by the launcher that gave up on it.

    A BaseException, so that ``except Exception`` in the rank's code does not swallow it.
    """


def run_on_threads(fn: Callable[..., Any], world: int, timeout: float, args: tuple[Any, ...]) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` rank threads; return their results in rank order."""
    ranks = _RankThreads(fn, args, ThreadsWorld(world, timeout))
    try:
        ranks.start()
        ranks.supervise()
    except BaseException as exc:  # Ctrl-C, or SystemExit from a signal handler
        ranks.stop(ranks.running(), f"the launcher was interrupted ({type(exc).__name__})")
        raise
    finally:
        # The world outlives the launch where its collectives' autograd graphs do (a backward run in a later
        # launch's threads): there, a rank is no longer one that returned before its peers.
        ranks.world.launch_ended()
    try:
        return ranks.outcome()
    finally:
        ranks.join_ended()


class _RankThreads:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], world: ThreadsWorld) -> None:
        self.world = world
        self.results: list[Any] = [None] * world.world_size
        self.finished_at: dict[int, float] = {}  # rank -> when it returned
        self.threads: list[threading.Thread] = []
        # Set as a rank's body ends. The launcher waits on these, never on Thread.join:
        # in Python 3.11 a join interrupted by Ctrl-C marks a running thread as stopped.
        self.done = [threading.Event() for _ in range(world.world_size)]
        self.started = [False] * world.world_size
        self.started_at: list[float | None] = [None] * world.world_size
        self.turn = start_turn(world.timeout, world.world_size)
        # Time inside holding_turn() is not spent from a rank's turn, up to this much more.
        self.hold_limit = world.timeout / (4 * max(world.world_size, 1))
        self.held_s = [0.0] * world.world_size  # each rank's time in holding_turn(), its current hold included
        self.holding_since: list[float | None] = [None] * world.world_size
        self.held_by_one = RankLock()  # holding_turn() runs on one rank at a time
        self.has_the_hold = [False] * world.world_size  # whether the rank holds held_by_one now
        self._starting = threading.Lock()
        self._fn, self._args = fn, args

    def _body(self, rank: int) -> None:
        _baton.release = lambda: self._start(rank + 1)
        _baton.hold = lambda: self._holding(rank)
        try:
            with use_backend(ThreadsBackend(self.world, rank)):
                self.results[rank] = run_rank(self._fn, *self._args)
            self.finished_at[rank] = time.monotonic()
            self.world.rank_returned(rank)
        except BaseException as exc:
            self.world.abort(rank, exc)
        finally:
            _baton.release = _baton.hold = _baton.lend = None
            self._start(rank + 1)  # if its first wait did not already
            self.done[rank].set()

    @contextlib.contextmanager
    def _holding(self, rank: int) -> Iterator[None]:
        """``rank``'s time inside, the outermost hold's, is not spent from its turn (see ``hold_limit``)."""
        if self.holding_since[rank] is not None:  # nested: the outer hold counts it
            yield
            return
        self.holding_since[rank] = time.monotonic()
        try:
            self._take_the_hold(rank)
            _baton.lend = lambda: self._lent(rank)
            try:
                yield
            finally:
                _baton.lend = None
                if self.has_the_hold[rank]:  # (not where taking it back after a lending timed out)
                    self.has_the_hold[rank] = False
                    self.held_by_one.release()
        finally:
            began, self.holding_since[rank] = self.holding_since[rank], None
            assert began is not None
            self.held_s[rank] += time.monotonic() - began

    def _take_the_hold(self, rank: int) -> None:
        if self.held_by_one.acquire(self.world.timeout):
            self.has_the_hold[rank] = True
        else:
            raise CollectiveTimeout(
                f"rank {rank} waited {self.world.timeout:g} s for another rank to finish functionalize (thread "
                "ranks run it one at a time: it sets torch's shared generators back around its trace and "
                "check); raise launch(timeout=...) if the model's split is just slow"
            )

    @contextlib.contextmanager
    def _lent(self, rank: int) -> Iterator[None]:
        """``rank``'s hold let go while it waits in a collective (see :func:`_lend_the_hold`), and taken back
        with the process's random generators as it left them: the rank it let in draws from them meanwhile (its
        own check's dropout), and this rank's check goes on drawing the masks its module drew."""
        _baton.lend = None  # (a wait inside this one lends nothing more)
        generators = _generator_states()
        self.has_the_hold[rank] = False
        self.held_by_one.release()
        try:
            yield
        finally:
            self._take_the_hold(rank)
            _set_generator_states(generators)
            _baton.lend = lambda: self._lent(rank)

    def _turn_spent(self, rank: int, now: float) -> float:
        """Seconds of ``rank``'s turn spent by ``now``: since it started, less its time holding the turn."""
        started = self.started_at[rank]
        if started is None:
            return 0.0
        since = self.holding_since[rank]
        held = self.held_s[rank] + (now - since if since is not None else 0.0)
        return now - started - min(held, self.hold_limit)

    def start(self) -> None:
        for rank in range(self.world.world_size):
            # Each rank runs in a copy of the caller's context, so a comm_ledger()
            # opened around launch() sees every rank's collectives.
            ctx = contextvars.copy_context()
            thread = threading.Thread(
                target=ctx.run, args=(self._body, rank), name=f"shardwise-rank-{rank}", daemon=True
            )
            self.threads.append(thread)
        self._start(0)

    def _start(self, rank: int) -> None:
        """Start ``rank``'s thread, once; after a cancel it does not run (nor do the ranks after it)."""
        with self._starting:
            if rank >= len(self.threads) or self.started[rank]:
                return
            self.started[rank] = True
            self.started_at[rank] = time.monotonic()
        if self.world.cancelled is not None or self.world.failure is not None:
            self.done[rank].set()
            self._start(rank + 1)
            return
        self.threads[rank].start()

    def _start_late(self, now: float) -> None:
        """Start the next rank whose turn ran out: the one before it has spent ``turn`` seconds since it
        started (less its time in :func:`holding_turn`) and has not waited yet (a long setup, or a rank that
        never communicates)."""
        pending = next((r for r, s in enumerate(self.started) if not s), None)
        if pending is not None and pending > 0 and self._turn_spent(pending - 1, now) > self.turn:
            self._start(pending)

    def running(self) -> list[int]:
        """Ranks not ended: running, or waiting for their turn to start."""
        return [
            rank for rank, thread in enumerate(self.threads)
            if not self.done[rank].is_set() and (thread.is_alive() or not self.started[rank])
        ]

    def supervise(self) -> None:
        """Wait until every rank ended, or a failure's grace ran out, or the last rendezvous timed out."""
        failed_at: float | None = None
        while running := self.running():
            self.done[running[0]].wait(_POLL_S)
            now = time.monotonic()
            self._start_late(now)
            if self.world.failure is not None and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > _GRACE_S:
                return
            first_done = min(self.finished_at.values(), default=None)
            # Ranks waiting in a collective time out by themselves within ``timeout``;
            # the grace lets that failure, which names the collective, come first.
            if first_done is not None and now - first_done > self.world.timeout + _GRACE_S:
                return

    def outcome(self) -> list[Any]:
        """The results, or the error that says which rank failed or hung (stopping the hung ones)."""
        hung = self.running()
        failure = self.world.failure
        unstoppable = self.stop(hung, f"the launcher gave up on hung ranks {hung}") if hung else []
        note = (
            f"; rank threads {unstoppable} could not be stopped (blocked in a call outside Python code) "
            "and keep running as daemon threads until this process exits"
            if unstoppable
            else ""
        )
        if failure is not None:
            rank, error = failure
            if hung and isinstance(error, CollectiveError):
                # A timeout or abort on a waiting rank is a reaction; the ranks still running are the cause.
                raise RankHung(
                    tuple(hung),
                    f"still running {_GRACE_S:g} s after rank {rank} stopped waiting: "
                    f"{type(error).__name__}: {error}{note}",
                ) from error
            raise RankFailed(rank, f"{type(error).__name__}: {error}{note}") from error
        if hung:
            first = min(self.finished_at, key=self.finished_at.__getitem__)
            raise RankHung(
                tuple(hung),
                f"did not finish within the timeout of {self.world.timeout:g} s after rank {first} returned "
                f"(stuck after its last collective, or outside any){note}",
            )
        return self.results

    def join_ended(self) -> None:
        """Let the threads of the ranks that ended finish (their body set ``done`` last, and the thread still runs
        its exit, freeing what the rank held): a process that exits right after the launch, its daemon threads
        frozen halfway through torch's teardown, otherwise ended in SIGABRT ("terminate called without an active
        exception") about every other run after a rank failed."""
        for rank, thread in enumerate(self.threads):
            if self.done[rank].is_set() and thread.is_alive():
                thread.join(_POLL_S)

    def stop(self, ranks: list[int], reason: str) -> list[int]:
        """Stop the threads of ``ranks``; return those still running after a wait.

        First the world is cancelled: a rank in (or entering) a collective stops
        by itself, between two of the world's own steps. Only the ranks still
        running after a moment get RankStopped raised in their thread: an
        exception raised at an arbitrary bytecode could land inside the world's
        locking, which the cancel never risks.
        """
        self.world.cancel(reason)
        for rank in ranks:  # those that never started never will
            self._start(rank)
        self._join(ranks, _SETTLE_S)
        for rank in self.running():
            ident = self.threads[rank].ident
            if ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(RankStopped))
        self._join(ranks, _STOP_WAIT_S)
        return [rank for rank in ranks if not self.done[rank].is_set()]

    def _join(self, ranks: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for rank in ranks:
            self.done[rank].wait(max(0.0, deadline - time.monotonic()))
