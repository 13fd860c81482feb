"""Checkpoint save and load throughput, and the stall of an async save, against torch DCP + FSDP2.

On gloo processes (2 by default, ``--worlds``), one MLP of ``--depth`` square Linear layers of
``--width`` (float32, AdamW after one step: parameters and two moments), every rank:

* ``shardwise``: ``shard_params(stage=3)``; ``checkpoint.save`` (blocking), ``checkpoint.load`` on
  the same mesh, and ``save(blocking=False)``: how long the call holds the step loop (host copies
  of the rank's shards plus one barrier) and the step time while its writer thread runs.
* ``dcp``: the same model under FSDP2 (``fully_shard`` per Linear and the root), torch's AdamW;
  ``torch.distributed.checkpoint.save`` / ``load`` of ``get_state_dict(model, optimizer)``, and
  ``dcp.async_save``'s stall the same way.

MB/s per rank: save = the bytes this rank wrote (its file) / wall time of the slowest rank;
load = the bytes this rank read / that time. A shardwise load reads whole tensors and cuts them,
so at ZeRO-3 without a pipeline every rank reads the whole checkpoint: its load figure counts
all of it. One JSON line per (world, library); times are medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import add_out_flag, add_worlds_flag, environment, json_lines, run_on_ranks
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.engine.checkpoint import save_load as ck

MB = 1e6


@dataclass(frozen=True)
class Config:
    world: int
    width: int
    depth: int
    repeats: int
    steps: int
    root: str


def build(cfg: Config) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, cfg.width), nn.Tanh()]
    return nn.Sequential(*layers)


def batch_of(cfg: Config, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, cfg.width, generator=gen), torch.randn(rows, cfg.width, generator=gen)


def timed(fn: Any) -> tuple[Any, float]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - start


def step_times(run_step: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - start)
    return times


def dir_bytes(path: Path, rank: int | None = None) -> int:
    files = [p for p in path.iterdir() if p.suffix == ".distcp" and (rank is None or p.name.startswith(f"__{rank}_"))]
    return sum(p.stat().st_size for p in files)


def bench_shardwise(cfg: Config) -> dict[str, Any]:
    rank = dist.get_rank()
    chain, params = sw.functionalize(build(cfg))
    step = sw.shard_params(sw.train_step(chain, nn.functional.mse_loss, sw.optim.adamw(1e-3)), "dp", stage=3)
    mesh = sw.Mesh(dp=cfg.world)
    batch = batch_of(cfg, 2 * cfg.world)
    state, _ = step(step.init(params, mesh), batch)
    saves, loads, stalls = [], [], []
    for i in range(cfg.repeats):
        path = Path(cfg.root) / f"sw{i}"
        _, seconds = timed(lambda path=path: ck.save(path, state, step))
        saves.append(seconds)
        loaded, seconds = timed(lambda path=path: ck.load(path, step, mesh))
        loads.append(seconds)
        assert loaded.step == state.step
    written, read = dir_bytes(path, rank), dir_bytes(path)
    holder = {"state": state}

    def train() -> None:
        holder["state"] = step(holder["state"], batch)[0]

    baseline = step_times(train, cfg.steps)
    dist.barrier()
    start = time.perf_counter()
    handle = ck.save(Path(cfg.root) / "sw-async", holder["state"], step, blocking=False)
    stalls.append(time.perf_counter() - start)
    during = step_times(train, cfg.steps)  # every rank steps (collectives), written or not
    handle.wait()
    return {"save_s": saves, "load_s": loads, "written": written, "read": read, "async_call_s": stalls,
            "step_s": baseline, "step_during_write_s": during}


def bench_dcp(cfg: Config) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    async_group = dist.new_group(backend="gloo")
    model = build(cfg)
    device_mesh = init_device_mesh("cpu", (cfg.world,))
    for part in model:
        if isinstance(part, nn.Linear):
            fully_shard(part, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_of(cfg, 2 * cfg.world)
    local = slice(rank * 2, rank * 2 + 2)

    def train() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[local]), y[local]).backward()
        optimizer.step()

    train()
    saves, loads = [], []
    for i in range(cfg.repeats):
        path = Path(cfg.root) / f"dcp{i}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _, seconds = timed(lambda path=path, sd={"model": model_sd, "optim": optim_sd}: dcp.save(sd, checkpoint_id=path))
        saves.append(seconds)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _, seconds = timed(lambda path=path, sd={"model": model_sd, "optim": optim_sd}: dcp.load(sd, checkpoint_id=path))
        loads.append(seconds)
    written = dir_bytes(path, rank)
    read = written  # DCP reads the chunks that overlap this rank's shards: its own here
    baseline = step_times(train, cfg.steps)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dist.barrier()
    start = time.perf_counter()
    # its own group: the writer's collectives must not interleave with training's on the default one
    future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(cfg.root) / "dcp-async",
                            process_group=async_group)
    stall = time.perf_counter() - start
    during = step_times(train, cfg.steps)
    future.result()
    return {"save_s": saves, "load_s": loads, "written": written, "read": read, "async_call_s": [stall],
            "step_s": baseline, "step_during_write_s": during}


def bench_rank(cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"shardwise": bench_shardwise(cfg), "dcp": bench_dcp(cfg)}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(cfg.root, ignore_errors=True)
    return out


def row(cfg: Config, library: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    results = [r[library] for r in per_rank]
    save = statistics.median(max(r["save_s"][i] for r in results) for i in range(cfg.repeats))
    load = statistics.median(max(r["load_s"][i] for r in results) for i in range(cfg.repeats))
    written = max(r["written"] for r in results)
    read = max(r["read"] for r in results)
    step = statistics.median(t for r in results for t in r["step_s"])
    during = [t for r in results for t in r["step_during_write_s"]]
    return {
        "benchmark": "checkpoint", "library": library, "world": cfg.world,
        "state_mb_per_rank": round(written / MB, 2),
        "save_s": round(save, 4), "save_mb_s_per_rank": round(written / MB / save, 1),
        "load_s": round(load, 4), "load_read_mb_per_rank": round(read / MB, 2), "load_mb_s_per_rank": round(read / MB / load, 1),
        "async_stall_s": round(max(max(r["async_call_s"]) for r in results), 4),
        "step_s": round(step, 4),
        "step_during_async_write_s": round(statistics.median(during), 4) if during else None,
        **environment(threads_per_rank=1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worlds_flag(parser)
    parser.set_defaults(worlds="2")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024: 4 MB of weights each)")
    parser.add_argument("--depth", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads timed per library (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="steps timed with and without an async write (default 4)")
    add_out_flag(parser)
    args = parser.parse_args(argv)
    rows = []
    with json_lines(args.out) as emit:
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = Config(world, args.width, args.depth, args.repeats, args.steps, tempfile.mkdtemp(prefix="ckpt-bench-"))
            with ProcessPool(world, timeout=120.0) as pool:
                per_rank = run_on_ranks(pool, bench_rank, cfg, label=f"checkpoint, world {world}")
            for library in ("shardwise", "dcp"):
                rows.append(row(cfg, library, per_rank))
                emit(rows[-1])
    return rows


if __name__ == "__main__":
    main()
