"""shard_params (ZeRO-1/2/3) against torch's DDP and FSDP2, FairScale and DeepSpeed, side by side on gloo processes.

Run it from the repository root:

    python benchmarks/shard_params.py                      # defaults: a few minutes on 2 cores
    python benchmarks/shard_params.py --steps 30 --warmup 5 --worlds 2,4 --models mlp,gpt --out bench.jsonl
    python benchmarks/shard_params.py --models gpt --worlds 2 --profile stage3   # + a cProfile of rank 0

What is measured
----------------
Models: ``mlp`` is 8 x (Linear(512, 512), GELU) with an MSE regression loss;
``gpt`` is ``TinyGPT(vocab=1024, d_model=256, n_heads=4, n_layers=4,
seq_len=128)`` with cross-entropy, functionalized with ``units=["tok_emb",
"blocks", "head"]`` (the head is tied to the token embedding).

Variants, all with AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay
0.01), the same initial weights and the same global batches:

* ``stage1`` / ``stage2`` / ``stage3``: ``sw.shard_params(step, "dp", stage)``
  with ``sw.optim.adamw``. Every rank is given the global batch and slices it
  itself.
* ``stage1_update_in_buckets`` / ``stage2_update_in_buckets``: as ``stage1`` / ``stage2`` with
  ``update_in_buckets=True``: the update runs bucket by bucket, each bucket's all-gather issued
  as soon as its shards are updated (a CPU's default updates at once, then issues the
  all-gathers); ``paired_ratio_to_at_once`` is its step over ``stage1`` / ``stage2``'s.
* ``stage1_overlap`` / ``stage2_overlap`` and ``stage1_wait`` / ``stage2_wait``: as ``stage1`` /
  ``stage2`` with ``overlap_gather=True`` (the all-gathers of the updated shards left in flight
  into the next step's forward) and ``False`` (waited for at the step's end, as the CPU's
  default does); ``paired_ratio_to_wait`` (on the ``*_overlap`` rows) is the overlapped step over
  the waiting one (``*_wait``, else the plain stage). Run with
  ``--block K`` (K consecutive steps per variant and turn, timed together, the last waiting for
  what it left in flight): stepped one at a time between the other variants' steps and
  barriers, the overlapped gather would complete during theirs, unpaid.
* ``stage1_ring`` / ``stage2_ring`` / ``stage3_ring``: the stage on gloo's own collectives (its
  reduce-scatter run as an all-reduce ring, its all-gather) instead of the direct exchanges a CPU
  runs by default (``collectives/backends/gloo_exchange.py``); ``paired_ratio_to_ring`` (on the
  plain stage's row) is the default's step over this one's.
* ``stage1_beside`` / ``stage2_beside``: as ``stage1`` / ``stage2`` with
  ``gather_into_params=False``: the gathered buffers handed on beside the parameters the step was
  given, instead of copied into them one bucket at a time (what the in-place AdamW here does by
  default); ``paired_ratio_to_beside`` (on the plain stage's row) is the default's step over this one's.
* ``stage3_prefetch2``: ZeRO-3 with ``prefetch=2`` (each compute's units gathered two computes
  ahead instead of one); ``paired_ratio_to_prefetch1`` is its step over ``stage3``'s.
* ``stage1_bf16`` / ``stage2_bf16`` / ``stage3_bf16``, ``fsdp2_bf16``, ``deepspeed_zero2_bf16`` /
  ``deepspeed_zero3_bf16``: compute in bfloat16 over float32 master weights, gradients reduced in
  bfloat16, each system's default under bf16: ours under ``sw.mixed_precision(step,
  "params=f32,compute=bf16,output=bf16,reduce=bf16")`` (ZeRO-1/2 hold only the rank's float32 shards
  there and gather each unit in bf16 before its forward), FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, DeepSpeed with ``"bf16": {"enabled": true}``.
  Every row's loss is taken in float32. ``paired_ratio_to_fsdp2_bf16`` and
  ``paired_ratio_to_deepspeed_zero2_bf16`` compare them with the bf16 references (FSDP2's bf16 row
  runs whenever a ``*_bf16`` row does). Their ``max_rel_loss_diff`` and ``update_check`` are against
  the float32 reference, so bf16's rounding shows there. Not in the default run.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with no buffer sync per
  forward (``forward_sync_buffers=False``; the only buffer, GPT's causal mask,
  is constant) + ``torch.optim.AdamW``.
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block (GPT) or
  every Linear (MLP), then on the root, on a CPU device mesh + ``torch.optim.AdamW``.
  Torch ranks take their slice of the global batch.
* ``compute_only``: each rank's slice through the plain module and ``torch.optim.AdamW``, nothing
  exchanged. Not data parallel (the ranks' weights drift apart; its loss fields are ``null``): the
  step's computation alone, the floor under every variant here, since each computes at least this.
  ``paired_ratio_to_fsdp2`` of this row bounds from below what any data-parallel system can reach
  on these ranks. Not in the default run.
* ``fairscale_fsdp`` (FairScale's FSDP, wrapped as FSDP2 is), ``fairscale_oss`` (FairScale's
  OSS optimizer + ShardedDDP), ``deepspeed_zero2`` / ``deepspeed_zero3`` (DeepSpeed's engine),
  each with ``torch.optim.AdamW``, stepped on its slice as torch's are; built by
  ``seed_systems.py``, which says what each needs on CPU. Optional: a system whose package is
  not installed is a ``skipped`` row. ``--variants`` runs a subset (FSDP2 always runs).

Every world runs in one :class:`~shardwise.collectives.processes.ProcessPool`
(gloo, one process per rank, ``torch.set_num_threads(1)`` in each). Inside a
rank all the variants are built and stepped round-robin (step i of every
variant, then step i + 1 ...), so they share the same machine conditions and
slow drift hits them alike. Each step starts after a ``dist.barrier()``.

How to read the output
----------------------
One JSON object per (model, world, variant) on stdout (and in ``--out``):

* ``median_step_s``: median over the ``steps`` timed steps (after ``warmup``
  untimed ones) of the slowest rank's wall time for that step.
  ``ratio_to_fsdp2`` is that median divided by FSDP2's (> 1: slower than FSDP2);
  ``paired_ratio_to_fsdp2`` the median over rounds of the step's time over FSDP2's step of the
  same round (load that drifts during the run cancels; the figure to compare);
  ``paired_ratio_to_ddp`` and ``paired_ratio_to_compute_only`` the same over DDP's and over
  ``compute_only``'s step, where those ran.
* ``model_state_bytes_per_rank``: parameters + optimizer state held by one
  rank at rest (largest over ranks). Ours: ``tree_nbytes(state.params) +
  tree_nbytes(state.opt_state)``; FSDP2: the local shards of the parameters
  and optimizer state tensors; DDP: full parameters + full optimizer state.
  Gradients and gathered (transient) parameters are not counted.
* ``ledger_sent_bytes_per_step``: ours only; the bytes this rank sends in one
  step as recorded by ``sw.collectives.comm_ledger()`` (largest over ranks). ``null`` for torch.
* ``max_rel_loss_diff``: the largest ``|loss - ref| / |ref|`` over all steps
  (warm-up included) against a single-process torch run of the same model,
  batches and ``torch.optim.AdamW``. float32, so expect ~1e-6, not 0.
* ``update_check``: ``|loss_1 - ref_1| / |untrained_1 - ref_1|``, where ``untrained_1`` is
  batch 1's loss under the initial weights: about 0 for a variant whose first update is
  torch's, 1 for one whose step changes nothing (so that a no-op cannot pass for fast).
* ``cores``: ``os.cpu_count()``. With ``world > cores`` the ranks
  oversubscribe the CPU and step times measure contention as much as the method.
  ``loadavg_1m`` is the machine's load when the line was written: if it is
  well above ``cores``, something else was running and the absolute times are
  inflated (the ratios less so: the variants are interleaved step by step).
* ``skipped``: present (with the reason) instead of timings when a variant
  could not be built here (an older torch; FairScale or DeepSpeed not installed).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import seed_systems
import torch
import torch.distributed as dist
from _common import (
    BETAS,
    EPS,
    GPT_UNITS,
    LR,
    WEIGHT_DECAY,
    add_batch_flags,
    add_malloc_flag,
    add_out_flag,
    add_run_flags,
    environment,
    loss_fn_of,
    make_batches,
    max_rel_diff,
    median_of_max,
    note,
    paired_ratio_median,
    profile_steps,
    reference_losses,
    round_robin,
    run_on_ranks,
    seeded_model,
    sw_adamw,
    sweep,
    torch_adamw,
)
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.gloo_exchange import gloos_own_collectives
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.collectives.backends.shared_memory_exchange import loopback_exchanges
from shardwise.engine.layout.in_flight import InFlightParams
from shardwise.engine.layout.state import tree_nbytes
from shardwise.testing.models import TinyGPT

# ``*_update_in_buckets``: ZeRO-1/2 updating bucket by bucket, each bucket's all-gather issued after its
# update (``update_in_buckets=True``), against the CPU's default of one update, then the all-gathers.
IN_BUCKETS = "_update_in_buckets"
# ``*_overlap``: ZeRO-1/2 leaving the all-gathers of the updated shards in flight into the next forward
# (``overlap_gather=True``), against ``*_wait`` (``False``) or the CPU's default, which waits at the step's end.
OVERLAP, WAIT = "_overlap", "_wait"
# ``*_ring``: the same step on gloo's own collectives (its reduce-scatter an all-reduce ring, its
# all-gather), against the direct exchanges a CPU's gloo runs by default (collectives/backends/gloo_exchange.py).
RING = "_ring"
# ``*_tcp``: the direct exchanges over gloo's loopback TCP, against shared memory, which the exchanges
# of ranks on one host take by default (collectives/backends/shared_memory_exchange.py).
TCP = "_tcp"
# ``*_beside``: the gathered buffers handed on beside the parameters (``gather_into_params=False``),
# against the default with the in-place AdamW, which copies each bucket into them.
BESIDE = "_beside"
# ``stage3_prefetch2``: ZeRO-3 gathering two units ahead of the compute (``prefetch=2``), against the default 1.
PREFETCH2 = "_prefetch2"
OURS = ("stage1", "stage2", "stage3", f"stage1{IN_BUCKETS}", f"stage2{IN_BUCKETS}",
        f"stage1{OVERLAP}", f"stage2{OVERLAP}", f"stage1{WAIT}", f"stage2{WAIT}",
        f"stage1{RING}", f"stage2{RING}", f"stage3{RING}", f"stage1{TCP}", f"stage2{TCP}", f"stage3{TCP}",
        f"stage1{BESIDE}", f"stage2{BESIDE}", f"stage3{PREFETCH2}")
# ``*_bf16``: compute in bfloat16 over float32 master weights, gradients reduced in bfloat16 (each system's
# default under bf16: ours ``mixed_precision(step, BF16_POLICY)``; FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``;
# DeepSpeed ``"bf16": {"enabled": true}``); each row's loss in float32.
BF16 = "_bf16"
BF16_POLICY = "params=f32,compute=bf16,output=bf16,reduce=bf16"
OURS_BF16 = ("stage1_bf16", "stage2_bf16", "stage3_bf16")
SEED_BF16 = ("deepspeed_zero2_bf16", "deepspeed_zero3_bf16")
BF16_REFERENCES = ("fsdp2_bf16", "deepspeed_zero2_bf16")  # a bf16 row's paired ratios, beside FSDP2's f32 one
# ``compute_only``: each rank's slice through the plain module and torch's AdamW, nothing exchanged. Not a
# data-parallel step (the ranks' weights drift apart, so its losses are not checked): the floor that a
# data-parallel step on these ranks could reach if its communication cost nothing.
COMPUTE_ONLY = "compute_only"
VARIANTS = (*OURS, *OURS_BF16, "ddp", "fsdp2", "fsdp2_bf16", *seed_systems.SYSTEMS, *SEED_BF16, COMPUTE_ONLY)


@dataclass(frozen=True)
class Config:
    """One (model, world) run; travels to every rank."""

    model: str
    world: int
    steps: int
    warmup: int
    batch: int  # global batch (MLP rows, GPT sequences)
    seed: int = 0
    profile: str | None = None  # a variant to cProfile on rank 0 after the timed steps
    profile_steps: int = 5
    variants: tuple[str, ...] = VARIANTS
    block: int = 1  # consecutive steps per variant and turn (_common.round_robin)


# -- models, data (shared with pipeline.py: _common) ------------------------------------------
def build_model(cfg: Config) -> nn.Module:
    """The model with its seeded initial weights (identical in every process); GPT's head is tied."""
    return seeded_model(cfg.model, cfg.seed)


