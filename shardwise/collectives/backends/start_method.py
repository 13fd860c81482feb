"""How the processes backend starts its rank processes: forked from a server that imported torch once.

A spawned rank imports torch (and shardwise) again: about two seconds of CPU each, so four ranks
on two cores took four seconds to start, and every pool restarted after a failure paid it again.
Python's ``forkserver`` start method forks each rank from a server process that imported them
once (``set_forkserver_preload``): a rank then starts in tenths of a second. The server is started
on first use, by this process, and ends when this process does (it reads the end of a pipe only
this process holds). It never runs torch code, so no thread or CUDA state is forked: the server has
imported torch and nothing more.

A forked rank sees the environment the server had when it started, not this process's environment
now (a variable set since, such as glibc's ``MALLOC_*`` thresholds that a benchmark sets for its
ranks, would be silently missing). So a launch whose environment differs from the server's is
spawned, as before, and so is every launch where the server is not ours (another library started
Python's one forkserver first, with an environment we do not know) or where the platform has no
forkserver. ``SHARDWISE_START_METHOD=spawn`` spawns every rank (``forkserver``, the default, is
what is described here).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import threading
from typing import cast

ENV_VAR = "SHARDWISE_START_METHOD"
METHODS = ("forkserver", "spawn")
PRELOAD = ["torch", "shardwise.collectives.backends.process_worker"]

_lock = threading.Lock()
_ours: tuple[int, dict[str, str]] | None = None  # the server this module started: its pid and environment


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
        running = forkserver_pid()
        if _ours is None:
            if running is not None:  # another library's server: its environment is unknown here
                return _spawn()
            multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
            multiprocessing.forkserver.ensure_running()
            pid = forkserver_pid()
            if pid is None:
                return _spawn()
            _ours = (pid, dict(os.environ))
        pid, environment = _ours
        if running not in (None, pid) or os.environ != environment:
            return _spawn()
    return cast(multiprocessing.context.ForkServerContext, multiprocessing.get_context("forkserver"))


def _spawn() -> multiprocessing.context.SpawnContext:
    return cast(multiprocessing.context.SpawnContext, multiprocessing.get_context("spawn"))


def forkserver_pid() -> int | None:
    """The pid of Python's forkserver process, None before it started.

    Python has no public way to ask; ``ForkServer._forkserver_pid`` is read here and nowhere else
    (tests/collectives/test_start_method.py fails loudly if a Python release renames it)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        raise RuntimeError("multiprocessing.forkserver._forkserver._forkserver_pid is gone in this Python: "
                           f"set {ENV_VAR}=spawn and report it")
    pid = server._forkserver_pid
    return pid if isinstance(pid, int) else None
