"""Run by test_processes.py under ``python -m torch.distributed.run --nproc-per-node 2``.

torchrun only sets the environment: the script initialises the default process
group itself, and the Mesh picks it up through backends.current.current_backend().
Given no timeout, the backend takes shardwise's default, not torch's 30 minutes.
"""

import os
import sys

import torch
import torch.distributed as dist

from shardwise.collectives.mesh import Mesh


def main() -> None:
    # Before init_process_group (a single-device reference step run first): the mesh says what is missing, and
    # the world of one the process ran as gives way to torch.distributed once it is initialised.
    try:
        _ = Mesh(dp=2).backend
        raise SystemExit("a Mesh(dp=2) was taken on a world of one")
    except RuntimeError as error:
        assert "WORLD_SIZE=2, torchrun's), but torch.distributed is not initialised" in str(error), error
    dist.init_process_group("gloo")
    mesh = Mesh(dp=2)
    backend = mesh.backend
    total = backend.all_reduce(torch.tensor([1.0 + mesh.rank]), mesh.group("dp")).wait()
    print(f"rank {mesh.rank}: {backend.name} all_reduce -> {total.tolist()}, timeout {backend.timeout:g} s", flush=True)
    dist.barrier()
    sys.stdout.flush()
    # Skip gloo's teardown at exit: torch 2.13 sometimes aborts (SIGABRT) in it.
    os._exit(0 if total.tolist() == [3.0] else 1)


if __name__ == "__main__":
    main()
