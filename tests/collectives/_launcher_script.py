"""A launcher for test_faults.py to signal: ``python _launcher_script.py BACKEND WORLD TIMEOUT PID_DIR``.

Every rank writes its pid (the launcher's own on threads) to PID_DIR, then
all-reduces and multiplies matrices forever, so a signal finds the ranks busy
in torch and in collectives. The launcher writes ``launcher.pid`` once every
rank is in the loop.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from shardwise.collectives import Mesh, launch, psum


def busy_forever(pid_dir: str) -> None:
    mesh = Mesh(dp=mesh_size())
    Path(pid_dir, f"rank{mesh.rank}.pid").write_text(str(os.getpid()))
    x = torch.randn(64, 64)
    while True:
        x = torch.tanh(x @ x)
        psum(x, "dp", mesh=mesh)
        if all(Path(pid_dir, f"rank{r}.pid").exists() for r in range(mesh.size)):
            Path(pid_dir, "ready").touch()


def mesh_size() -> int:
    return int(os.environ["FAULT_WORLD"])


if __name__ == "__main__":
    backend, world, timeout, pid_dir = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    os.environ["FAULT_WORLD"] = str(world)  # spawned ranks inherit it
    # As an interactive shell would: a test run in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    Path(pid_dir, "launcher.pid").write_text(str(os.getpid()))
    launch(busy_forever, world, backend=backend, timeout=timeout, args=(pid_dir,))
