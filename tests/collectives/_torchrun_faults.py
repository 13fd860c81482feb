"""Run by test_faults_torchrun.py under ``python -m torch.distributed.run --nproc-per-node 2``:
every rank meets in a psum, then rank 1 misbehaves as argv[1] says around the last collective.

The script is the README's torchrun recipe: a process group with the one timeout, the step's
collectives, a barrier, destroy_process_group.
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import shardwise as sw

TIMEOUT_S = 2.0


def _hang() -> None:
    while True:  # stuck in a polling loop: never reaches its next collective
        time.sleep(0.02)


def _all_started() -> None:
    """Wait (a minute at most) until every rank got here: the group's short timeout also bounds its
    rendezvous, and on a loaded machine one rank's imports can end seconds after the other's."""
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    store.add("shardwise_test_started", 1)
    deadline = time.monotonic() + 60
    while store.add("shardwise_test_started", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError("the other rank did not start within a minute")
        time.sleep(0.01)


def main(fault: str) -> None:
    _all_started()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    os.write(1, f"pid {os.getpid()}\n".encode())  # one write: the ranks share the pipe, print() writes twice
    try:
        if fault == "sleep":  # every rank busy for good: only a signal to torchrun ends the job
            _hang()
        mesh = sw.Mesh(dp=dist.get_world_size())
        x = torch.ones(2)
        sw.collectives.psum(x, "dp", mesh=mesh)
        if mesh.rank == 1:
            if fault == "raise":
                raise ValueError("rank 1 broke on purpose")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang_before":
                _hang()
        if not (mesh.rank == 1 and fault == "skip"):
            sw.collectives.all_gather(x, "dp", mesh=mesh)
        if mesh.rank == 1 and fault == "hang_after":
            _hang()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