def batches_of(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` global batches (inputs, targets), the same in every process."""
    return make_batches(cfg.model, cfg.batch, cfg.warmup + cfg.steps, cfg.seed)


# -- the variants, as seen from one rank ---------------------------------------------------
def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def local_slice(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    size = batch[0].shape[0] // world
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


class Ours:
    """shard_params at one ZeRO stage; gets the global batch."""

    global_loss = True  # the step's loss metric is already the global mean

    def __init__(
        self, cfg: Config, stage: int, in_buckets: bool = False, overlap: bool | None = None, ring: bool = False,
        tcp: bool = False, beside: bool = False, prefetch: int | None = None, bf16: bool = False,
    ) -> None:
        self.ring, self.tcp = ring, tcp
        units = GPT_UNITS if cfg.model == "gpt" else None
        chain, params = sw.functionalize(build_model(cfg), units=units)
        step = sw.train_step(chain, loss_of(cfg.model, bf16), sw_adamw())
        if bf16:
            step = sw.mixed_precision(step, BF16_POLICY)
        self.step_fn = sw.shard_params(step, "dp", stage=stage, update_in_buckets=True if in_buckets else None,
                                       overlap_gather=overlap, gather_into_params=False if beside else None,
                                       **({} if prefetch is None else {"prefetch": prefetch}))
        self.state = self.step_fn.init(params, sw.Mesh(dp=cfg.world))

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with gloos_own_collectives() if self.ring else loopback_exchanges() if self.tcp else contextlib.nullcontext():
            self.state, metrics = self.step_fn(self.state, batch)
        return metrics["loss"].detach()

    def settle(self) -> None:
        """Wait for what the last step left in flight (ZeRO-1/2's all-gathers), as its next step would."""
        params = self.state.params
        if isinstance(params, InFlightParams):
            params.settle()

    def state_bytes(self) -> int:
        return tree_nbytes(self.state.params) + tree_nbytes(self.state.opt_state)


class TorchVariant:
    """A wrapped nn.Module (DDP or FSDP2) + torch.optim.AdamW; each rank steps on its slice."""

    global_loss = False  # the loss is this rank's slice mean; averaged over ranks afterwards

    def __init__(self, cfg: Config, module: nn.Module, bf16: bool = False) -> None:
        self.module, self.loss_fn = module, loss_of(cfg.model, bf16)
        self.opt = torch_adamw(module.parameters())
        self.rank, self.world = dist.get_rank(), cfg.world

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = local_slice(batch, self.rank, self.world)
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.module(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def state_bytes(self) -> int:
        params = sum(local_nbytes(p) for p in self.module.parameters())
        opt = sum(local_nbytes(t) for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t))
        return params + opt


def make_ddp(cfg: Config) -> TorchVariant:
    from torch.nn.parallel import DistributedDataParallel

    # No buffer sync per forward (GPT's causal mask is constant); torch 2.13 renamed the option.
    accepted = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in accepted else {"broadcast_buffers": False}
    return TorchVariant(cfg, DistributedDataParallel(build_model(cfg), **no_sync))


def make_fsdp2(cfg: Config, bf16: bool = False) -> TorchVariant:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (cfg.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    model = build_model(cfg)
    if cfg.model == "gpt":
        assert isinstance(model, TinyGPT)
        parts: list[nn.Module] = list(model.blocks)
    else:
        parts = [m for m in model if isinstance(m, nn.Linear)]
    for part in parts:
        fully_shard(part, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return TorchVariant(cfg, model, bf16)


class SeedVariant:
    """FairScale or DeepSpeed (:mod:`seed_systems`); each rank steps on its slice, as torch's do."""

    global_loss = False

    def __init__(self, cfg: Config, system: str, bf16: bool = False) -> None:
        model = build_model(cfg)
        units = list(model.blocks) if isinstance(model, TinyGPT) else [m for m in model if isinstance(m, nn.Linear)]
        self.trainer = seed_systems.build(system, model, units, loss_of(cfg.model, bf16),
                                          seed_systems.AdamW(LR, BETAS, EPS, WEIGHT_DECAY), cfg.batch // cfg.world,
                                          bf16=bf16)
        self.rank, self.world = dist.get_rank(), cfg.world

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.trainer.step(*local_slice(batch, self.rank, self.world))

    def state_bytes(self) -> int:
        return self.trainer.state_bytes()


Runner = Ours | TorchVariant | SeedVariant


def loss_of(model: str, bf16: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's loss; a bf16 row's in float32 (its bfloat16 output cast up first)."""
    loss = loss_fn_of(model)
    return (lambda out, target: loss(out.float(), target)) if bf16 else loss


def make_variant(name: str, cfg: Config) -> Runner:
    if name in OURS_BF16:
        return Ours(cfg, stage=int(name.removesuffix(BF16)[-1]), bf16=True)
    if name in SEED_BF16:
        return SeedVariant(cfg, name.removesuffix(BF16), bf16=True)
    if name == "fsdp2_bf16":
        return make_fsdp2(cfg, bf16=True)
    if name in OURS:
        stage = int(name.removesuffix(IN_BUCKETS).removesuffix(OVERLAP).removesuffix(WAIT).removesuffix(RING)
                    .removesuffix(TCP).removesuffix(BESIDE).removesuffix(PREFETCH2)[-1])
        overlap = True if name.endswith(OVERLAP) else False if name.endswith(WAIT) else None
        return Ours(cfg, stage=stage, in_buckets=name.endswith(IN_BUCKETS), overlap=overlap, ring=name.endswith(RING),
                    tcp=name.endswith(TCP), beside=name.endswith(BESIDE),
                    prefetch=2 if name.endswith(PREFETCH2) else None)
    if name in seed_systems.SYSTEMS:
        return SeedVariant(cfg, name)
    if name == COMPUTE_ONLY:
        return TorchVariant(cfg, build_model(cfg))
    return {"ddp": make_ddp, "fsdp2": make_fsdp2}[name](cfg)


# -- what runs on every rank ----------------------------------------------------------------
def bench_rank(cfg: Config) -> dict[str, Any]:
    """Build every variant, step them round-robin, return per-variant timings, losses, bytes."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    batches = batches_of(cfg)
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    for name in cfg.variants:
        try:
            runners[name] = make_variant(name, cfg)
        except Exception as exc:  # the same refusal on every rank (a missing package, an old torch)
            skipped[name] = f"{type(exc).__name__}: {exc}"
    ledger_bytes: dict[str, int] = {}

    def step(name: str, i: int, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        runner = runners[name]
        if isinstance(runner, Ours) and i == cfg.warmup - 1:  # the ledger costs: the last warm-up step
            with sw.collectives.comm_ledger() as ledger:
                loss = runner.step(batch)
            ledger_bytes[name] = ledger.sent_bytes()
            return loss
        return runner.step(batch)

    def finish(name: str) -> None:
        runner = runners[name]
        if isinstance(runner, Ours):
            runner.settle()

    times, losses = round_robin(runners, batches, cfg.warmup, step, block=cfg.block,
                                finish=finish if cfg.block > 1 else None)
    result = {
        "times": times,
        "losses": {name: global_losses(runners[name], ls, cfg.world) for name, ls in losses.items()},
        "state_bytes": {name: r.state_bytes() for name, r in runners.items()},
        "ledger_bytes": ledger_bytes,
        "skipped": skipped,
    }
    if cfg.profile in runners:
        result["profile"] = profile_steps(runners[cfg.profile].step, batches, cfg.profile_steps, rank == 0,
                                          [("tottime", (25,)), ("cumulative", ("shardwise", 30))])
    return result


def global_losses(runner: Runner, losses: list[torch.Tensor], world: int) -> list[float]:
    """Per-step loss on the global batch: torch ranks average their slice means (equal slices)."""
    stacked = torch.stack([loss.float() for loss in losses])
    if not runner.global_loss:
        dist.all_reduce(stacked)
        stacked /= world
    return stacked.tolist()


# -- the parent: run, aggregate, print ---------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """The single-process torch run: every step's loss, and batch 1's loss before any update."""

    losses: list[float]
    untrained_loss_1: float

    def update_check(self, losses: list[float]) -> float:
        """How far step 1's loss is from torch's, relative to how far one update moved torch's:
        about 0 for a system that updates as torch does, 1 for one whose step changes nothing."""
        return abs(losses[1] - self.losses[1]) / abs(self.untrained_loss_1 - self.losses[1])


def reference_of(cfg: Config) -> Reference:
    batches = batches_of(cfg)
    with torch.no_grad():
        x, y = batches[1]
        untrained = loss_fn_of(cfg.model)(build_model(cfg)(x), y).item()
    return Reference(reference_losses(build_model(cfg), loss_fn_of(cfg.model), batches), untrained)


def rows_for(cfg: Config, per_rank: list[dict[str, Any]], ref: Reference) -> list[dict[str, Any]]:
    """One output object per variant, aggregated over ranks."""
    base = {
        "bench": "shard_params",
        "model": cfg.model,
        "world": cfg.world,
        "global_batch": cfg.batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        **environment(threads_per_rank=1),
    }
    first = per_rank[0]
    runs_ours = (*OURS, *OURS_BF16)
    medians = {name: median_of_max(r["times"][name] for r in per_rank) for name in first["times"]}
    rows = []
    for name in cfg.variants:
        if name in first["skipped"]:
            rows.append({**base, "variant": name, "skipped": first["skipped"][name]})
            continue
        fsdp2 = medians.get("fsdp2")
        losses = first["losses"][name]
        paired = (paired_ratio_median([r["times"][name] for r in per_rank], [r["times"]["fsdp2"] for r in per_rank])
                  if fsdp2 else None)
        rows.append({
            **base,
            "variant": name,
            "median_step_s": round(medians[name], 5),
            "ratio_to_fsdp2": round(medians[name] / fsdp2, 3) if fsdp2 else None,
            "paired_ratio_to_fsdp2": round(paired, 3) if paired else None,
            # the update by buckets over the same stage's update at once (when both ran): the pipeline's gain
            **({"paired_ratio_to_at_once": round(paired_ratio_median(
                [r["times"][name] for r in per_rank],
                [r["times"][name.removesuffix(IN_BUCKETS)] for r in per_rank]), 3)}
               if name.endswith(IN_BUCKETS) and name.removesuffix(IN_BUCKETS) in first["times"] else {}),
            # the overlapped all-gather over the same stage's waiting one (``*_wait``, else the CPU's default)
            **({"paired_ratio_to_wait": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][waiting_of(name, first["times"])] for r in per_rank]),
                3)} if name.endswith(OVERLAP) and waiting_of(name, first["times"]) else {}),
            # the direct exchanges (the stage's default on a CPU) over gloo's own collectives
            **({"paired_ratio_to_ring": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][name + RING] for r in per_rank]), 3)}
               if name + RING in first["times"] else {}),
            # the gathers copied into the parameters (the in-place optimizer's default) over handed on
            **({"paired_ratio_to_beside": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][name + BESIDE] for r in per_rank]), 3)}
               if name + BESIDE in first["times"] else {}),
            # the exchanges through shared memory (the default on one host) over loopback TCP
            **({"paired_ratio_to_tcp": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][name + TCP] for r in per_rank]), 3)}
               if name + TCP in first["times"] else {}),
            # the step over DDP's and over the computation alone, in the same rounds (when they ran)
            **{f"paired_ratio_to_{other}": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][other] for r in per_rank]), 3)
               for other in ("ddp", COMPUTE_ONLY, *(BF16_REFERENCES if name.endswith(BF16) else ()))
               if other in first["times"] and other != name},
            # ZeRO-3 prefetching two units over the default one
            **({"paired_ratio_to_prefetch1": round(paired_ratio_median(
                [r["times"][name] for r in per_rank], [r["times"][name.removesuffix(PREFETCH2)] for r in per_rank]),
                3)} if name.endswith(PREFETCH2) and name.removesuffix(PREFETCH2) in first["times"] else {}),
            "model_state_bytes_per_rank": max(r["state_bytes"][name] for r in per_rank),
            "ledger_sent_bytes_per_step": max(r["ledger_bytes"][name] for r in per_rank) if name in runs_ours else None,
            **({"max_rel_loss_diff": None, "update_check": None, "final_loss": None} if name == COMPUTE_ONLY else {
                "max_rel_loss_diff": max_rel_diff(losses, ref.losses),
                "update_check": float(f"{ref.update_check(losses):.3g}"),
                "final_loss": round(losses[-1], 5),
            }),
        })
    return rows


def waiting_of(name: str, ran: Any) -> str | None:
    """The variant an ``*_overlap`` one is paired with: its ``*_wait``, else its plain stage (on a
    CPU the default waits at the step's end), if it ran."""
    stage = name.removesuffix(OVERLAP)
    return next((v for v in (stage + WAIT, stage) if v in ran), None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, steps=8, warmup=2)
    add_batch_flags(parser)
    parser.add_argument("--variants",
                        default=",".join(v for v in VARIANTS
                                         if not v.endswith((IN_BUCKETS, OVERLAP, WAIT, RING, BESIDE, PREFETCH2, BF16))
                                         and v != COMPUTE_ONLY),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default all but the *{IN_BUCKETS}, "
                        f"*{OVERLAP}, *{WAIT}, *{RING}, *{BESIDE}, *{PREFETCH2}, *{BF16} and {COMPUTE_ONLY}; fsdp2 is "
                        "always run, and fsdp2_bf16 with any *_bf16 row)")
    parser.add_argument("--block", type=int, default=1,
                        help="consecutive steps per variant and turn, timed together (default 1: the variants "
                        "alternate step by step); > 1 charges ZeRO-1/2's overlapped all-gather to its own "
                        "variant (it would otherwise complete during the others' steps); --warmup and --steps "
                        "should be multiples of it")
    parser.add_argument("--profile", choices=VARIANTS, help="cProfile this variant on rank 0 (to stderr)")
    parser.add_argument("--profile-steps", type=int, default=5)
    add_malloc_flag(parser)
    add_out_flag(parser)
    args = parser.parse_args(argv)
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    # FSDP2 is the reference of every ratio; the order stays VARIANTS' (the round-robin's order).
    bf16 = any(v.endswith(BF16) for v in chosen)  # then FSDP2's bf16 row too: their second reference
    args.variants = tuple(v for v in VARIANTS if v in chosen or v == "fsdp2" or (bf16 and v == "fsdp2_bf16"))
    if args.block < 1:
        parser.error("--block must be >= 1")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--steps and --warmup must be >= 1 (a warm-up step carries the ledger)")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    refs: dict[str, Reference] = {}

    def measure(pool: ProcessPool, world: int, model: str, batch: int) -> list[dict[str, Any]]:
        cfg = Config(model, world, args.steps, args.warmup, batch,
                     profile=args.profile, profile_steps=args.profile_steps, variants=args.variants, block=args.block)
        if model not in refs:  # the reference does not depend on the world
            refs[model] = reference_of(cfg)
        per_rank = run_on_ranks(pool, bench_rank, cfg, label=f"{model}, world {world}")
        if per_rank[0].get("profile"):
            note(f"--- cProfile of {args.profile}, {model}, world {world}, rank 0 ---\n" + per_rank[0]["profile"])
        return rows_for(cfg, per_rank, refs[model])

    return sweep(args, measure)


if __name__ == "__main__":
    main()
