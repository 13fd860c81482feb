"""The rank's side of the processes backend: one rank's process.

It joins the gloo process group, then runs the tasks the parent sends over its
pipe until told to stop, reporting each result or error back. It never
outlives its parent (see :func:`_watch_parent`).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..rank_end import run_rank
from .current import use_backend
from .distributed import TorchDistributedBackend

MIN_STARTUP_S = 60.0  # rendezvous bound: processes start seconds apart on a loaded machine


def worker_main(rank: int, world: int, port: int, timeout: float, launcher_pid: int, launcher_alive: Connection,
                conn: Connection) -> None:
    """Entry point of a rank process: join the group, then run tasks until told to stop."""
    # The parent owns Ctrl-C: it ends the workers itself, without a traceback per rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(launcher_pid, launcher_alive)
    try:
        backend = _init_rank(rank, world, port, timeout)
    except BaseException as exc:
        _send(conn, ("error", _describe_error(exc)))
        _exit(1)
    _send(conn, ("ready", None))
    while True:
        try:
            kind, task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        if kind != "run":
            break
        _send(conn, _run_task(task, backend))
    # No destroy_process_group(): gloo may abort while tearing down, and the
    # parent already has every result. os._exit skips all teardown.
    _exit(0)


def _watch_parent(launcher_pid: int, launcher_alive: Connection) -> None:
    """End this process as soon as its launcher is gone (SIGKILL, SIGTERM, a crash).

    An idle worker sees its task pipe close; a busy one (in a task, or stuck in
    one) does not, so a daemon thread waits for either of two signs:

    * ``launcher_alive``, a pipe on which nothing is ever sent and whose write
      end the launcher alone holds (a process it forks closes its copy:
      ``processes._close_alive_in_child``): it reads EOF once the launcher died;
    * where Linux has it, a pidfd of the launcher, readable once it exited,
      whoever else holds what.

    Both work for a launcher dead but not yet reaped (a zombie still answers to
    its pid) and for a rank forked from the fork server (``start_method``),
    whose parent is the server, not the launcher. Not Linux's
    PR_SET_PDEATHSIG, which fires when the parent *thread* that spawned us
    exits (a pool created on a short-lived thread would lose its ranks).
    """
    signs: list[Any] = [launcher_alive]
    try:
        signs.append(os.pidfd_open(launcher_pid))
    except ProcessLookupError:
        _exit(1)  # gone already
    except (AttributeError, OSError):
        pass  # no pidfd here (an older kernel, another OS): the pipe alone

    def watch() -> None:
        with contextlib.suppress(OSError):
            multiprocessing.connection.wait(signs)
        _exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watchdog", daemon=True).start()


def _init_rank(rank: int, world: int, port: int, timeout: float) -> Any:
    if "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun: share the cores between ranks instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(timeout, MIN_STARTUP_S)),
    )
    return TorchDistributedBackend.from_initialized(timeout)


def _run_task(task: bytes, backend: Any) -> tuple[str, Any]:
    try:
        fn, args = pickle.loads(task)
        with use_backend(backend):
            result = run_rank(fn, *args)
    except BaseException as exc:  # SystemExit too: the rank did not return
        return ("error", _describe_error(exc))
    try:
        return ("ok", pickle.dumps(result))
    except Exception as exc:
        wrapped = TypeError(f"the result ({type(result).__name__}) cannot be pickled: {exc}")
        return ("error", _describe_error(wrapped))


def _describe_error(exc: BaseException) -> dict[str, Any]:
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # exceptions with a custom __init__ pickle but fail to unpickle
    except Exception:
        pickled = None
    text = str(exc)
    return {
        "type": type(exc).__qualname__,
        "message": text,
        "traceback": "".join(traceback.format_exception(exc)),
        "pickled": pickled,
        "reaction": isinstance(exc, CollectiveError),
        "addr_in_use": "EADDRINUSE" in text or "address already in use" in text.lower(),
    }


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    try:
        conn.send_bytes(pickle.dumps(message))
    except OSError:
        _exit(1)  # the parent is gone: nobody is left to tell


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
