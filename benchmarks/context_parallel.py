"""Context-parallel causal attention: shardwise's ring and Ulysses against an all-gather-KV baseline and
torch's own ``context_parallel``, forward + backward, on gloo processes.

Run it from the repository root:

    python benchmarks/context_parallel.py                         # seq 2048, 4096 at cp 2, 4
    python benchmarks/context_parallel.py --seqs 2048 --worlds 2 --steps 5 --out cp.jsonl

What is measured
----------------
One causal attention, B=1, 8 heads of 64 (``--heads``, ``--head-dim``), float32, the whole sequence of
``seq`` tokens split over ``cp`` ranks (one gloo process per rank, ``torch.set_num_threads(1)``). A
step is: this rank's q, k, v slices (fresh leaves), the attention forward, and ``autograd.grad`` of
the output against a fixed upstream gradient, to the rank's q, k and v. Variants:

* ``ring``: :func:`ring_attention`, balanced causal layout (``shard_sequence(balanced=True)``).
* ``ulysses``: :func:`ulysses_attention`, the same layout (all-to-all to whole heads, sdpa, back).
* ``allgather_kv`` (the baseline, written here): the same layout; one ``sw.collectives.all_gather`` of the rank's
  stacked k/v slices (its transpose, a reduce-scatter, carries their gradients back), then torch's
  sdpa of the rank's queries over the whole sequence with the mask ``key position <= query position``
  (the balanced layout gives each rank two chunks, so the mask is explicit, not ``is_causal``).
* ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` on a gloo ``DeviceMesh``,
  tried on a small problem first; when it cannot run on CPU its line says ``skipped`` with the error.

Timing: all variants run in the same processes, stepped round-robin after a barrier
(``_common.round_robin``); ``median_step_s`` is the median over steps of the slowest rank's step,
``ratio_to_allgather`` its ratio to the baseline's, ``paired_ratio_to_allgather`` the median of the
per-round ratios. Memory: in fresh processes with glibc's thresholds at 128 KiB (RSS follows live
memory), per variant one warm-up step, then ``peak_bytes_per_rank``: VmHWM above the RSS before the
step (``shardwise.testing.memory.PeakRSS``), the largest over ranks. Bytes: ``sent_bytes_per_step``
from ``sw.collectives.comm_ledger()`` on the busiest rank (forward and backward), beside ``formula_sent_bytes``
(``ring_attention_bytes`` / ``ulysses_attention_bytes`` x 2 passes; the all-gather: ``(cp - 1)`` x the
k/v slice forward, and its reduce-scatter the same backward). ``max_abs_diff_to_allgather``: the
largest difference of the output and the three gradients from the baseline's, on every rank.
``--pools one`` (the test suite's smoke run) runs timing and memory in one pool, started with the
low thresholds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    add_out_flag,
    add_worlds_flag,
    environment,
    json_lines,
    note,
    paired_ratio_median,
    round_robin,
)

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, PeakRSS
from shardwise.transforms.context_parallel import (
    ring_attention,
    ring_attention_bytes,
    shard_order,
    shard_sequence,
    ulysses_attention,
    ulysses_attention_bytes,
)

VARIANTS = ("ring", "ulysses", "allgather_kv")
BASELINE = "allgather_kv"
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Config:
    seq: int
    world: int
    heads: int = 8
    head_dim: int = 64
    batch: int = 1
    steps: int = 5
    warmup: int = 1


def whole_inputs(cfg: Config) -> tuple[torch.Tensor, ...]:
    """q, k, v and the upstream gradient of the whole sequence, seeded: the same on every rank."""
    gen = torch.Generator().manual_seed(cfg.seq)
    return tuple(torch.randn(cfg.batch, cfg.heads, cfg.seq, cfg.head_dim, generator=gen) for _ in range(4))


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str) -> torch.Tensor:
    """The baseline: gather every rank's k/v, then sdpa of the local (balanced-layout) queries over them."""
    n, i = sw.collectives.axis_size(axis), sw.collectives.axis_index(axis)
    kv = sw.collectives.all_gather(torch.stack([k, v]), axis, dim=3, tiled=True)  # [2, b, h, seq, d], in shard order
    order = shard_order(kv.shape[3], n, balanced=True)  # global position of every gathered key
    local = q.shape[2]
    mask = order.view(1, -1) <= order[i * local : (i + 1) * local].view(-1, 1)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)


ATTENTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": lambda q, k, v: ring_attention(q, k, v, "cp", balanced=True),
    "ulysses": lambda q, k, v: ulysses_attention(q, k, v, "cp", balanced=True),
    "allgather_kv": lambda q, k, v: allgather_kv_attention(q, k, v, "cp"),
}


def one_step(name: str, local: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Forward and backward of one variant on this rank's slices: the output and the q, k, v gradients."""
    q, k, v, g = local
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ATTENTIONS[name](*leaves)
    grads = torch.autograd.grad(out, leaves, g)
    return [out.detach(), *grads]


def local_inputs(cfg: Config) -> tuple[torch.Tensor, ...]:
    return tuple(shard_sequence(t, "cp", dim=2, balanced=True) for t in whole_inputs(cfg))


def time_variants(cfg: Config) -> dict[str, Any]:
    """On each rank: every variant round-robin; its step times and how far its results are from the baseline's."""
    torch.set_num_threads(1)
    with sw.Mesh(cp=cfg.world):
        local = local_inputs(cfg)
        first: dict[str, list[torch.Tensor]] = {}

        def step(name: str, i: int, _: Any) -> None:
            result = one_step(name, local)
            if i == 0:
                first[name] = result

        times, _ = round_robin(VARIANTS, [None] * (cfg.warmup + cfg.steps), cfg.warmup, step)
        diffs = {name: max(float((a - b).abs().max()) for a, b in zip(first[name], first[BASELINE], strict=True))
                 for name in VARIANTS}
    return {"times": times, "diffs": diffs}


def measure_memory_and_bytes(cfg: Config) -> dict[str, Any]:
    """On each rank, in fresh processes: per variant a warm-up step, then the peak and the ledger of one more."""
    torch.set_num_threads(1)
    peaks, sent = {}, {}
    with sw.Mesh(cp=cfg.world):
        local = local_inputs(cfg)
        for name in VARIANTS:
            one_step(name, local)
            dist.barrier()
            meter = PeakRSS()
            with sw.collectives.comm_ledger() as ledger:
                result = one_step(name, local)
            peaks[name] = meter.peak()
            sent[name] = ledger.sent_bytes()
            del result
    return {"peaks": peaks, "sent": sent}


def formula_bytes(cfg: Config, name: str) -> int:
    """What one rank sends in a forward + backward, by formula (each pass sends the same)."""
    seq_local, itemsize = cfg.seq // cfg.world, 4
    shape = {"batch": cfg.batch, "kv_heads": cfg.heads, "seq_local": seq_local, "head_dim": cfg.head_dim,
             "itemsize": itemsize, "size": cfg.world}
    if name == "ulysses":
        return 2 * ulysses_attention_bytes(heads=cfg.heads, **shape)
    # The all-gather sends the k/v slice to the cp - 1 others, its reduce-scatter the same back: the ring's.
    return 2 * ring_attention_bytes(**shape)


def torch_context_parallel(cfg: Config) -> dict[str, Any]:
    """Try torch's ``context_parallel`` (small problem, forward and backward); the error if it cannot run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (cfg.world,), mesh_dim_names=("cp",))
    buffers = [t[..., : 16 * cfg.world, :].contiguous() for t in whole_inputs(cfg)[:3]]
    try:
        # The buffers are sharded in place on entry; not restored on exit (they are ours, and a leaf that
        # requires grad cannot be resized back, which would hide the real error).
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
            q, k, v = (b.requires_grad_() for b in buffers)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
    except Exception as exc:  # torch's CP on CPU: record why, as the brief asks, and move on
        root = exc
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__  # type: ignore[assignment]
        frames = traceback.extract_tb(exc.__traceback__)
        return {"ran": False, "error": f"{type(root).__name__}: {root}", "raised_in": frames[-1].name}
    return {"ran": True}


@contextlib.contextmanager
def live_malloc() -> Iterator[None]:
    """Processes started inside run with glibc's thresholds at 128 KiB (RSS follows live memory)."""
    saved = {key: os.environ.get(key) for key in LIVE_MALLOC}
    os.environ.update(LIVE_MALLOC)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def rows_for(cfg: Config, pools: str = "two") -> list[dict[str, Any]]:
    """``pools="one"``: timing, probe and memory in one pool started with ``live_malloc`` (a smoke
    run: one start of the processes less; the times are not the default allocator's)."""
    base = {"bench": "context_parallel", "seq": cfg.seq, "cp": cfg.world, "heads": cfg.heads,
            "head_dim": cfg.head_dim, "batch": cfg.batch, "dtype": "float32", "steps": cfg.steps, "pools": pools}
    with contextlib.ExitStack() as held:
        if pools == "one":
            held.enter_context(live_malloc())
        pool = held.enter_context(ProcessPool(cfg.world, timeout=TIMEOUT_S))
        note(f"# seq {cfg.seq}, cp {cfg.world}: timing")
        timed = pool.run(time_variants, cfg)
        probe = pool.run(torch_context_parallel, cfg)[0]
        if pools == "two":
            pool.close()
            held.enter_context(live_malloc())
            pool = held.enter_context(ProcessPool(cfg.world, timeout=TIMEOUT_S))
        note(f"# seq {cfg.seq}, cp {cfg.world}: memory and bytes")
        measured = pool.run(measure_memory_and_bytes, cfg)
    per_rank = {name: [r["times"][name] for r in timed] for name in VARIANTS}
    slowest = {name: [max(s) for s in zip(*per_rank[name], strict=True)] for name in VARIANTS}
    baseline = statistics.median(slowest[BASELINE])
    rows = []
    for name in VARIANTS:
        median = statistics.median(slowest[name])
        rows.append({**base, "variant": name, "median_step_s": round(median, 5),
                     "ratio_to_allgather": round(median / baseline, 3),
                     "paired_ratio_to_allgather": round(paired_ratio_median(per_rank[name], per_rank[BASELINE]), 3),
                     "peak_bytes_per_rank": max(r["peaks"][name] for r in measured),
                     "sent_bytes_per_step": max(r["sent"][name] for r in measured),
                     "formula_sent_bytes": formula_bytes(cfg, name),
                     "max_abs_diff_to_allgather": max(r["diffs"][name] for r in timed),
                     **environment(threads_per_rank=1)})
    torch_row = {**base, "variant": "torch_cp"}
    if probe["ran"]:
        # It ran on CPU after all: this benchmark does not time it yet; say so rather than leave it out.
        torch_row["skipped"] = "torch's context_parallel ran on a small probe; timing it is not written yet"
    else:
        torch_row["skipped"] = f"torch's context_parallel cannot run on CPU/gloo here: {probe['error']}"
        torch_row["raised_in"] = probe["raised_in"]
    rows.append({**torch_row, **environment(threads_per_rank=1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="2048,4096", help="comma-separated whole sequence lengths")
    add_worlds_flag(parser)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, >= 1 (default 1)")
    parser.add_argument("--pools", choices=("two", "one"), default="two",
                        help="two: timing in one pool, memory in fresh processes with glibc's thresholds low; "
                             "one: all in one pool with the low thresholds (a smoke run: one start of the "
                             "processes less, the times are not the default allocator's) (default: two)")
    add_out_flag(parser)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the first step's results are the ones compared")
    with json_lines(args.out) as emit:
        for world in (int(w) for w in args.worlds.split(",")):
            for seq in (int(s) for s in args.seqs.split(",")):
                cfg = Config(seq, world, args.heads, args.head_dim, steps=args.steps, warmup=args.warmup)
                for row in rows_for(cfg, args.pools):
                    emit(row)


if __name__ == "__main__":
    main()
