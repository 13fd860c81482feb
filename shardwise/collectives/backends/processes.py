"""Ranks as local processes on torch.distributed with gloo.

:func:`launch_processes` runs one SPMD function on ``world`` new processes;
:class:`ProcessPool` keeps the processes (and their process groups) alive
between runs. The ranks are forked from a server that imported torch once, or
spawned where that would change what they see (``start_method``): a spawned
rank costs about two seconds of torch import, a forked one tenths of a
second. Both share the same machinery and the same failure semantics:

* A rank that raises, or a process that exits without reporting, fails the run.
  The parent raises :class:`~shardwise.collectives.launch.RankFailed` for the
  root cause: the first failure that is not merely a reaction to another one
  (a :class:`CollectiveError` such as a timeout after a peer died), with the
  remote traceback in the message.
* Once a rank has failed, the others get a short grace period to report, then
  are terminated and, if need be, killed. Every process started is joined
  (reaped) before the parent returns or raises, also on KeyboardInterrupt.
* A worker reports its result before it exits and then leaves with
  ``os._exit``: torch 2.13's gloo sometimes aborts (SIGABRT) while tearing a
  process group down at interpreter exit, and that must not turn a delivered
  result into a failure.

Messages travel as plain-``pickle`` bytes over one duplex pipe per rank (not
torch's shared-memory pickler), so a result needs no live sender to be read.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # before our atexit hook is registered, see _close_all
import os
import pickle
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ..errors import RankFailed, RankHung
from ..timeout import DEFAULT_TIMEOUT_S, check_timeout
from . import start_method
from .pickle_path import unpicklable
from .process_worker import MIN_STARTUP_S, worker_main
from .start_method import rank_context

_GRACE_S = 1.0  # after a failure, how long the other ranks may still report before being terminated
_STOP_WAIT_S = 5.0  # how long idle workers get to exit after "stop"
_SIGNAL_WAIT_S = 2.0  # how long to wait after SIGTERM (then SIGKILL) before giving up
_TRACEBACK_MARK = "\n\n--- traceback of rank "  # where a failure's summary ends in its message
_POLL_S = 0.2  # longest the parent sleeps between checks for KeyboardInterrupt
# What multiprocessing reads as a forked rank's exit code once its fork server is gone (popen_forkserver).
_SERVER_GONE = 255
_STARTED = {"forkserver": "forked", "spawn": "spawned"}
_KILLED_BY = " (the OOM killer's signal, or a kill)"


def default_max_processes() -> int:
    """The largest world started without being asked: 4 ranks per CPU, at least 8.

    Every rank is an interpreter holding torch (a few hundred MB each once it
    runs, and about 2 s of CPU to start where it is spawned): past a few per
    core, they can exhaust memory and the cores, which is rarely what
    ``world=1000`` meant.
    """
    return max(8, 4 * (os.cpu_count() or 1))


def launch_processes(
    fn: Callable[..., Any],
    world: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    args: Sequence[Any] = (),
    max_processes: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` new gloo processes; return each rank's result in rank order.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function). Raises
    :class:`RankFailed` for the rank that failed first; every process has ended
    by the time this returns or raises.
    """
    with ProcessPool(world, timeout=timeout, max_processes=max_processes) as pool:
        return pool.run(fn, *args)


