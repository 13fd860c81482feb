"""The fault matrix under torchrun: the README's recipe (a process group with shardwise's one
timeout, a barrier, destroy_process_group) ends within the timeout and a few seconds whatever
one rank does, with the error named, and leaves no process behind.

World 2 only: each torchrun costs a few seconds to start here. Faults on rank 1: raise,
SIGKILL, hang before the last collective (skipping it and hanging after it end by the same
timeout: tests/collectives/test_faults.py runs them on the processes backend).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_torchrun_faults.py")
TIMEOUT_S = 2.0
SLACK_S = 40.0  # torchrun's start and teardown on a loaded 2-core machine; a hang would never end

pytestmark = pytest.mark.gloo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# fault -> what the output must say. A rank that skips the last collective or hangs after it ends
# by the same timeout as hang_before here; test_faults.py runs those two on the processes backend.
EXPECTED = {
    "raise": r"rank 1 broke on purpose",
    # rank 0 names the collective it lost its peer in (torchrun may report its exit first)
    "sigkill": r"all_gather on axis 'dp' \(group ranks \(0, 1\)\) on rank 0 .* failed|SIGKILL",
    "hang_before": r"all_gather on axis 'dp'.*(timed out|timeout)|(timed out|timeout).*all_gather",
}


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_a_fault_under_torchrun_ends_in_time_named_and_leaves_no_process(
        fault: str, process_alive: Callable[[int], bool]) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(SCRIPT), fault],
        capture_output=True, text=True, timeout=TIMEOUT_S * 4 + SLACK_S * 2, check=False,
    )
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert elapsed < TIMEOUT_S * 2 + SLACK_S, f"took {elapsed:.1f} s\n{output}"
    assert re.search(EXPECTED[fault], output, re.S | re.I), output
    pids = [int(p) for p in re.findall(r"^pid (\d+)$", done.stdout, re.M)]
    assert len(pids) == 2, output
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if process_alive(p)], f"rank processes left running\n{output}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_to_torchrun_ends_every_rank(sig: int, process_alive: Callable[[int], bool]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(SCRIPT), "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        pids: list[int] = []
        deadline = time.monotonic() + SLACK_S
        seen: list[str] = []
        while len(pids) < 2 and time.monotonic() < deadline:  # both ranks joined the group
            line = proc.stdout.readline()
            if not line:  # torchrun ended before both ranks said where they are
                break
            seen.append(line)
            if match := re.match(r"^pid (\d+)$", line.strip()):
                pids.append(int(match.group(1)))
        assert len(pids) == 2, "".join(seen)
        proc.send_signal(sig)
        proc.wait(timeout=SLACK_S)
        deadline = time.monotonic() + 5
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if process_alive(p)], "rank processes left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
