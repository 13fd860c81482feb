"""The files a member killed during a shared-memory setup leaves in /dev/shm are swept by the next
setup once their creator is gone (collectives/backends/shared_memory_exchange.sweep_stale)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.collectives.backends import shared_memory_exchange as shm


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def test_only_old_files_of_gone_creators_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path))
    dead, alive = _dead_pid(), os.getpid()
    old = time.time() - 2 * shm.STALE_SECONDS
    names = {
        f"shardwise-0123abcd-0-{dead}": (old, "swept"),
        f"shardwise-0123abcd-0-{dead}.fifo": (old, "swept"),
        f"shardwise-0123abcd-1-{dead}": (time.time(), "kept: too new (a setup of another PID namespace?)"),
        f"shardwise-0123abcd-1-{alive}": (old, "kept: its creator runs"),
        f"shardwise-0123abcd-1-{alive}.fifo": (old, "kept: its creator runs"),
        "shardwise-0123abcd-1": (old, "kept: not a name a member makes"),
        f"other-0123abcd-0-{dead}": (old, "kept: not ours"),
    }
    for name, (mtime, _) in names.items():
        path = tmp_path / name
        path.write_bytes(b"")
        os.utime(path, (mtime, mtime))
    removed = shm.sweep_stale()
    assert sorted(removed) == sorted(str(tmp_path / n) for n, (_, why) in names.items() if why == "swept")
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {n for n, (_, why) in names.items() if why != "swept"}, left


def test_a_missing_directory_sweeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path / "absent"))
    assert shm.sweep_stale() == []
