"""How rank processes start (shardwise/collectives/backends/start_method.py): forked from a server
that imported torch once, unless that would hand the ranks another environment than the launcher's."""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise.collectives.backends import start_method
from shardwise.collectives.backends.processes import ProcessPool

REPO = Path(__file__).resolve().parents[2]


def test_python_still_keeps_the_fork_servers_state_where_it_is_read() -> None:
    """The private names read and reset (Python has no public way to ask whether its forkserver
    runs, nor to make a forked child forget its parent's)."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    for name in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"):
        assert hasattr(server, name), name
    assert start_method.forkserver_pid() == server._forkserver_pid


def test_a_python_that_keeps_the_servers_pid_elsewhere_spawns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(start_method.ENV_VAR, raising=False)
    monkeypatch.setattr(start_method, "_ours", None)
    monkeypatch.setattr(multiprocessing.forkserver, "_forkserver", object())
    assert start_method.rank_context().get_start_method() == "spawn"


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


def test_spawn_once_what_a_rank_inherits_differs_from_the_servers(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.delenv(start_method.ENV_VAR, raising=False)
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: 4321)
    monkeypatch.setattr(start_method, "_ours", (4321, start_method.inherited()))
    assert start_method.rank_context().get_start_method() == "forkserver"
    monkeypatch.setenv("SHARDWISE_TEST_SET_AFTER_THE_SERVER", "1")
    assert start_method.rank_context().get_start_method() == "spawn"
    monkeypatch.delenv("SHARDWISE_TEST_SET_AFTER_THE_SERVER")
    assert start_method.rank_context().get_start_method() == "forkserver"
    # stderr sent elsewhere (a log; pytest's capfd): a forked rank would still write where it went before
    saved = os.dup(2)
    try:
        with open(tmp_path / "log", "w") as log:
            os.dup2(log.fileno(), 2)
            assert start_method.rank_context().get_start_method() == "spawn"
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert start_method.rank_context().get_start_method() == "forkserver"
    if os.path.exists("/proc/self/status"):  # the umask is read where Linux shows it
        old = os.umask(0o077)
        try:
            assert start_method.rank_context().get_start_method() == "spawn"
        finally:
            os.umask(old)
    # Our server died and Python started another (pid changed): its state is not ours to know.
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: 9876)
    assert start_method.rank_context().get_start_method() == "spawn"


SCRIPT = r"""
import os, sys, time
from shardwise.collectives.backends import start_method
from shardwise.collectives.backends.processes import ProcessPool

def seen():
    os.write(2, b"rank stderr\n")
    return os.getppid(), os.environ.get("LATE")

methods = []

def pool_of(world):
    with ProcessPool(world, timeout=60) as pool:
        assert pool.start_method is None
        result = pool.run(seen)
        methods.append((pool.start_method, repr(pool)))
        return result

if __name__ == "__main__":
    forked = pool_of(2)
    server = start_method.forkserver_pid()
    log = sys.argv[1]
    saved = os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
    redirected = pool_of(1)  # spawned from here on: one rank each is enough
    os.dup2(saved, 2)
    os.environ["LATE"] = "set after the server started"
    late = pool_of(1)
    del os.environ["LATE"]
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # a process forked from the launcher: the server is not its own
        before = start_method.forkserver_pid()
        os.write(w, repr((before, pool_of(1))).encode())
        os._exit(0)
    os.close(w)
    in_child = os.read(r, 100000).decode()
    os.waitpid(child, 0)
    print(repr((os.getpid(), server, forked, redirected, open(log).read().count("rank stderr"), late,
                eval(in_child), methods)))