class ProcessPool:
    """Long-lived gloo ranks for running many SPMD functions.

    >>> with ProcessPool(2, timeout=60.0) as pool:      # doctest: +SKIP
    ...     pool.run(main)                               # main is a module-level function
    ...     pool.run(main, 3)                            # same processes, same process groups

    Processes start on the first :meth:`run`. A failed run tears them down (a
    failed collective can leave a process group unusable), and the next run
    starts fresh ones. :meth:`close` ends them; so do garbage collection and
    interpreter exit, so a forgotten pool leaks no processes.
    """

    def __init__(self, world: int, timeout: float = DEFAULT_TIMEOUT_S, max_processes: int | None = None) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world <= 0:
            raise ValueError(f"ProcessPool(world={world!r}): world must be a positive int")
        self.timeout = check_timeout("ProcessPool", timeout)
        bound = default_max_processes() if max_processes is None else max_processes
        if world > bound:
            raise ValueError(
                f"world={world} would start {world} processes on a machine with {os.cpu_count()} CPUs, "
                f"above the bound of {bound} "
                + ("(4 per CPU, at least 8). " if max_processes is None else "given as max_processes. ")
                + "Each rank holds torch (a few hundred MB; about 2 s to start where spawned). Use fewer ranks, "
                f"backend='threads' (no processes), or pass max_processes={world} if you mean it."
            )
        self.world = world
        self._slot = _Slot()
        self._lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, self._slot.clear)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(*args)`` on every rank and return the results in rank order."""
        task = _pickle_task(fn, args)  # fails here, before any process is spawned
        with self._lock:
            if self._closed:
                raise RuntimeError("ProcessPool.run: the pool is closed; create a new ProcessPool")
            if self._slot.ranks is None:
                self._slot.ranks = _Ranks.start(self.world, self.timeout)
            try:
                return self._slot.ranks.run(task)
            except BaseException:
                # A failed run or Ctrl-C: ranks may be busy, so do not wait for them to stop.
                self._slot.clear(wait=0.0)
                raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the running ranks, in rank order (empty when none run)."""
        ranks = self._slot.ranks
        return [] if ranks is None else [p.pid for p in ranks.procs if p.pid is not None]

    @property
    def start_method(self) -> str | None:
        """How the running ranks were started: ``"forkserver"`` (forked from the fork server) or
        ``"spawn"`` (see ``start_method.py`` for when each is used); None when none run."""
        ranks = self._slot.ranks
        return None if ranks is None else ranks.start_method

    def close(self) -> None:
        """End every process of the pool (idempotent)."""
        with self._lock:
            self._closed = True
            self._slot.clear()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ranks = self._slot.ranks
        state = "closed" if self._closed else (f"running, {_STARTED[ranks.start_method]}" if ranks else "idle")
        return f"ProcessPool(world={self.world}, timeout={self.timeout:g}, {state})"


class _Slot:
    """Holds a pool's current processes; the finalizer refers to it, not to the pool."""

    def __init__(self) -> None:
        self.ranks: _Ranks | None = None

    def clear(self, wait: float = _STOP_WAIT_S) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.shutdown(wait)


# -- the parent's side --------------------------------------------------------------
@dataclass
class _Failure:
    rank: int
    message: str
    error: BaseException | None = None
    reaction: bool = False  # a consequence of another rank's failure, not a root cause
    addr_in_use: bool = False


_running: set[_Ranks] = set()


