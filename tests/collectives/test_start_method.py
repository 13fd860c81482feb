"""How rank processes start (shardwise/collectives/backends/start_method.py): forked from a server
that imported torch once, unless that would hand the ranks another environment than the launcher's."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.collectives.backends import start_method

REPO = Path(__file__).resolve().parents[2]


def test_python_still_keeps_the_fork_servers_pid_where_it_is_read() -> None:
    """The one private name read (Python has no public way to ask whether its forkserver runs)."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    assert hasattr(server, "_forkserver_pid")
    assert start_method.forkserver_pid() == server._forkserver_pid


def test_an_unknown_start_method_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(start_method.ENV_VAR, "fork")
    with pytest.raises(ValueError, match=r"SHARDWISE_START_METHOD='fork'.*\('forkserver', 'spawn'\)"):
        start_method.rank_context()


def test_spawn_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(start_method.ENV_VAR, "spawn")
    assert start_method.rank_context().get_start_method() == "spawn"


def test_spawn_when_the_running_fork_server_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another library started Python's one forkserver: its environment is unknown, so no rank is
    forked from it."""
    monkeypatch.delenv(start_method.ENV_VAR, raising=False)
    monkeypatch.setattr(start_method, "_ours", None)
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: 4321)
    assert start_method.rank_context().get_start_method() == "spawn"


def test_spawn_once_the_environment_differs_from_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(start_method.ENV_VAR, raising=False)
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: 4321)
    monkeypatch.setattr(start_method, "_ours", (4321, dict(os.environ)))
    assert start_method.rank_context().get_start_method() == "forkserver"
    monkeypatch.setenv("SHARDWISE_TEST_SET_AFTER_THE_SERVER", "1")
    assert start_method.rank_context().get_start_method() == "spawn"
    monkeypatch.delenv("SHARDWISE_TEST_SET_AFTER_THE_SERVER")
    assert start_method.rank_context().get_start_method() == "forkserver"
    # Our server died and Python started another (pid changed): its environment is not ours to know.
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: 9876)
    assert start_method.rank_context().get_start_method() == "spawn"


SCRIPT = r"""
import os, sys, time
from shardwise.collectives.backends import start_method
from shardwise.collectives.backends.processes import ProcessPool

def seen():
    return os.getppid(), os.environ.get("LATE")

if __name__ == "__main__":
    t = time.perf_counter()
    with ProcessPool(2, timeout=60) as pool:
        forked = pool.run(seen)
    server = start_method.forkserver_pid()
    os.environ["LATE"] = "set after the server started"
    with ProcessPool(2, timeout=60) as pool:
        spawned = pool.run(seen)
    print(repr((os.getpid(), server, forked, spawned)))
"""


@pytest.mark.gloo
def test_ranks_fork_from_the_server_and_see_a_variable_set_after_it_started(tmp_path: Path) -> None:
    """End to end, in a fresh interpreter: the first pool's ranks are the server's children (not the
    launcher's), and a pool started after a variable was set sees it (spawned)."""
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(start_method.ENV_VAR, None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher, server, forked, spawned = eval(done.stdout.strip().splitlines()[-1])
    assert server is not None and server != launcher
    assert forked == [(server, None), (server, None)]
    assert spawned == [(launcher, "set after the server started")] * 2