"""


@pytest.mark.gloo
def test_ranks_are_forked_only_where_they_inherit_what_a_spawned_rank_would(tmp_path: Path) -> None:
    """End to end, in a fresh interpreter: the first pool's ranks are the server's children (not the
    launcher's); a pool started after stderr went to a log, or after a variable was set, is spawned
    and writes there or sees it; a process forked from the launcher launches (spawned: the server is
    its parent's)."""
    script = tmp_path / "launch.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(start_method.ENV_VAR, None)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "log")], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher, server, forked, redirected, logged, late, (server_in_child, in_child), methods = eval(
        done.stdout.strip().splitlines()[-1])
    # The pool says which: its start_method, and its repr.
    assert methods == [("forkserver", "ProcessPool(world=2, timeout=60, running, forked)")] + [
        ("spawn", "ProcessPool(world=1, timeout=60, running, spawned)")] * 2
    assert server is not None and server != launcher
    assert forked == [(server, None), (server, None)]
    assert redirected == [(launcher, None)] and logged == 1
    assert late == [(launcher, "set after the server started")]
    assert server_in_child is None and len(in_child) == 1 and all(ppid != server for ppid, _ in in_child)


KILLED = r"""
import multiprocessing, os, sys, time
from pathlib import Path
from shardwise.collectives.backends import start_method
from shardwise.collectives.backends.processes import ProcessPool

def busy(where):
    Path(where, f"rank{os.getpid()}").touch()
    time.sleep(600)

if __name__ == "__main__":
    where = sys.argv[1]
    with ProcessPool(2, timeout=600) as pool:
        pool.run(os.getpid)  # the server is up
        Path(where, f"server{start_method.forkserver_pid()}").touch()
        # A process this one forks (multiprocessing's fork context, a DataLoader's workers) lives on.
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
        helper.start()
        Path(where, f"helper{helper.pid}").touch()
        pool.run(busy, where)
"""


@pytest.mark.gloo
def test_a_killed_launcher_takes_its_ranks_and_the_server_with_it_whatever_it_forked(
        tmp_path: Path, process_alive: Callable[[int], bool]) -> None:
    """SIGKILL of a launcher whose ranks are busy while a process it forked lives on: the ranks and
    the fork server end (the forked process held copies of the pipes they watch, which it closes)."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(start_method.ENV_VAR, None)
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:  # a file, not a pipe: the forked helper holds its copy for long
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*"))) < 2:
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks never got busy"
            time.sleep(0.05)
        pid_of = {p.name.rstrip("0123456789"): int(p.name.lstrip("abcdefghijklmnopqrstuvwxyz")) for p in
                  tmp_path.iterdir() if p.name.startswith(("server", "helper"))}
        ranks = [int(p.name.removeprefix("rank")) for p in tmp_path.glob("rank*")]
        proc.kill()
        proc.wait(timeout=30)
        ended_by = time.monotonic() + 10
        while any(map(process_alive, [*ranks, pid_of["server"]])) and time.monotonic() < ended_by:
            time.sleep(0.05)
        assert not [pid for pid in ranks if process_alive(pid)], "ranks outlived their launcher"
        assert not process_alive(pid_of["server"]), "the fork server outlived the launcher"
        assert process_alive(pid_of["helper"])  # the forked process still runs: it is what held the pipes
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for p in tmp_path.glob("helper*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.name.removeprefix("helper")), signal.SIGKILL)


SERVER_KILLED = r"""
import os, re, signal, sys, time
from shardwise.collectives.backends import start_method
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.collectives import RankFailed

def exit_if(pid):
    if os.getpid() == pid:
        os._exit(3)
    return os.getpid()

def fail_or_stick(pid):
    if os.getpid() == pid:
        raise ValueError("this rank fails")
    re.match(r"(a+)+$", "a" * 60 + "b")  # holds the GIL for ever: only a signal ends it

def kill_server():
    server = start_method.forkserver_pid()
    os.kill(server, signal.SIGKILL)
    while start_method.server_exit(server) is None:
        time.sleep(0.01)
    return server

if __name__ == "__main__":
    with ProcessPool(2, timeout=60) as pool:
        ranks = pool.run(os.getpid)
        forked = pool.run(os.getppid)
        server = kill_server()
        after = [pool.run(os.getpid) for _ in range(3)]  # the same ranks, orphaned
        try:
            pool.run(exit_if, ranks[0])
            error = None
        except RankFailed as exc:
            error = str(exc)
        restarted = pool.run(os.getppid)  # the pool starts new ranks after a failed run
        new_server = start_method.forkserver_pid()
        # Again, and this time another launch reaps the dead server (it starts the next one).
        second = pool.run(os.getpid)
        kill_server()
        with ProcessPool(1, timeout=60) as other:
            other.run(os.getpid)
        reaped = pool.run(os.getpid)
        started = time.monotonic()
        try:
            pool.run(fail_or_stick, second[0])
            stuck = None
        except RankFailed as exc:
            stuck = (str(exc), time.monotonic() - started)
    with ProcessPool(1, timeout=60) as pool:
        next_launch = pool.run(os.getppid)
    print(repr((server, ranks, forked, after, error, new_server, restarted, second, reaped, stuck, next_launch)))
"""


@pytest.mark.gloo
@pytest.mark.skipif(not (hasattr(os, "pidfd_open") and hasattr(os, "waitid")), reason="needs pidfds and waitid (Linux)")
def test_ranks_outlive_a_killed_fork_server_and_the_next_launch_forks_from_a_new_one(
        tmp_path: Path, process_alive: Callable[[int], bool]) -> None:
    """SIGKILL of the fork server (the OOM killer picks the largest process; a server that preloaded
    torch can be it): its ranks run on, the pool's runs with them; the exit status of a rank that
    then exits went with the server, so the run fails naming the server and its signal (not "exited
    with code 255", which multiprocessing reads); the pool's next ranks and the next launch are
    forked from a new server, ours. Once another launch has reaped the dead server, its ranks still
    run; one stuck holding the GIL is ended by a signal when the run fails."""
    script = tmp_path / "server_killed.py"
    script.write_text(SERVER_KILLED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(start_method.ENV_VAR, None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    server, ranks, forked, after, error, new_server, restarted, second, reaped, stuck, next_launch = eval(
        done.stdout.strip().splitlines()[-1])
    assert forked == [server, server]
    assert after == [ranks] * 3
    assert error is not None and error.startswith("rank 0 failed: the process exited (its exit status is unknown: "
                                                  f"the fork server it was forked from, pid {server}, exited on "
                                                  "signal SIGKILL (the OOM killer's signal, or a kill)"), error
    assert "code 255" not in error, error
    assert new_server not in (None, server)
    assert restarted == [new_server, new_server] and next_launch not in ([new_server], [None])
    assert reaped == second
    assert stuck is not None and "ValueError: this rank fails" in stuck[0], stuck
    ended_by = time.monotonic() + 15
    while any(map(process_alive, ranks + second)) and time.monotonic() < ended_by:
        time.sleep(0.05)
    assert not [pid for pid in ranks + second if process_alive(pid)], "the ranks outlived their pool"


def test_spawn_where_the_working_directory_holds_another_shardwise(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The fork server starts with the working directory first on its path: started here, it would
    import that shardwise, not this process's. No server is started; the ranks are spawned."""
    (tmp_path / "shardwise").mkdir()
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(start_method.ENV_VAR, raising=False)
    monkeypatch.setattr(start_method, "_ours", None)
    monkeypatch.setattr(start_method, "forkserver_pid", lambda: None)
    assert start_method.shadowed() == ["shardwise"]
    assert start_method.rank_context().get_start_method() == "spawn"
    assert start_method._ours is None  # and no server was started


def test_nothing_is_shadowed_from_the_repository_root_or_an_empty_folder(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is shadowed where the working directory holds this process's own shardwise (a run from
    the repository root), none, or a folder of the name without ``__init__.py`` (a namespace portion,
    which a package later on the path wins over)."""
    monkeypatch.chdir(REPO)
    assert start_method.shadowed() == []
    monkeypatch.chdir(tmp_path)
    assert start_method.shadowed() == []
    (tmp_path / "torch").mkdir()
    assert start_method.shadowed() == []


SHADOWED = r"""
import shardwise
from shardwise.collectives.backends.processes import ProcessPool

def where():
    import shardwise
    return shardwise.__file__

if __name__ == "__main__":
    with ProcessPool(1, timeout=120) as pool:
        print(repr((shardwise.__file__, pool.run(where), pool.start_method)))
"""


@pytest.mark.gloo
def test_ranks_run_the_launchers_shardwise_beside_another_checkout(tmp_path: Path) -> None:
    """End to end: launched from a folder holding another copy of shardwise, with this one on
    PYTHONPATH (a benchmark of the code before a change), the ranks run the launcher's (before, the
    fork server imported the folder's, and every forked rank ran it)."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "shardwise", checkout / "shardwise", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "launch.py"
    script.write_text(SHADOWED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(start_method.ENV_VAR, None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=checkout)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher, ranks, method = eval(done.stdout.strip().splitlines()[-1])
    assert launcher == str(REPO / "shardwise" / "__init__.py")
    assert ranks == [launcher] and method == "spawn"


@pytest.mark.gloo
def test_a_pool_started_in_a_later_test_phase_forks_its_ranks_from_the_server() -> None:
    """The suite's own arrangement (tests/conftest.py): the server started in this test's setup, and
    pytest has since rewritten PYTEST_CURRENT_TEST for the call; a pool started now is forked from the
    server still (it was spawned, importing torch again in every rank, in every test after the first),
    and a variable a test sets itself still has its pool spawned."""
    if os.environ.get(start_method.ENV_VAR, "forkserver") != "forkserver":
        pytest.skip(f"{start_method.ENV_VAR} asks for spawned ranks")
    server = start_method.forkserver_pid()
    assert server is not None, "the gloo tests' setup starts the fork server"
    with ProcessPool(1, timeout=60) as pool:
        assert pool.run(os.getppid) == [server] and pool.start_method == "forkserver"
        # What the server preloaded, torch's fake-tensor machinery among it (a rank's first step imported
        # it for a second of CPU), a forked rank has without importing it (a name torch renamed is not).
        assert pool.run(_not_imported) == [[]]
    with pytest.MonkeyPatch.context() as patch:  # (what a launch would start its ranks with: no rank to start)
        patch.setenv("SHARDWISE_TEST_SET_IN_THE_TEST", "1")
        assert start_method.rank_context().get_start_method() == "spawn"
    assert start_method.rank_context().get_start_method() == "forkserver"


def _not_imported() -> list[str]:
    return [name for name in start_method.PRELOAD if name not in sys.modules]


def test_what_a_rank_inherits_leaves_out_only_the_test_runners_per_test_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's pytest suite rewrites PYTEST_CURRENT_TEST around every test: compared, it had every pool
    after the first test spawned. Any other variable still counts."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a.py::one (setup)")
    before = start_method.inherited()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "a.py::two (call)")
    assert start_method.inherited() == before
    monkeypatch.setenv("SHARDWISE_TEST_SET_IN_THE_TEST", "1")
    assert start_method.inherited() != before