class _Ranks:
    """One generation of worker processes, all initialised in one process group."""

    def __init__(self, world: int, timeout: float) -> None:
        self.world = world
        self.timeout = timeout
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._alive: list[Connection] = []  # closed when this process ends (or shuts the ranks down)
        self._eof: set[int] = set()  # ranks whose pipe is closed: wait on their exit only
        self.ready = False  # every rank has joined the process group
        self._shut_down = False
        _running.add(self)
        ctx = rank_context()
        self.start_method = ctx.get_start_method()
        self._server: int | None = None  # the fork server the ranks were forked from, if they were
        # Once that server is gone, so are the ranks' exit status and the sentinels that tell it
        # (always ready, every exit code 255): its ranks live on, watched and signalled through a
        # pidfd each (Linux; elsewhere through their pipes, and they end when this process does).
        self._server_gone = False
        self._pidfds: list[int | None] = []
        port = _free_port()
        try:
            for rank in range(world):
                parent_end, child_end = ctx.Pipe(duplex=True)
                # Nothing is sent on it: the rank reads EOF once this process is gone (process_worker).
                alive_read, alive_write = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, world, port, timeout, os.getpid(), alive_read, child_end),
                    name=f"shardwise-rank-{rank}",
                    daemon=False,  # daemonic processes may not start their own (DataLoader workers)
                )
                self.procs.append(proc)
                self.conns.append(parent_end)
                self._alive.append(alive_write)
                proc.start()
                self._pidfds.append(_pidfd(proc.pid) if self.start_method == "forkserver" else None)
                if self.start_method == "forkserver" and self._server is None:
                    self._server = start_method.forkserver_pid()
                child_end.close()  # so the parent reads EOF as soon as the child is gone
                alive_read.close()  # the rank's copy is the only reader
        except BaseException:
            self.shutdown(wait=0.0)
            raise

    @classmethod
    def start(cls, world: int, timeout: float) -> _Ranks:
        """Start the ranks and wait until each has joined the process group."""
        for attempt in range(2):
            ranks = cls(world, timeout)
            try:
                results, failures = ranks._collect(deadline=time.monotonic() + max(timeout, MIN_STARTUP_S) + 30.0)
            except BaseException:
                ranks.shutdown(wait=0.0)
                raise
            if not failures and len(results) == world:
                ranks.ready = True
                return ranks
            ranks.shutdown(wait=0.0)
            # Another program may take the free port between our probe and rank 0's bind: retry once.
            if attempt == 0 and any(f.addr_in_use for f in failures):
                continue
            if not failures:
                missing = sorted(set(range(world)) - set(results))
                failures = [_Failure(missing[0], f"ranks {missing} did not join the process group in time")]
            raise _root_cause(failures)
        raise AssertionError("unreachable")

    def run(self, task: bytes) -> list[Any]:
        message = pickle.dumps(("run", task))
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a dead worker: _collect reports its exit code
                conn.send_bytes(message)
        results, failures = self._collect(deadline=None, last_rendezvous=self.timeout)
        if failures or len(results) < self.world:
            self.shutdown(wait=0.0)
            raise _run_error(results, failures, self.world, self.timeout)
        return [results[rank] for rank in range(self.world)]

    def _collect(
        self, deadline: float | None, last_rendezvous: float | None = None
    ) -> tuple[dict[int, Any], list[_Failure]]:
        """Wait for one report per rank; after the first failure, wait at most the grace period.

        With ``last_rendezvous`` (the timeout), the end of the task is a last
        rendezvous: once a rank reported its result, the others have that long
        (and the grace, so that a rank timing out in a collective reports
        first) to report theirs.
        """
        pending = set(range(self.world))
        results: dict[int, Any] = {}
        failures: list[_Failure] = []
        grace_until: float | None = None
        finish_until: float | None = None
        while pending:
            now = time.monotonic()
            limit = min((t for t in (deadline, grace_until, finish_until) if t is not None), default=None)
            if limit is not None and now >= limit:
                break
            handles: list[Any] = [self.conns[r] for r in pending if r not in self._eof]
            if not self._server_gone:
                handles += [self.procs[r].sentinel for r in pending]
            else:
                handles += [fd for r in pending if (fd := self._pidfds[r]) is not None]
            # Bounded waits: a Ctrl-C delivered to another thread is only handled
            # when the main thread gets back to Python code.
            wait_s = _POLL_S if limit is None else min(_POLL_S, limit - now)
            multiprocessing.connection.wait(handles, timeout=wait_s)
            for rank in sorted(pending):
                report = self._poll(rank)
                if report is None:
                    continue
                pending.discard(rank)
                if isinstance(report, _Failure):
                    failures.append(report)
                    if grace_until is None:
                        grace_until = time.monotonic() + _GRACE_S
                else:
                    results[rank] = report[0]
                    if last_rendezvous is not None and finish_until is None:
                        finish_until = time.monotonic() + last_rendezvous + _GRACE_S
        return results, failures

    def _poll(self, rank: int) -> _Failure | tuple[Any] | None:
        """This rank's report if one arrived (or its exit without one), else None."""
        conn, proc = self.conns[rank], self.procs[rank]
        if rank not in self._eof:
            try:
                if conn.poll():
                    return _decode(rank, pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError):
                self._eof.add(rank)  # closed, or died mid-message: its exit code tells the rest
        if not self._server_gone:
            if proc.exitcode is None:
                return None
            if proc.exitcode != _SERVER_GONE or self._server is None or not self._still_running(rank):
                return self._exited(rank, f"exited {_describe_exit(proc.exitcode)}")
            self._server_gone = True  # read 255, yet running: the server holding its status is gone
        if self._still_running(rank):
            return None  # its server's death changes nothing it computes
        return self._exited(rank, f"exited (its exit status is unknown: {self._server_ended()})", main_hint=False)

    def _still_running(self, rank: int) -> bool:
        """Whether the rank runs, as its pidfd tells (its pipe, where there is none: a process the
        rank started may hold it open longer)."""
        fd = self._pidfds[rank] if rank < len(self._pidfds) else None
        if fd is None:
            return rank not in self._eof
        return not multiprocessing.connection.wait([fd], timeout=0)

    def _server_ended(self) -> str:
        status = start_method.server_exit(self._server) if self._server is not None else None
        if status is None:  # reaped already (a launch since started another), or no waitid here
            return f"the fork server it was forked from, pid {self._server}, is gone, and the status with it"
        killed = _KILLED_BY if status == -signal.SIGKILL else ""
        return (f"the fork server it was forked from, pid {self._server}, exited {_describe_exit(status)}{killed} "
                "before it, and took the status with it")

    def _exited(self, rank: int, how: str, main_hint: bool = True) -> _Failure:
        message = f"the process {how} without reporting a result"
        if not self.ready and main_hint:
            message += (
                " before joining the process group (its stderr above says why). Every rank re-imports "
                "the main script (spawned, or forked from the fork server): guard its entry point with "
                "`if __name__ == '__main__':`"
            )
        return _Failure(rank, message)

    def shutdown(self, wait: float) -> None:
        """End every process: ask, wait up to ``wait`` s, then SIGTERM, then SIGKILL; always reap.

        Safe to call again: if it is interrupted (a second Ctrl-C), the atexit
        hook finishes the job.
        """
        if self._shut_down:
            return
        try:
            stop = pickle.dumps(("stop", None))
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
            self._join(wait)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for rank in self._running_ranks():
                    self._signal(rank, sig)
                self._join(_SIGNAL_WAIT_S)
        finally:
            if not self._running_ranks():
                for conn in self.conns + self._alive:
                    conn.close()
                for proc in self.procs:
                    proc.close()
                for fd in self._pidfds:
                    if fd is not None:
                        os.close(fd)
                _running.discard(self)
                self._shut_down = True

    def _running_ranks(self) -> list[int]:
        """The ranks started and not yet ended (reaped, where this process can reap them); after
        their server's death, the ones their pidfd says run (without one, none: they end when this
        process does, or when it closes their pipes)."""
        running = []
        for r, proc in enumerate(self.procs):
            fd = self._pidfds[r] if r < len(self._pidfds) else None
            if not self._server_gone:
                if _running_process(proc):
                    running.append(r)
                    continue
                if proc.pid is None or proc.exitcode != _SERVER_GONE or fd is None or not self._still_running(r):
                    continue
                self._server_gone = True  # read 255, yet running
            if fd is not None and self._still_running(r):
                running.append(r)
        return running

    def _join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (running := self._running_ranks()) and (left := deadline - time.monotonic()) > 0:
            handles = [self.procs[r].sentinel if not self._server_gone else self._pidfds[r] for r in running]
            multiprocessing.connection.wait([h for h in handles if h is not None], timeout=min(left, _POLL_S))

    def _signal(self, rank: int, sig: int) -> None:
        proc, fd = self.procs[rank], self._pidfds[rank] if rank < len(self._pidfds) else None
        if not self._server_gone:
            if sig == signal.SIGTERM:
                proc.terminate()
            else:
                proc.kill()
        elif fd is not None:  # not our child, and its pid may be taken again once it is reaped: the pidfd's
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, sig)


