"""How the processes backend starts its rank processes: forked from a server that imported torch once.

A spawned rank imports torch (and shardwise) again: about two seconds of CPU each, so four ranks
on two cores took four seconds to start, and every pool restarted after a failure paid it again.
Python's ``forkserver`` start method forks each rank from a server process that imported them
once (``set_forkserver_preload``): a rank then starts in tenths of a second. The server is started
on first use, by this process, and ends once this process and the ranks forked from it have (it
waits on a pipe whose write ends only they hold; a process this one forks closes its copy). It is
a fresh interpreter that never runs torch code, so no thread or CUDA state is forked: the server
has imported torch, torch's fake-tensor machinery and shardwise, and nothing more. (Every rank's
first step predicts on fake tensors, whose mode imports ``torch._dynamo``: about a second of CPU in
each rank when the server had not; importing it starts no thread.)

A forked rank inherits what the server had when it started, not what this process has now: its
environment, where its standard streams go, its umask, CPU affinity, resource limits, priority
and ignored signals. A variable set since (glibc's ``MALLOC_*`` thresholds that a benchmark sets
for its ranks), or stderr redirected to a log since (pytest's ``capfd``), would be silently
missing in a forked rank. So every launch compares those (:func:`inherited`) with the server's,
and a launch where any differs is spawned, as before; so is every launch where the server is not
ours (another library started Python's one forkserver first, in a state we do not know), in a
process forked from this one (the server is its parent's), or where the platform has no
forkserver. ``SHARDWISE_START_METHOD=spawn`` spawns every rank (``forkserver``, the default, is
what is described here). The working directory, ``sys.path`` and the main module reach a forked
rank as they reach a spawned one (multiprocessing prepares each rank with them). What the server
imported before does not: it starts with ``python -c``, so the working directory comes first on its
``sys.path``, and Python 3.11 ignores the ``sys_path`` it is handed when it preloads. A
checkout of shardwise in the working directory, run with another one on ``PYTHONPATH`` (a benchmark
of the code before a change, run from the checkout of the change), would run in every forked rank
while this process runs the other: where the working directory holds a preloaded package other
than the one this process imported (:func:`shadowed`), the server is not started and ranks are
spawned.

A server of ours that dies (the OOM killer) takes its ranks' exit status with it, not the ranks:
they run on, watched and signalled through a pidfd each (processes.py); one that exits since is
reported with how the server ended. The next launch starts another server.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from typing import Any, cast

ENV_VAR = "SHARDWISE_START_METHOD"
METHODS = ("forkserver", "spawn")
# torch._dynamo: what FakeTensorMode imports at its first use, which is every rank's first step (its
# Plan's predictions). A name torch renames is skipped by the server (an ImportError is ignored there),
# and tests/collectives/test_start_method.py fails.
PRELOAD = ["torch", "torch._dynamo", "shardwise.collectives.backends.process_worker"]

_lock = threading.Lock()
_ours: tuple[int, tuple[Any, ...]] | None = None  # the server this process started: its pid and inherited()


def rank_context() -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """The multiprocessing context a launch starts its ranks with (see the module docstring)."""
    method = os.environ.get(ENV_VAR, "forkserver")
    if method not in METHODS:
        raise ValueError(
            f"{ENV_VAR}={method!r}: the rank processes start by one of {METHODS}; unset it for the default"
        )
    if method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return _spawn()
    global _ours
    with _lock:
        try:
            running = forkserver_pid()
        except _Unreadable:  # a Python release that renamed it (the test of forkserver_pid fails in CI)
            return _spawn()
        now = inherited()
        if _ours is not None and running == _ours[0] and server_exit(running) is not None:
            # Ours died (the OOM killer, a stray kill): Python's ensure_running below reaps it and
            # starts another, now, from this process: ours again.
            _ours = running = None
        if _ours is None:
            if running is not None:  # another library's server (or our parent's): its state is unknown here
                return _spawn()
            if shadowed():  # the server would import another shardwise (or torch) than this process runs
                return _spawn()
            multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
            multiprocessing.forkserver.ensure_running()  # the server inherits `now` as it starts
            pid = forkserver_pid()
            if pid is None:
                return _spawn()
            _ours = (pid, now)
        pid, state = _ours
        if running not in (None, pid) or now != state:
            return _spawn()
    return cast(multiprocessing.context.ForkServerContext, multiprocessing.get_context("forkserver"))


def server_exit(pid: int) -> int | None:
    """How the fork server of this pid, a child of this process, ended, as ``Popen.returncode``
    reads (``-9``: SIGKILL); None while it runs, or where this platform cannot tell without reaping
    it. It is not reaped here (``WNOWAIT``): Python's ``ensure_running`` reaps it before it starts
    another."""
    if not hasattr(os, "waitid"):
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by someone else: Python's ensure_running would fail the same way
        return None
    if info is None:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def shadowed() -> list[str]:
    """The preloaded packages (``PRELOAD``'s top-level names) that the working directory holds in
    another place than this process imported them from: a fork server started now would import
    those (see the module docstring)."""
    cwd = os.getcwd()
    found = []
    for name in sorted({module.split(".")[0] for module in PRELOAD}):
        spec = importlib.machinery.PathFinder.find_spec(name, [cwd])
        if spec is None or spec.origin is None:  # none, or a folder without __init__: a package later on the path wins
            continue
        loaded = getattr(sys.modules.get(name), "__spec__", None)
        if loaded is None or _real(spec.origin) != _real(loaded.origin):
            found.append(name)
    return found


def _real(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(path)


def _spawn() -> multiprocessing.context.SpawnContext:
    return cast(multiprocessing.context.SpawnContext, multiprocessing.get_context("spawn"))


# Variables a test runner rewrites in the launcher around every test, which no rank reads at its start:
# compared, they would have every pool after a suite's first test spawned (each rank importing torch
# again). A forked rank keeps the server's value of them.
RUNNER_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


def inherited() -> tuple[Any, ...]:
    """What a process passes to a process it starts, and a forked rank would take from the server
    instead: the environment (but ``RUNNER_VARIABLES``), the identity of file descriptors 0-2, the
    umask, CPU affinity, resource limits, scheduling priority and the signals ignored (handlers do
    not survive exec)."""
    env = {k: v for k, v in os.environ.items() if k not in RUNNER_VARIABLES}
    return (env, tuple(map(_file, (0, 1, 2))), _umask(), _optional(os.sched_getaffinity, 0),
            _limits(), _optional(os.getpriority, os.PRIO_PROCESS, 0) if hasattr(os, "PRIO_PROCESS") else None,
            frozenset(s for s in signal.valid_signals() if _ignored(s)))


def _file(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _umask() -> str | None:
    """Read where Linux shows it: setting and restoring it would race with other threads."""
    try:
        with open("/proc/self/status") as f:
            return next((line.split()[1] for line in f if line.startswith("Umask:")), None)
    except OSError:
        return None


def _limits() -> tuple[Any, ...] | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    return tuple(_optional(resource.getrlimit, getattr(resource, name)) for name in sorted(dir(resource))
                 if name.startswith("RLIMIT_"))


def _ignored(sig: int) -> bool:
    try:
        return signal.getsignal(sig) is signal.SIG_IGN
    except (OSError, ValueError):
        return False


def _optional(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None where this platform lacks it or refuses the argument."""
    try:
        return fn(*args)
    except (AttributeError, OSError, ValueError):
        return None


def _forget_in_child() -> None:
    """In a process forked from this one (an ``os.fork``, multiprocessing's fork context, a
    DataLoader's workers), the server is its parent's: Python's forkserver state is reset there, so
    that a launch in it starts a server of its own, and the child closes its copy of the pipe that
    keeps the server alive: the server ends with this process, not with the last child it forked."""
    global _ours
    if _ours is None:
        return
    _ours = None
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    for name in ("_forkserver_alive_fd", "_forkserver_pid", "_forkserver_address", "_forkserver_authkey"):
        if hasattr(server, name):
            setattr(server, name, None)
    if isinstance(alive, int):
        with contextlib.suppress(OSError):
            os.close(alive)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def forkserver_pid() -> int | None:
    """The pid of Python's forkserver process, None before it started.

    Python has no public way to ask; ``ForkServer._forkserver_pid`` is read here, and it and its
    siblings are reset in a forked child (``_forget_in_child``), nowhere else
    (tests/collectives/test_start_method.py fails loudly if a Python release renames them; a
    launch on such a Python spawns its ranks)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        raise _Unreadable("multiprocessing.forkserver._forkserver._forkserver_pid is gone in this Python")
    pid = server._forkserver_pid
    return pid if isinstance(pid, int) else None


class _Unreadable(RuntimeError):
    """This Python keeps its forkserver's state elsewhere: ranks are spawned (slower, never wrong)."""
