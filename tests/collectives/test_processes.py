"""Multi-process launching: results, failures, cleanup, pools and torchrun.

Failure tests use short timeouts (2-5 s) so they stay fast. "Every process
ended" is checked with ``os.kill(pid, 0)``: it fails for a reaped process but
succeeds for a zombie, so it also proves the parent joined its children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardwise.collectives.backends.processes import ProcessPool, launch_processes
from shardwise.collectives.errors import CollectiveTimeout
from shardwise.collectives.launch import RankFailed, RankHung, launch
from shardwise.collectives.mesh import Mesh
from shardwise.collectives.timeout import DEFAULT_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]


# -- SPMD functions (module level: they travel to the worker processes by reference) ---
def _psum_rank() -> torch.Tensor:
    mesh = Mesh(dp=2)
    return mesh.backend.all_reduce(torch.tensor([1.0 + mesh.rank]), mesh.group("dp")).wait()


def _pid() -> int:
    return os.getpid()


def _record_pid_then(what: str, pid_dir: str) -> None:
    """Rank 1 misbehaves as ``what`` says; rank 0 meets it in a collective."""
    mesh = Mesh(dp=2)
    Path(pid_dir, f"{mesh.rank}.pid").write_text(str(os.getpid()))
    if mesh.rank == 1:
        if what == "raise":
            raise ValueError("rank 1 broke on purpose")
        if what == "return":
            return
        if what == "sleep":
            time.sleep(60)
        if what == "exit":
            os._exit(3)
    mesh.backend.all_reduce(torch.ones(2), mesh.group("dp")).wait()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _pids_in(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("*.pid"))]


def _assert_ended(pids: list[int]) -> None:
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # succeeds for a live process and for an unreaped zombie


# -- success ---------------------------------------------------------------------------
@pytest.mark.gloo
def test_launch_with_processes_backend() -> None:
    results = launch(_psum_rank, 2, backend="processes", timeout=30.0)
    assert [r.tolist() for r in results] == [[3.0], [3.0]]


@pytest.fixture(scope="module")
def pool2() -> Iterator[ProcessPool]:
    """A pool of its own: these tests break it on purpose (gloo2 stays shared and healthy)."""
    with ProcessPool(2, timeout=30.0) as pool:
        yield pool


@pytest.mark.gloo
def test_pool_reuses_processes_and_recovers_after_a_failed_run(pool2: ProcessPool, tmp_path: Path) -> None:
    first = pool2.run(_pid)
    assert pool2.run(_pid) == first == pool2.pids  # same processes, no new start
    assert [r.tolist() for r in pool2.run(_psum_rank)] == [[3.0], [3.0]]

    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        pool2.run(_record_pid_then, "raise", str(tmp_path))
    # Rank 0 waits in a collective with a 30 s timeout: it was terminated, not waited for.
    assert time.monotonic() - start < 10.0
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1 failed: ValueError: rank 1 broke on purpose" in message
    assert "traceback of rank 1" in message and "_record_pid_then" in message  # the remote traceback
    assert isinstance(info.value.__cause__, ValueError)
    assert pool2.pids == []
    _assert_ended(first)

    again = pool2.run(_pid)  # a fresh set of processes and process group
    assert set(again).isdisjoint(first)
    assert [r.tolist() for r in pool2.run(_psum_rank)] == [[3.0], [3.0]]


@pytest.mark.gloo
def test_keyboard_interrupt_in_the_parent_ends_every_process(pool2: ProcessPool) -> None:
    pids = pool2.run(_pid)
    # A suite started in the background (`cmd &` in a script) inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler: put the one an interactive run has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # As from Ctrl-C, the signal may land on any thread; the parent must still react.
    timer = threading.Timer(0.5, signal.raise_signal, args=(signal.SIGINT,))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool2.run(_sleep, 60.0)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert pool2.pids == []
    _assert_ended(pids)


# -- failures --------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.parametrize("what", ["return", "sleep"])
def test_a_rank_that_never_arrives_times_the_others_out(tmp_path: Path, what: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch_processes(_record_pid_then, 2, timeout=2.0, args=(what, str(tmp_path)))
    assert time.monotonic() - start < 20.0  # not the 60 s rank 1 sleeps
    assert isinstance(info.value.__cause__, CollectiveTimeout)
    message = str(info.value)
    assert "CollectiveTimeout: psum on axis 'dp' (group ranks (0, 1)) on rank 0" in message
    assert "timed out" in message and "timeout 2 s" in message
    if what == "sleep":  # rank 1 is still running: it is the one named, as hung
        assert isinstance(info.value, RankHung) and info.value.rank == 1
        assert message.startswith("rank 1 hung: still running")
    else:  # rank 1 returned: rank 0 timed out, and the error says who had returned
        assert type(info.value) is RankFailed and info.value.rank == 0
        assert "ranks [1] had returned their results already" in message
    _assert_ended(_pids_in(tmp_path))


@pytest.mark.gloo
def test_a_process_that_dies_is_a_failure_naming_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as info:
        launch_processes(_record_pid_then, 2, timeout=5.0, args=("exit", str(tmp_path)))
    # Rank 0 reacts with a collective error; the root cause is rank 1's death.
    assert info.value.rank == 1
    assert "exited with code 3 without reporting a result" in str(info.value)
    _assert_ended(_pids_in(tmp_path))


def _nested() -> None:
    pass


def test_unpicklable_work_is_refused_before_spawning() -> None:
    def local_fn() -> None:
        pass

    with pytest.raises(TypeError, match=r"local_fn cannot be pickled.*top level of an importable module"):
        launch_processes(local_fn, 2, timeout=5.0)
    with pytest.raises(TypeError, match="<lambda> cannot be pickled"):
        launch_processes(lambda: None, 2, timeout=5.0)
    with pytest.raises(TypeError, match="arguments for _nested cannot be pickled"):
        launch_processes(_nested, 2, timeout=5.0, args=(threading.Lock(),))
    with pytest.raises(TypeError, match="expected a function"):
        launch_processes(42, 2, timeout=5.0)  # type: ignore[arg-type]


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="world must be a positive int"):
        ProcessPool(0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        ProcessPool(2, timeout=0)
    pool = ProcessPool(2)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_pid)


# -- torchrun --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.gloo
def test_under_torchrun_the_mesh_uses_the_initialized_process_group() -> None:
    """Also after the process ran as a world of one before init_process_group (found by session 41's probing:
    that world was kept, and every rank refused its mesh advising torchrun, which had launched it)."""
    script = Path(__file__).with_name("_torchrun_script.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for _attempt in range(2):  # the master port may be taken between probe and bind
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_free_port()), str(script),
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        if "EADDRINUSE" not in proc.stderr:
            break
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: gloo all_reduce -> [3.0], timeout {DEFAULT_TIMEOUT_S:g} s" in proc.stdout, output
