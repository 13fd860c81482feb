"""Teardown: launch after launch in fresh interpreters, counting the ones that do not exit cleanly.

``--backends torchrun`` runs the guide's torchrun recipe instead (``torchrun --nproc-per-node
world``: a process group with the one timeout, a ZeRO-3 step, a barrier, destroy_process_group),
where torch 2.13 on gloo used to abort at exit now and then.

Each launch is its own interpreter running ``shardwise.launch(main, world)`` (a psum and a
send/recv round trip per rank; with ``--step`` also a small GPT's ZeRO-3 step, traced by torch.fx, as a training
launch starts; with ``--repeat N``, N launches in the interpreter) on one backend, so an abort
while the interpreter or gloo tears down (torch 2.13's SIGABRT, "terminate called without an
active exception") is a crash, as is a wrong result or a rank process left running. One JSON line per backend:

    python benchmarks/teardown.py --launches 100 --backends threads,processes
    {"backend": "threads", "world": 2, "launches": 100, "crashes": 0, "seconds_per_launch": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import os, sys, threading, torch, shardwise as sw
from shardwise.testing.models import TinyGPT

SEEDING = threading.Lock()

def main(build_step):
    mesh = sw.Mesh(dp=int(sys.argv[2]))
    total = sw.collectives.psum(torch.tensor([1.0 + mesh.rank]), "dp", mesh=mesh)
    peer = (mesh.rank + 1) % mesh.size
    sent = sw.collectives.send(total, "dp", peer, mesh=mesh)
    got = sw.collectives.recv("dp", (mesh.rank - 1) % mesh.size, mesh=mesh).wait()
    sent.wait()
    if build_step:  # what a training launch does first: trace a model, plan and run a ZeRO-3 step
        with SEEDING:  # thread ranks share torch's generator: one seeds and builds at a time
            torch.manual_seed(0)
            model = TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
        chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])  # torch.fx traces it
        loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        step = sw.shard_params(sw.train_step(chain, loss_fn, sw.optim.adamw(1e-3)), "dp", stage=3)
        state = step.init(params, mesh)
        tokens = torch.randint(0, 64, (2 * mesh.size, 16), generator=torch.Generator().manual_seed(0))
        step(state, (tokens, tokens))
    return os.getpid(), total.item(), got.item()

if __name__ == "__main__":
    world, build_step, repeat = int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    for _ in range(repeat):  # launches in this interpreter: the ones after the first find torch imported
        results = sw.launch(main, world, backend=sys.argv[1], timeout=60, args=(build_step,))
        expected = world * (world + 1) / 2
        assert all(t == g == expected for _, t, g in results), results
        print(" ".join(str(pid) for pid, _, _ in results))
"""


TORCHRUN_PROGRAM = """
import datetime, os, torch, torch.distributed as dist, shardwise as sw
from shardwise.testing.models import mlp

def main():
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 3]))
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    mesh = sw.Mesh(dp=dist.get_world_size())
    state = step.init(params, mesh)
    gen = torch.Generator().manual_seed(0)
    state, metrics = step(state, (torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)))
    os.write(1, f"{os.getpid()}\\n".encode())  # one write: the ranks share the pipe, print() writes twice

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        main()
        dist.barrier()
    finally:
        dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(backend: str, world: int, script: Path, step: bool, repeat: int) -> list[str]:
    if backend == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--max-restarts", "0",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script)]
    return [sys.executable, str(script), backend, str(world), str(int(step)), str(repeat)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(backend: str, world: int, launches: int, step: bool = False, repeat: int = 1) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    crashes: list[str] = []
    # A file, not ``python -c``: spawned rank processes import the main script.
    script = Path(tempfile.mkdtemp(prefix="shardwise-teardown-")) / "launch_once.py"
    script.write_text(TORCHRUN_PROGRAM if backend == "torchrun" else PROGRAM)
    started = time.monotonic()
    for i in range(launches):
        proc = subprocess.run(
            _command(backend, world, script, step, repeat), capture_output=True, text=True, timeout=300, env=env,
            cwd=ROOT,
        )  # fmt: skip
        # The ranks print their PIDs: on one line (launch), or each on its own (torchrun's workers).
        pids = (
            [int(p) for p in re.findall(r"^[\d ]+$", proc.stdout, re.M) for p in p.split()]
            if proc.returncode == 0
            else []
        )
        if backend in ("processes", "torchrun") and proc.returncode == 0:
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
        # torchrun's program always builds a step, one launch per interpreter
        **({} if backend == "torchrun" else {"step": step, "launches_per_interpreter": repeat}),
        "crashes": len(crashes),
        "seconds_per_launch": round(seconds / max(launches, 1), 3),
        "first_crashes": crashes[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backends", default="threads,processes", help="threads, processes, torchrun")
    parser.add_argument("--step", action="store_true",
                        help="each rank also traces a small GPT and runs one ZeRO-3 step (threads, processes)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="launches per interpreter (threads, processes; default 1): seconds_per_launch is "
                             "then per interpreter, the N launches together")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        print(json.dumps(run(backend, args.world, args.launches, args.step, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