def _decode(rank: int, message: tuple[str, Any]) -> _Failure | tuple[Any]:
    kind, payload = message
    if kind == "ready":
        return (None,)
    if kind == "ok":
        try:
            return (pickle.loads(payload),)
        except Exception as exc:
            return _Failure(rank, f"its result could not be unpickled in the parent: {type(exc).__name__}: {exc}")
    error = None
    if payload["pickled"] is not None:
        try:
            error = pickle.loads(payload["pickled"])
        except Exception:
            error = None  # the text below still carries everything
    message_text = f"{payload['type']}: {payload['message']}{_TRACEBACK_MARK}{rank} ---\n{payload['traceback']}"
    return _Failure(rank, message_text, error, payload["reaction"], payload["addr_in_use"])


def _root_cause(failures: list[_Failure]) -> RankFailed:
    root = next((f for f in failures if not f.reaction), failures[0])
    error = RankFailed(root.rank, root.message)
    error.__cause__ = root.error
    return error


def _run_error(results: dict[int, Any], failures: list[_Failure], world: int, timeout: float) -> RankFailed:
    """The error of a run that did not deliver every result: the rank that failed, or the ones that hung."""
    if any(not f.reaction for f in failures):
        return _root_cause(failures)
    silent = sorted(set(range(world)) - set(results) - {f.rank for f in failures})
    returned = sorted(results)
    if not silent:  # only reactions (timeouts, mismatches) from ranks that all reported
        first = failures[0]
        summary, traceback_text = _split_traceback(first.message)
        if returned:
            summary += (
                f" (ranks {returned} had returned their results already: they skipped a collective the "
                "others waited in, or returned early)"
            )
        return _root_cause([_Failure(first.rank, summary + traceback_text, first.error, first.reaction)])
    if failures:  # the others timed out waiting for the silent ranks: those are the cause
        first = failures[0]
        summary, _ = _split_traceback(first.message)
        hung = RankHung(
            tuple(silent), f"still running {_GRACE_S:g} s after rank {first.rank} stopped waiting: {summary}"
        )
        hung.__cause__ = first.error
        return hung
    return RankHung(
        tuple(silent),
        f"did not finish within the timeout of {timeout:g} s after rank {returned[0]} returned "
        "(stuck after its last collective, or outside any)",
    )


