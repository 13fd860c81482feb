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
load = the bytes this rank read / that time. Both load on the mesh that saved, so each reads its
own share (shardwise: the 64 KiB chunks holding it, each checked against its crc32). The two
libraries take turns in every repeat (a shardwise save and load, then DCP's, on the same ranks),
so a change of load on the machine falls on both alike; ``load_vs_dcp`` is the median of the
per-repeat ratios of the load times. One JSON line per (world, library); times are medians over
``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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


class Library(Protocol):
    """One library's state on this rank, and how it saves, loads and async-saves it."""

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...

    def async_part(self, root: Path) -> dict[str, Any]: ...


class Shardwise:
    def __init__(self, cfg: Config) -> None:
        chain, params = sw.functionalize(build(cfg))
        self.step = sw.shard_params(sw.train_step(chain, nn.functional.mse_loss, sw.optim.adamw(1e-3)), "dp", stage=3)
        self.mesh = sw.Mesh(dp=cfg.world)
        self.batch = batch_of(cfg, 2 * cfg.world)
        self.state, _ = self.step(self.step.init(params, self.mesh), self.batch)
        self.cfg = cfg

    def save(self, path: Path) -> None:
        ck.save(path, self.state, self.step)

    def load(self, path: Path) -> None:
        loaded = ck.load(path, self.step, self.mesh)
        assert loaded.step == self.state.step

    def async_part(self, root: Path) -> dict[str, Any]:
        holder = {"state": self.state}

        def train() -> None:
            holder["state"] = self.step(holder["state"], self.batch)[0]

        baseline = step_times(train, self.cfg.steps)
        dist.barrier()
        start = time.perf_counter()
        handle = ck.save(root / "sw-async", holder["state"], self.step, blocking=False)
        stall = time.perf_counter() - start
        during = step_times(train, self.cfg.steps)  # every rank steps (collectives), written or not
        handle.wait()
        return {"async_call_s": [stall], "step_s": baseline, "step_during_write_s": during}


class Dcp:
    def __init__(self, cfg: Config) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rank = dist.get_rank()
        self.async_group = dist.new_group(backend="gloo")
        self.model = build(cfg)
        device_mesh = init_device_mesh("cpu", (cfg.world,))
        for part in self.model:
            if isinstance(part, nn.Linear):
                fully_shard(part, mesh=device_mesh)
        fully_shard(self.model, mesh=device_mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x, self.y = batch_of(cfg, 2 * cfg.world)
        self.local = slice(rank * 2, rank * 2 + 2)
        self.cfg = cfg
        self.train()

    def train(self) -> None:
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.model(self.x[self.local]), self.y[self.local]).backward()
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=path)

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.state_dict(), checkpoint_id=path)

    def async_part(self, root: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        baseline = step_times(self.train, self.cfg.steps)
        sd = self.state_dict()
        dist.barrier()
        start = time.perf_counter()
        # its own group: the writer's collectives must not interleave with training's on the default one
        future = dcp.async_save(sd, checkpoint_id=root / "dcp-async", process_group=self.async_group)
        stall = time.perf_counter() - start
        during = step_times(self.train, self.cfg.steps)
        future.result()
        return {"async_call_s": [stall], "step_s": baseline, "step_during_write_s": during}


def bench_rank(cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    libraries: dict[str, Library] = {"shardwise": Shardwise(cfg), "dcp": Dcp(cfg)}
    out: dict[str, dict[str, Any]] = {name: {"save_s": [], "load_s": []} for name in libraries}
    root = Path(cfg.root)
    for i in range(cfg.repeats):  # the libraries take turns: each repeat times both under one load
        for name, library in libraries.items():
            path = root / f"{name}{i}"
            _, seconds = timed(lambda library=library, path=path: library.save(path))
            out[name]["save_s"].append(seconds)
            _, seconds = timed(lambda library=library, path=path: library.load(path))
            out[name]["load_s"].append(seconds)
    for name, library in libraries.items():
        last = root / f"{name}{cfg.repeats - 1}"
        # both read their own share on the mesh that saved: the rank's file (DCP: the chunks that
        # overlap its shards; shardwise: the 64 KiB chunks holding them)
        out[name].update(written=dir_bytes(last, rank), read=dir_bytes(last, rank), **library.async_part(root))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(cfg.root, ignore_errors=True)
    return out


def row(cfg: Config, library: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    results = [r[library] for r in per_rank]

    def slowest(name: str, what: str) -> list[float]:
        """Per repeat, the slowest rank's time."""
        return [max(r[name][what][i] for r in per_rank) for i in range(cfg.repeats)]

    save = statistics.median(slowest(library, "save_s"))
    load = statistics.median(slowest(library, "load_s"))
    ratios = {what: statistics.median(a / b for a, b in zip(slowest(library, what), slowest("dcp", what), strict=True))
              for what in ("save_s", "load_s")}
    written = max(r["written"] for r in results)
    read = max(r["read"] for r in results)
    step = statistics.median(t for r in results for t in r["step_s"])
    during = [t for r in results for t in r["step_during_write_s"]]
    return {
        "benchmark": "checkpoint", "library": library, "world": cfg.world,
        "state_mb_per_rank": round(written / MB, 2),
        "save_s": round(save, 4), "save_mb_s_per_rank": round(written / MB / save, 1),
        "load_s": round(load, 4), "load_read_mb_per_rank": round(read / MB, 2), "load_mb_s_per_rank": round(read / MB / load, 1),
        "save_vs_dcp": round(ratios["save_s"], 3), "load_vs_dcp": round(ratios["load_s"], 3),
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
