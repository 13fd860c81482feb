"""Peak memory per rank: one process, torch FSDP2 and DDP, FairScale, DeepSpeed and shardwise ZeRO-1/2/3.

Run it from the repository root:

    python benchmarks/memory.py                                  # ~200 MB model, worlds 2,4
    python benchmarks/memory.py --models 200mb,800mb --worlds 2,4,8 --out memory.jsonl
    python benchmarks/memory.py --variants fsdp2_meta,shardwise_meta --widths 1024

What is measured
----------------
The model is ``layers`` x ``Linear(width, width)`` (12 x 2048: 201 MB of float32 parameters;
12 x 4096: 805 MB), AdamW, an MSE loss on a global batch of ``batch`` rows, ``steps`` steps.
Every variant runs in processes of its own (a fresh gloo :class:`ProcessPool`, one thread per
rank), so that no variant inherits another's high-water mark (``--pools world`` runs a world's
variants in one pool instead: the test suite's smoke run, whose figures are not to be compared).
Each rank first runs the variant once on a tiny model (so that the imports and one-time setup of
its code path are not counted as the model's), then records its VmRSS (the baseline) and resets
the kernel's high-water mark VmHWM (/proc/self/clear_refs), builds, initializes and trains, and
reads VmHWM after init and after the steps.

glibc's mmap and trim thresholds are fixed at 128 KiB in the ranks (``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_``), so that freed tensors return to the system at once and RSS
follows live memory; torch's CPU allocator caches nothing.

Variants:

* ``one_process`` (world 1): the whole model built in one process, a plain torch loop with
  ``torch.optim.AdamW`` on the whole batch.
* ``fsdp2_meta``: built under ``torch.device("meta")``, ``fully_shard`` on every Linear and
  the root, ``to_empty(device="cpu")``, ``reset_parameters()`` per Linear (torch's recipe),
  ``torch.optim.AdamW``; each rank steps on its slice of the batch.
* ``fairscale_fsdp``: FairScale's FSDP on every Linear and the root (it has no meta-device
  init: every rank builds the whole model, seeded, and FSDP keeps its shard), ``torch.optim.AdamW``.
* ``deepspeed_zero3_init``: DeepSpeed ZeRO-3, the model built inside ``deepspeed.zero.Init``
  (each parameter partitioned as it is made: DeepSpeed's way to build a model larger than a
  rank), its engine with ``torch.optim.AdamW`` and its default buckets; ``deepspeed_zero3``:
  the same with the model built whole on every rank first. FairScale and DeepSpeed are
  optional (``seed_systems.py``); a row says ``skipped`` when one is not installed.
* ``shardwise_meta``: built under ``torch.device("meta")``, ``sw.functionalize``, then
  ``sw.shard_params(step, "dp", stage=3)`` and ``step.init(params, mesh)``: each rank makes
  only its shards, one layer at a time, from the layers' ``reset_parameters``; AdamW with
  ``inplace=True`` (it writes the new parameters and moments into the state given, as
  ``torch.optim.AdamW`` does).
* ``shardwise_meta_functional``: the same with the functional AdamW (the default: the state
  passed in is left as it was, so the update holds the old and the new state at once).
* ``shardwise_eager``: the model built in full on every rank (as the README shows it), then
  functionalized and initialized as ``shardwise_meta``.

The ZeRO-1/2 rows, where every rank holds the whole model (only the optimizer state, and under
ZeRO-2 the gradients, are sharded), each with the model built whole on every rank, seeded:

* ``ddp``: torch's ``DistributedDataParallel`` with its defaults (25 MB gradient buckets, which
  it copies the gradients into), ``torch.optim.AdamW``; each rank steps on its slice of the batch.
* ``fairscale_oss``: FairScale's OSS (the optimizer state sharded) with ShardedDDP;
  ``deepspeed_zero2``: DeepSpeed ZeRO-2 with its default buckets (both optional, as above).
* ``shardwise_zero1``, ``shardwise_zero2``: ``sw.shard_params(step, "dp", stage=1 or 2)`` with
  its default buckets and the in-place AdamW.
* ``shardwise_zero1_meta``, ``shardwise_zero2_meta``: the same with the model built under
  ``torch.device("meta")`` (as ``shardwise_meta``): ``init`` makes each layer's full parameters on
  every rank, one layer at a time, so no rank holds the user's model beside the state's.

The bf16 rows, compute in bfloat16 with float32 master weights and float32 gradient reductions,
each against the other (``ratio_to_fsdp2`` is to FSDP2's bf16 row):

* ``fsdp2_meta_bf16``: ``fsdp2_meta`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)`` on every ``fully_shard``.
* ``shardwise_meta_bf16``: ``shardwise_meta`` under ``sw.mixed_precision(step,
  "params=f32,compute=bf16,output=bf16,reduce=f32")``.
* ``deepspeed_zero2_bf16``: ``deepspeed_zero2`` with ``"bf16": {"enabled": true}`` (the module's
  parameters in bfloat16 on every rank, float32 master weights partitioned with the optimizer state;
  inputs cast to bfloat16); ``ratio_to_deepspeed_zero2_bf16`` on the bf16 rows after it.
* ``shardwise_zero1_meta_bf16``, ``shardwise_zero2_meta_bf16``: ``shardwise_zero1_meta`` /
  ``shardwise_zero2_meta`` under that policy.
* ``shardwise_meta_kept``, ``shardwise_meta_bf16_kept``: ``shardwise_meta`` / ``shardwise_meta_bf16``
  with ``reshard_after_forward=False`` (each layer gathered once a step and kept from its forward to
  its backward: in bf16, the layout DeepSpeed's bf16 ZeRO-2 has in memory).

Every row's loss is the MSE in float32 (the bf16 rows' outputs cast up first).

Output: one JSON line per (width, world, variant) with ``init_peak_bytes`` and
``peak_bytes`` (VmHWM above the baseline, the largest over ranks; shardwise's rows also
``step_peak_bytes``, the steps' own peak from the same baseline), ``model_bytes`` (the full
model's parameters), ``ratio_to_fsdp2`` (peak over FSDP2's peak at that world),
``plan_peak_bytes`` (the Plan's predicted peak for shardwise ZeRO-3 there, on every row but
``shardwise_zero1/2``'s, which carry their own stage's), ``ratio_to_ddp`` (peak over DDP's, where
DDP ran), and for shardwise the Plan's figures for rank 0 (``plan``: params, grads, opt_state, gathered_peak,
reduce_buffers, comm_buffers, each at its own peak, ``held_in_step``, the most those three and the
gradient shards made so far hold together at one action, kept_for_backward, loss_buffers, and ``peak``, the
Plan's prediction of the peak: params + opt_state + the most held_in_step's parts and the activations hold
together at one action).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
from dataclasses import dataclass
from typing import Any

import seed_systems
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import add_out_flag, environment, json_lines, note
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, PeakRSS

VARIANTS = ("fsdp2_meta", "fairscale_fsdp", "deepspeed_zero3_init", "deepspeed_zero3", "shardwise_meta",
            "shardwise_meta_functional", "shardwise_eager", "ddp", "fairscale_oss", "deepspeed_zero2",
            "shardwise_zero1", "shardwise_zero2", "shardwise_zero1_meta", "shardwise_zero2_meta",
            "fsdp2_meta_bf16", "shardwise_meta_bf16", "deepspeed_zero2_bf16", "shardwise_zero1_meta_bf16",
            "shardwise_zero2_meta_bf16", "shardwise_meta_kept", "shardwise_meta_bf16_kept")
# ZeRO-3 rows with reshard_after_forward=False (each layer gathered once a step, kept to its backward).
KEPT = ("shardwise_meta_kept", "shardwise_meta_bf16_kept")
# A shardwise variant's ZeRO stage (3 if not here).
STAGE = {"shardwise_zero1": 1, "shardwise_zero2": 2, "shardwise_zero1_meta": 1, "shardwise_zero2_meta": 2,
         "shardwise_zero1_meta_bf16": 1, "shardwise_zero2_meta_bf16": 2}
# The bf16 rows: compute in bfloat16, float32 master weights, gradients reduced in float32 (FSDP2's
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)); their ratio is to FSDP2's bf16 row.
BF16 = ("fsdp2_meta_bf16", "shardwise_meta_bf16", "deepspeed_zero2_bf16", "shardwise_zero1_meta_bf16",
        "shardwise_zero2_meta_bf16", "shardwise_meta_bf16_kept")
BF16_POLICY = "params=f32,compute=bf16,output=bf16,reduce=f32"
# --models: the two sizes of issue 25, as Linear widths (12 layers).
MODEL_WIDTHS = {"200mb": 2048, "800mb": 4096}
ADAMW = seed_systems.AdamW(1e-3, (0.9, 0.999), 1e-8, 0.01)  # torch.optim.AdamW's defaults, as the others


@dataclass(frozen=True)
class Config:
    width: int
    layers: int
    batch: int
    steps: int
    world: int


def build(cfg: Config) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])


def batch_of(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(cfg.batch, cfg.width, generator=gen), torch.randn(cfg.batch, cfg.width, generator=gen)


def train_torch(cfg: Config, peak: PeakRSS, model: nn.Module, rows: Any) -> dict[str, Any]:
    """``cfg.steps`` steps of a plain torch loop with ``torch.optim.AdamW`` on ``rows()`` (made after
    init's peak is read): init's and the run's peaks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_peak = peak.peak()
    x, y = rows()
    for _ in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        mse_f32(model(x), y).backward()
        opt.step()
    return {"init_peak_bytes": init_peak, "peak_bytes": peak.peak()}


def mse_f32(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The MSE loss in float32, whatever the model's output dtype (bf16 under the bf16 rows)."""
    return F.mse_loss(out.float(), target)


def one_process(cfg: Config) -> dict[str, Any]:
    peak = PeakRSS()
    return train_torch(cfg, peak, build(cfg), lambda: batch_of(cfg))


def fsdp2_model(cfg: Config, before_shard: Any = None, bf16: bool = False) -> nn.Sequential:
    """The model built on meta, ``fully_shard`` per Linear and whole, materialized and initialized
    (FSDP2's meta-device recipe); ``before_shard(i, layer)`` runs on each layer before its shard;
    ``bf16``: with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (cfg.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    with torch.device("meta"):
        model = build(cfg)
    for i, layer in enumerate(model):
        if before_shard is not None:
            before_shard(i, layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    for layer in model:
        assert isinstance(layer, nn.Linear)
        layer.reset_parameters()
    return model


def fsdp2_meta(cfg: Config) -> dict[str, Any]:
    peak = PeakRSS()
    return train_torch(cfg, peak, fsdp2_model(cfg), lambda: local_rows(cfg))


def fsdp2_meta_bf16(cfg: Config) -> dict[str, Any]:
    peak = PeakRSS()
    return train_torch(cfg, peak, fsdp2_model(cfg, bf16=True), lambda: local_rows(cfg))


def local_rows(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the batch (the torch-style systems step on their slice)."""
    x, y = batch_of(cfg)
    rows, rank = cfg.batch // cfg.world, dist.get_rank()
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def train_seed_system(cfg: Config, peak: PeakRSS, trainer: seed_systems.Trainer) -> dict[str, Any]:
    init_peak = peak.peak()
    x, y = local_rows(cfg)
    for _ in range(cfg.steps):
        trainer.step(x, y)
    return {"init_peak_bytes": init_peak, "peak_bytes": peak.peak()}


def seed_system_on_whole_model(cfg: Config, system: str, bf16: bool = False) -> dict[str, Any]:
    """``system`` on the model built whole on every rank (seeded), as each keeps what it keeps of it."""
    peak = PeakRSS()
    torch.manual_seed(0)
    model = build(cfg)
    trainer = seed_systems.build(system, model, list(model), mse_f32, ADAMW, cfg.batch // cfg.world, bf16=bf16)
    del model
    gc.collect()
    return train_seed_system(cfg, peak, trainer)


def fairscale_fsdp(cfg: Config) -> dict[str, Any]:
    """FairScale's FSDP has no meta-device init: every rank builds the whole model, FSDP keeps its shard."""
    return seed_system_on_whole_model(cfg, "fairscale_fsdp")


def fairscale_oss(cfg: Config) -> dict[str, Any]:
    return seed_system_on_whole_model(cfg, "fairscale_oss")


def deepspeed_zero2(cfg: Config) -> dict[str, Any]:
    return seed_system_on_whole_model(cfg, "deepspeed_zero2")


def deepspeed_zero2_bf16(cfg: Config) -> dict[str, Any]:
    return seed_system_on_whole_model(cfg, "deepspeed_zero2", bf16=True)


def ddp(cfg: Config) -> dict[str, Any]:
    """torch's DistributedDataParallel with its defaults, on the model built whole on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    peak = PeakRSS()
    torch.manual_seed(0)
    return train_torch(cfg, peak, DistributedDataParallel(build(cfg)), lambda: local_rows(cfg))


def deepspeed_zero3(cfg: Config, zero_init: bool) -> dict[str, Any]:
    """DeepSpeed ZeRO-3, the model built inside ``zero.Init`` (partitioned as it is made) or whole."""
    micro_batch = cfg.batch // cfg.world
    peak = PeakRSS()
    torch.manual_seed(0)
    if zero_init:
        with seed_systems.deepspeed_zero3_init(ADAMW, micro_batch):
            model = build(cfg)
    else:
        model = build(cfg)
    trainer = seed_systems.build("deepspeed_zero3", model, list(model), F.mse_loss, ADAMW, micro_batch)
    del model
    gc.collect()
    return train_seed_system(cfg, peak, trainer)


def deepspeed_zero3_init(cfg: Config) -> dict[str, Any]:
    return deepspeed_zero3(cfg, zero_init=True)


def deepspeed_zero3_eager(cfg: Config) -> dict[str, Any]:
    return deepspeed_zero3(cfg, zero_init=False)


def shardwise_step(cfg: Config, meta: bool, inplace: bool = True, stage: int = 3,
                   policy: str | None = None, kept: bool = False) -> tuple[sw.Step, Any]:
    """(the step, its parameters): ``shard_params`` at ``stage``, under ``policy`` when given;
    ``kept``: ``reshard_after_forward=False``."""
    if meta:
        with torch.device("meta"):
            model = build(cfg)
    else:
        torch.manual_seed(0)  # every rank builds the same weights (init checks that they agree)
        model = build(cfg)
    chain, params = sw.functionalize(model)
    optimizer = sw.optim.adamw(1e-3, inplace=inplace)
    options = {"reshard_after_forward": False} if kept else {}
    step = sw.shard_params(sw.train_step(chain, mse_f32, optimizer), "dp", stage=stage, **options)
    return (step if policy is None else sw.mixed_precision(step, policy)), params


def shardwise_zero(cfg: Config, meta: bool, inplace: bool = True, stage: int = 3,
                   policy: str | None = None, kept: bool = False) -> dict[str, Any]:
    peak = PeakRSS()
    step, params = shardwise_step(cfg, meta, inplace, stage, policy, kept)
    mesh = sw.Mesh(dp=cfg.world)
    state = step.init(params, mesh)
    del params
    gc.collect()
    init_peak = peak.peak()
    stepping = PeakRSS()  # the high-water mark reset: the steps' own peak, from the same baseline
    batch = batch_of(cfg)
    for _ in range(cfg.steps):
        state, _ = step(state, batch)
    step_peak = stepping.peak() + stepping.base - peak.base
    return {"init_peak_bytes": init_peak, "step_peak_bytes": step_peak, "peak_bytes": max(init_peak, step_peak)}


def shardwise_meta(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True)


def shardwise_eager(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=False)


def shardwise_meta_bf16(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, policy=BF16_POLICY)


def shardwise_meta_functional(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, inplace=False)


def shardwise_zero1(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=False, stage=1)


def shardwise_zero2(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=False, stage=2)


def shardwise_zero1_meta(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, stage=1)


def shardwise_zero2_meta(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, stage=2)


def shardwise_meta_kept(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, kept=True)


def shardwise_meta_bf16_kept(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, policy=BF16_POLICY, kept=True)


def shardwise_zero1_meta_bf16(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, stage=1, policy=BF16_POLICY)


def shardwise_zero2_meta_bf16(cfg: Config) -> dict[str, Any]:
    return shardwise_zero(cfg, meta=True, stage=2, policy=BF16_POLICY)


def plan_figures(cfg: Config, inplace: bool = True, stage: int = 3, policy: str | None = None,
                 kept: bool = False) -> dict[str, int]:
    """The Plan's memory figures for rank 0 (made here, on meta parameters: no data), with the
    optimizer the measured step uses (an out-of-place update allocates new parameters and moments)."""
    step, params = shardwise_step(cfg, True, inplace, stage, policy, kept)
    x, y = batch_of(cfg)
    plan = step.plan(sw.Mesh(dp=cfg.world), params, (x, y))
    return {key: int(per_rank[0]) for key, per_rank in plan.memory.items()}


PROGRAMS = {
    "fsdp2_meta": fsdp2_meta,
    "fairscale_fsdp": fairscale_fsdp,
    "deepspeed_zero3_init": deepspeed_zero3_init,
    "deepspeed_zero3": deepspeed_zero3_eager,
    "shardwise_meta": shardwise_meta,
    "shardwise_meta_functional": shardwise_meta_functional,
    "shardwise_eager": shardwise_eager,
    "ddp": ddp,
    "fairscale_oss": fairscale_oss,
    "deepspeed_zero2": deepspeed_zero2,
    "shardwise_zero1": shardwise_zero1,
    "shardwise_zero2": shardwise_zero2,
    "shardwise_zero1_meta": shardwise_zero1_meta,
    "shardwise_zero2_meta": shardwise_zero2_meta,
    "fsdp2_meta_bf16": fsdp2_meta_bf16,
    "shardwise_meta_bf16": shardwise_meta_bf16,
    "deepspeed_zero2_bf16": deepspeed_zero2_bf16,
    "shardwise_zero1_meta_bf16": shardwise_zero1_meta_bf16,
    "shardwise_zero2_meta_bf16": shardwise_zero2_meta_bf16,
    "shardwise_meta_kept": shardwise_meta_kept,
    "shardwise_meta_bf16_kept": shardwise_meta_bf16_kept,
}


def warmed(program: Any, cfg: Config) -> dict[str, Any]:
    """``program(cfg)`` after a run of it on a tiny model: the imports and one-time setup its
    code path does on first use (tens of MB: torch.fx, FSDP's modules) are not the model's.

    What is alive before the measured run is frozen out of the garbage collector's reach for its
    length: the runs' ``gc.collect()`` calls (before each reading) then walk only what the variant
    made, not the million objects of torch's and the seed systems' imports (170 ms a call)."""
    gc.collect()
    gc.freeze()
    try:
        program(dataclasses.replace(cfg, width=8, batch=cfg.world * 2, steps=1))
        gc.collect()
        gc.freeze()
        return program(cfg)
    finally:
        gc.unfreeze()


def run(cfg: Config, variant: str, pool: ProcessPool | None = None) -> dict[str, Any]:
    """The variant on a fresh pool of ``cfg.world`` processes, or on ``pool`` where one is given."""
    program = one_process if variant == "one_process" else PROGRAMS[variant]
    if pool is None:
        with ProcessPool(cfg.world, timeout=1800) as fresh:
            per_rank = fresh.run(warmed, program, cfg)
    else:
        per_rank = pool.run(warmed, program, cfg)
    row = {
        "init_peak_bytes": max(r["init_peak_bytes"] for r in per_rank),
        "peak_bytes": max(r["peak_bytes"] for r in per_rank),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
    }
    if "step_peak_bytes" in per_rank[0]:
        row["step_peak_bytes"] = max(r["step_peak_bytes"] for r in per_rank)
    return row


SEED_SYSTEM_OF = {"fairscale_fsdp": "fairscale_fsdp", "deepspeed_zero3_init": "deepspeed_zero3",
                  "deepspeed_zero3": "deepspeed_zero3", "fairscale_oss": "fairscale_oss",
                  "deepspeed_zero2": "deepspeed_zero2", "deepspeed_zero2_bf16": "deepspeed_zero2"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="200mb",
                        help="comma-separated: 200mb (12 x Linear(2048), 201 MB), 800mb (12 x Linear(4096), 805 MB); "
                             "default 200mb")
    parser.add_argument("--widths", help="comma-separated Linear widths instead of --models")
    parser.add_argument("--layers", type=int, default=12, help="Linear layers (default 12)")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--batch", type=int, default=32, help="global batch rows (default 32)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per variant (default 2)")
    parser.add_argument("--variants", default=",".join(("one_process", *VARIANTS)),
                        help="comma-separated subset of one_process," + ",".join(VARIANTS)
                             + " (default all; fsdp2_meta, the ratios' reference, always runs, and "
                               "fsdp2_meta_bf16 with a bf16 row)")
    parser.add_argument("--pools", choices=("variant", "world"), default="variant",
                        help="variant: a fresh pool of processes per variant, so that none inherits another's "
                             "memory; world: one pool per world for all its variants (a smoke run: start-up "
                             "costs less, the figures are not comparable) (default: variant)")
    add_out_flag(parser)
    args = parser.parse_args()
    if args.widths:
        args.widths = [int(w) for w in args.widths.split(",")]
    else:
        unknown = sorted(set(args.models.split(",")) - set(MODEL_WIDTHS))
        if unknown:
            parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODEL_WIDTHS)}")
        args.widths = [MODEL_WIDTHS[m] for m in args.models.split(",")]
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - {"one_process", *VARIANTS})
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from one_process, {', '.join(VARIANTS)}")
    args.one_process = "one_process" in chosen
    bf16 = any(v in chosen for v in BF16)  # then FSDP2's bf16 row too: their ratios' reference
    args.variants = [v for v in VARIANTS if v in chosen or v == "fsdp2_meta" or (bf16 and v == "fsdp2_meta_bf16")]
    return args


def measured(cfg: Config, variant: str, pool: ProcessPool | None = None) -> dict[str, Any]:
    """``run(cfg, variant, pool)``, or why it did not run: its package is missing, or it failed (the error)."""
    system = SEED_SYSTEM_OF.get(variant)
    reason = seed_systems.missing(system) if system else None
    if reason is not None:
        return {"skipped": reason}
    try:
        return run(cfg, variant, pool)
    except sw.collectives.RankFailed as exc:  # one system failing must not lose the others' rows
        return {"failed": str(exc).splitlines()[0]}


def main() -> None:
    args = parse_args()
    os.environ.update(LIVE_MALLOC)  # the ranks start with it (glibc reads it at process start)
    stated = {"malloc": "128KiB thresholds", "pools": args.pools}
    with json_lines(args.out) as emit:
        for width in args.widths:
            model_bytes = args.layers * (width * width + width) * 4
            if args.one_process:
                base = Config(width, args.layers, args.batch, args.steps, 1)
                row = {"bench": "memory", "variant": "one_process", "width": width, "world": 1,
                       "model_bytes": model_bytes, **run(base, "one_process")}
                emit({**row, **environment(), **stated})
            for world in (int(w) for w in args.worlds.split(",")):
                cfg = Config(width, args.layers, args.batch, args.steps, world)
                # shardwise's prediction (in-place AdamW), beside every system's measurement; the
                # functional variant's own beside it.
                plans = {(True, 3): plan_figures(cfg), (False, 3): plan_figures(cfg, inplace=False)}
                plans.update({(True, s): plan_figures(cfg, stage=s) for v, s in STAGE.items()
                              if v in args.variants and v not in BF16})
                plans.update({("bf16", s): plan_figures(cfg, stage=s, policy=BF16_POLICY) for s in (1, 2, 3)
                              if any(v in args.variants and STAGE.get(v, 3) == s for v in BF16)})
                plans.update({("kept", bf16): plan_figures(cfg, policy=BF16_POLICY if bf16 else None, kept=True)
                              for bf16 in (False, True) if KEPT[bf16] in args.variants})
                fsdp2 = fsdp2_bf16 = ddp_peak = deepspeed_bf16 = None
                shared = ProcessPool(world, timeout=1800) if args.pools == "world" else None
                with shared or contextlib.nullcontext():
                    for variant in args.variants:
                        note(f"# width {width}, world {world}: {variant}")
                        plan = plans[("kept", variant in BF16)] if variant in KEPT else \
                            plans[("bf16" if variant in BF16 else variant != "shardwise_meta_functional",
                                   STAGE.get(variant, 3))]
                        result = measured(cfg, variant, shared)
                        row = {"bench": "memory", "variant": variant, "width": width, "world": world,
                               "model_bytes": model_bytes, **result, "plan_peak_bytes": plan["peak"]}
                        if "peak_bytes" in result:
                            fsdp2 = fsdp2 or (result["peak_bytes"] if variant == "fsdp2_meta" else None)
                            fsdp2_bf16 = fsdp2_bf16 or (result["peak_bytes"] if variant == "fsdp2_meta_bf16" else None)
                            reference = fsdp2_bf16 if variant in BF16 else fsdp2
                            row["ratio_to_fsdp2"] = round(result["peak_bytes"] / reference, 3) if reference else None
                            ddp_peak = ddp_peak or (result["peak_bytes"] if variant == "ddp" else None)
                            if ddp_peak:  # (ddp comes after the ZeRO-3 rows and before the ZeRO-1/2 ones)
                                row["ratio_to_ddp"] = round(result["peak_bytes"] / ddp_peak, 3)
                            deepspeed_bf16 = deepspeed_bf16 or \
                                (result["peak_bytes"] if variant == "deepspeed_zero2_bf16" else None)
                            if deepspeed_bf16 and variant in BF16:  # (before the shardwise ZeRO-1/2 bf16 rows)
                                row["ratio_to_deepspeed_zero2_bf16"] = round(result["peak_bytes"] / deepspeed_bf16, 3)
                        if variant.startswith("shardwise"):
                            row["plan"] = plan
                        emit({**row, **environment(), **stated})


if __name__ == "__main__":
    main()