def _split_traceback(message: str) -> tuple[str, str]:
    """A failure's message as (summary, the remote traceback that follows it, or "")."""
    head, sep, tail = message.partition(_TRACEBACK_MARK)
    return head, sep + tail


def _running_process(proc: BaseProcess) -> bool:
    """Started and not yet reaped (``exitcode`` reaps a finished child)."""
    return proc.pid is not None and proc.exitcode is None


def _pidfd(pid: int | None) -> int | None:
    """A file descriptor of process ``pid`` (Linux 5.3+): readable once it ended, whoever reaps it;
    signals sent through it never reach another process that took the pid. None where there is none."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # an older kernel, or it has ended already (its exit code tells then)
        return None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"on signal {signal.Signals(-code).name}"
        except ValueError:
            return f"on signal {-code}"
    return f"with code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _pickle_task(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Pickle ``(fn, args)`` or explain why they cannot travel to the rank processes."""
    if not callable(fn):
        raise TypeError(f"expected a function to run on every rank, got {type(fn).__name__} {fn!r}")
    # A partial's repr prints its arguments, tensors and all: name the function it calls.
    name = _name_of(fn)
    how = (
        "Rank processes import fn anew, so it travels by reference: define it at the top level of an "
        "importable module (not a lambda, nested function or interactive session), or use the "
        "threads backend (shardwise.launch(fn, world, backend='threads'))."
    )
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise TypeError(f"{name} is defined in an interactive session, which rank processes cannot import. {how}")
    try:
        pickled_fn = pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(_not_picklable(fn, name, exc, how)) from exc
    try:
        return pickle.dumps((pickle.loads(pickled_fn), args))
    except Exception as exc:
        found = unpicklable(args, "args")
        where = "" if found is None else f": {found[0]} is a {_type_name(found[1])}"
        raise TypeError(
            f"the arguments for {name} cannot be pickled{where} ({type(exc).__name__}: {exc}); "
            "pass plain data, tensors or module-level objects"
        ) from exc


def _name_of(fn: Callable[..., Any]) -> str:
    """``fn``'s name; for a partial, its function's (a partial's repr prints every argument)."""
    named = getattr(fn, "func", fn)
    return str(getattr(named, "__qualname__", None) or type(fn).__name__)


def _not_picklable(fn: Callable[..., Any], name: str, exc: Exception, how: str) -> str:
    """Which part of ``fn`` does not pickle, without printing it (a repr shows every tensor)."""
    found = unpicklable(fn, "fn")
    if found is None or found[0] in ("fn", "fn.func"):
        return f"{name} cannot be pickled ({type(exc).__name__}: {exc}). {how}"
    path, obj, err = found
    fix = "define it at the top level of an importable module" if callable(obj) else "drop it"
    return (
        f"{name} cannot be pickled: {path} is a {_type_name(obj)} ({type(err).__name__}: {err}).\n"
        f"Ranks are processes of their own, so every object they use travels pickled: {fix} (or make "
        "it picklable), or use the threads backend (backend='threads')."
    )


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}".removeprefix("builtins.")


def _close_alive_in_child() -> None:
    """A process forked from this one (``os.fork``, multiprocessing's fork context, a DataLoader's
    workers) must not hold the ranks' launcher-alive pipes: a rank reads EOF only once every copy is
    closed, so it would outlive this process for as long as that child lives."""
    for ranks in _running:
        for conn in ranks._alive:
            with contextlib.suppress(OSError):
                conn.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_alive_in_child)


# Registered after multiprocessing.util's own hook, so it runs first (atexit is
# LIFO): that hook joins non-daemonic children, which would wait forever for
# workers still expecting their next task.
@atexit.register
def _close_all() -> None:
    for ranks in list(_running):
        ranks.shutdown(wait=_STOP_WAIT_S)


