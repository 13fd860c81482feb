"""Where a rank's peak memory comes: a per-action VmHWM trace of shardwise ZeRO-3 and a per-module one of FSDP2.

Run it from the repository root:

    python benchmarks/memory_trace.py                         # 12 x Linear(2048), world 8, both systems
    python benchmarks/memory_trace.py --worlds 2 --variants shardwise_meta --timeline

The model, the optimizer and the allocator settings are benchmarks/memory.py's (its ``fsdp2_meta`` and
``shardwise_meta`` variants, each after a warm-up on a tiny model, each in a fresh pool of processes
unless ``--pools world``). In the last step each rank resets
the kernel's high-water mark (VmHWM) before every executor action (shardwise: ``Executor._call``
patched) or at every module hook (FSDP2: forward pre/post and backward pre/post of each Linear), and
reads VmHWM and VmRSS at the next mark: a segment's peak and the level after it, MiB above the rank's
RSS when the variant started. The marks cost a few system calls each and move nothing they measure.

Output: one JSON line per (world, variant, rank): ``peak_mib`` and the segment it came in (``at``,
``pre X`` being the gap before action X), and with ``--timeline`` every segment as [label, peak, level].
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from typing import Any

import memory
import torch
import torch.nn.functional as F
from _common import add_out_flag, environment, json_lines, note
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, status_bytes


class Marks:
    """Segments of a rank's run: each one's VmHWM and the VmRSS at its end, above the start's RSS."""

    def __init__(self) -> None:
        gc.collect()
        self._reset()
        self.base = status_bytes("VmRSS")
        self.rows: list[tuple[str, float, float]] = []
        self.on = False

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel resets VmHWM to the current VmRSS

    def mark(self, label: str) -> None:
        if self.on:
            peak, level = status_bytes("VmHWM") - self.base, status_bytes("VmRSS") - self.base
            self.rows.append((label, round(peak / 2**20, 1), round(level / 2**20, 1)))
        self._reset()


def shardwise_meta(cfg: memory.Config, stage: int = 3) -> list[tuple[str, float, float]]:
    from shardwise.engine.run import executor

    marks = Marks()
    original = executor.Executor._call

    def traced(self: Any, handler: Any, action: Any) -> None:
        marks.mark(f"pre {action}")
        original(self, handler, action)
        marks.mark(str(action))

    executor.Executor._call = traced  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            model = memory.build(cfg)
        chain, params = sw.functionalize(model)
        del model
        step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-3, inplace=True)), "dp", stage=stage)
        state = step.init(params, sw.Mesh(dp=cfg.world))
        del params
        batch = memory.batch_of(cfg)
        for i in range(cfg.steps):
            marks.on = i == cfg.steps - 1
            marks.mark("step start")
            state, _ = step(state, batch)
            marks.mark("step end")
    finally:
        executor.Executor._call = original  # type: ignore[method-assign]
    return marks.rows


def fsdp2_meta(cfg: memory.Config) -> list[tuple[str, float, float]]:
    marks = Marks()

    def hooks(i: int, layer: nn.Module) -> None:
        layer.register_forward_pre_hook(lambda mod, args: marks.mark(f"pre F({i})"))
        layer.register_forward_hook(lambda mod, args, out: marks.mark(f"F({i})"))
        layer.register_full_backward_pre_hook(lambda mod, grads: marks.mark(f"pre B({i})"))
        layer.register_full_backward_hook(lambda mod, gin, gout: marks.mark(f"B({i})"))

    model = memory.fsdp2_model(cfg, hooks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = memory.local_rows(cfg)
    for i in range(cfg.steps):
        marks.on = i == cfg.steps - 1
        marks.mark("step start")
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        marks.mark("loss")
        loss.backward()
        marks.mark("backward end")
        opt.step()
        marks.mark("update")
    return marks.rows


def shardwise_zero1_meta(cfg: memory.Config) -> list[tuple[str, float, float]]:
    return shardwise_meta(cfg, stage=1)


def shardwise_zero2_meta(cfg: memory.Config) -> list[tuple[str, float, float]]:
    return shardwise_meta(cfg, stage=2)


PROGRAMS = {"fsdp2_meta": fsdp2_meta, "shardwise_meta": shardwise_meta, "shardwise_zero1_meta": shardwise_zero1_meta,
            "shardwise_zero2_meta": shardwise_zero2_meta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="Linear width (default 2048: the 200 MB model)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--worlds", default="8", help="comma-separated world sizes (default 8)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--variants", default="fsdp2_meta,shardwise_meta", help="comma-separated subset of "
                        + ",".join(PROGRAMS))
    parser.add_argument("--timeline", action="store_true", help="every segment of the last step, per rank")
    parser.add_argument("--pools", choices=("variant", "world"), default="variant",
                        help="as benchmarks/memory.py's: a fresh pool per variant, or one per world for its "
                             "variants (a smoke run: the figures are not comparable) (default: variant)")
    add_out_flag(parser)
    args = parser.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(PROGRAMS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(PROGRAMS)}")
    os.environ.update(LIVE_MALLOC)  # the ranks start with it
    with json_lines(args.out) as emit:
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = memory.Config(args.width, args.layers, args.batch, 2, world)
            shared = ProcessPool(world, timeout=1800) if args.pools == "world" else None
            with shared or contextlib.nullcontext():
                for variant in args.variants.split(","):
                    note(f"# width {args.width}, world {world}: {variant}")
                    with contextlib.nullcontext(shared) if shared else ProcessPool(world, timeout=1800) as pool:
                        per_rank = pool.run(memory.warmed, PROGRAMS[variant], cfg)
                    for rank, rows in enumerate(per_rank):
                        label, peak, _ = max(rows, key=lambda row: row[1])
                        row: dict[str, Any] = {"bench": "memory_trace", "variant": variant, "width": args.width,
                                               "world": world, "rank": rank, "peak_mib": peak, "at": label}
                        if args.timeline:
                            row["timeline"] = rows
                        emit({**row, **environment(), "malloc": "128KiB thresholds", "pools": args.pools})


if __name__ == "__main__":
    main()
