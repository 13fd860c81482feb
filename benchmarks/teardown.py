"""Teardown: launch after launch in fresh interpreters, counting the ones that do not exit cleanly.

Each launch is its own interpreter running ``shardwise.launch(main, world)`` (a psum and a
send/recv round trip per rank) on one backend, so an abort while the interpreter or gloo tears
down (torch 2.13's SIGABRT, "terminate called without an active exception") is a crash, as is
a wrong result or a rank process left running. One JSON line per backend:

    python benchmarks/teardown.py --launches 100 --backends threads,processes
    {"backend": "threads", "world": 2, "launches": 100, "crashes": 0, "seconds_per_launch": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import os, sys, torch, shardwise as sw

def main():
    mesh = sw.Mesh(dp=int(sys.argv[2]))
    total = sw.psum(torch.tensor([1.0 + mesh.rank]), "dp", mesh=mesh)
    peer = (mesh.rank + 1) % mesh.size
    sent = sw.send(total, "dp", peer, mesh=mesh)
    got = sw.recv("dp", (mesh.rank - 1) % mesh.size, mesh=mesh).wait()
    sent.wait()
    return os.getpid(), total.item(), got.item()

if __name__ == "__main__":
    world = int(sys.argv[2])
    results = sw.launch(main, world, backend=sys.argv[1], timeout=60)
    expected = world * (world + 1) / 2
    assert all(t == g == expected for _, t, g in results), results
    print(" ".join(str(pid) for pid, _, _ in results))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(backend: str, world: int, launches: int) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    crashes: list[str] = []
    # A file, not ``python -c``: spawned rank processes import the main script.
    script = Path(tempfile.mkdtemp(prefix="shardwise-teardown-")) / "launch_once.py"
    script.write_text(PROGRAM)
    started = time.monotonic()
    for i in range(launches):
        proc = subprocess.run(
            [sys.executable, str(script), backend, str(world)],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )  # fmt: skip
        pids = [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []
        if backend == "processes" and proc.returncode == 0:
            left = [pid for pid in pids if _alive(pid)]
            if left:
                crashes.append(f"launch {i}: rank processes {left} still running")
        if proc.returncode != 0 or "terminate called" in proc.stderr:
            crashes.append(f"launch {i}: rc={proc.returncode} {proc.stderr.strip()[-300:]}")
    seconds = time.monotonic() - started
    return {
        "backend": backend,
        "world": world,
        "launches": launches,
        "crashes": len(crashes),
        "seconds_per_launch": round(seconds / max(launches, 1), 3),
        "first_crashes": crashes[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backends", default="threads,processes")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        print(json.dumps(run(backend, args.world, args.launches)), flush=True)


if __name__ == "__main__":
    main()
