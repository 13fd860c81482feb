"""shard_params' spec: frozen data in the step's stack, and its lowering pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...engine.layout.buckets import bucket_units
from ...engine.plan.actions import Action
from ...engine.stack.compose import SHARDING
from .lowering import insert_gathers, insert_reduces

# Stages 1-2: the gradient bytes reduced in one collective. Not tuned yet (issue 27: the paired
# timings of the session that added it ran at a load of 40 on 2 cores, which drowned the
# differences). 4 MiB makes a few buckets of the benchmarks' models (the 8 MiB MLP: two), so the
# first is issued while the backward still runs; DDP's default is 25 MiB.
DEFAULT_BUCKET_MB = 4.0


@dataclass(frozen=True)
class ShardSpec:
    """Data parallel over ``axis`` with ZeRO ``stage`` sharding (see :func:`shard_params`).

    ``reshard_after_forward`` None means the default of ``engine/stack/compose.py``: reshard
    alone, keep the units under a pipeline.
    """

    axis: str
    stage: int
    reshard_after_forward: bool | None = None
    prefetch: int | None = None  # None: 1 (``prefetch_depth``); kept apart so that an option given is seen
    accumulation: int = 1
    reduce_in_flight: int | None = None  # None: chosen per device (reductions_in_flight)
    bucket_mb: float | None = None  # stages 1-2: None is DEFAULT_BUCKET_MB (bucket_limit)
    # HSDP: the mesh axis the shards are replicated over (None: sharded over ``axis`` alone). The batch
    # is cut over it too, and each reduce-scattered gradient shard is all-reduced over it.
    replicate: str | None = None
    update_in_buckets: bool | None = None  # stages 1-2; None: chosen per device (updates_in_buckets)
    overlap_gather: bool | None = None  # stages 1-2; None: the default (overlaps_gather)
    # stages 1-2; None: where it can (plan/lower.py: gathers_into_params); True: asked for (the
    # gathers waited for and the update at once on every device); False: never
    gather_into_params: bool | None = None
    # stages 2-3 with micro-batches; None: the default (reduces_each_microbatch)
    reduce_each_microbatch: bool | None = None

    name: ClassVar[str] = "shard_params"
    role: ClassVar[str] = SHARDING

    def __str__(self) -> str:
        reshard = "" if self.reshard_after_forward is None else f", reshard_after_forward={self.reshard_after_forward}"
        in_flight = "" if self.reduce_in_flight is None else f", reduce_in_flight={self.reduce_in_flight}"
        in_flight += "" if self.bucket_mb is None else f", bucket_mb={self.bucket_mb}"
        in_flight += "" if self.update_in_buckets is None else f", update_in_buckets={self.update_in_buckets}"
        in_flight += "" if self.overlap_gather is None else f", overlap_gather={self.overlap_gather}"
        in_flight += "" if self.gather_into_params is None else f", gather_into_params={self.gather_into_params}"
        in_flight += "" if self.reduce_each_microbatch is None else (
            f", reduce_each_microbatch={self.reduce_each_microbatch}")
        replicate = "" if self.replicate is None else f", replicate={self.replicate!r}"
        return (
            f"shard_params(axis={self.axis!r}{replicate}, stage={self.stage}{reshard}, prefetch={self.prefetch_depth}, "
            f"accumulation={self.accumulation}{in_flight})"
        )

    @property
    def prefetch_depth(self) -> int:
        """How many units ahead the gathers are issued (1 where the option is not given)."""
        return 1 if self.prefetch is None else self.prefetch

    def reductions_in_flight(self, device: torch.device | str) -> int:
        """How many of the backward's reduce-scatters may be in flight at once, on ``device``.

        The default (None) is 1, except for ZeRO-3 on a CPU: 0. On a GPU the reduction runs beside
        the compute (NCCL), so one in flight hides it, as FSDP2. On a CPU (gloo, threads) a
        collective runs on the same cores as the computes, and the overlap measured within the
        noise (benchmarks/README.md, issues 25 and 27), so the choice is by memory: at stage 3 one
        in flight holds one more unit's full gradient, 4-5% of the Plan's peak on the benchmarks'
        models and up to 10% on benchmarks/memory.py's at world 8, where FSDP2 on CPU reduces
        each unit before the next computes; at stage 2 it is at most one more bucket
        (``bucket_mb``) beside the full parameters and gradients ZeRO-2 holds, 0-0.2% of the
        Plan's peak there, so it is not worth a wait before every bucket's next compute.
        """
        if self.reduce_in_flight is not None:
            return self.reduce_in_flight
        return 0 if self.stage == 3 and torch.device(device).type in ("cpu", "meta") else 1

    def reduces_each_microbatch(self) -> bool:
        """Whether stages 2-3 reduce-scatter each micro-batch's gradients as soon as that micro-batch's
        backward made them (summed into the gradient shards), rather than once after the last one.

        The default (None): yes at stage 3, no at stage 2. Reduced once, a unit's full gradient lives
        from the first micro-batch's backward to the last one's: every rank holds the whole model's
        gradients across the micro-batches, what stage 3 exists to avoid (measured on a 159 MiB
        Llama at world 4 with accumulation 2: 1.81x the model a rank, against 0.25x for its state).
        Each micro-batch then reduce-scatters the model's gradients once more, as FSDP2 does by
        default and DeepSpeed's ZeRO does. Stage 2 holds the full parameters anyway: it keeps the
        one reduction per step (``True`` asks for one per micro-batch there too)."""
        if self.reduce_each_microbatch is not None:
            return self.reduce_each_microbatch
        return self.stage == 3

    def updates_in_buckets(self, device: torch.device | str) -> bool:
        """Whether stages 1-2 update one bucket at a time, each bucket's all-gather issued as soon as
        its shards are updated (overlapping the next bucket's update and the metrics), on ``device``.

        The default (None): not on a CPU, yes elsewhere. On a GPU the all-gather runs beside the
        update (NCCL). On a CPU (gloo) the all-gather's copies run on the cores the update uses, and
        a bucket's update costs calls of its own: measured (MLP 8 x Linear(512), world 2, AdamW,
        load 11-15 on 2 cores, paired in one run against the update at once), ZeRO-2 took 1.013,
        0.935 and 1.057 of the one-pass step's time, ZeRO-1 1.035 and 1.006: no gain out of the
        noise (benchmarks/README.md), so a CPU keeps the one-pass update. A user's optimizer (not
        a built-in one, whose state the engine can cut by unit) always updates at once."""
        if self.update_in_buckets is not None:
            return self.update_in_buckets
        return not self.gather_into_params and torch.device(device).type not in ("cpu", "meta")

    def overlaps_gather(self, device: torch.device | str) -> bool:
        """Whether stages 1-2 leave the all-gathers of the updated shards in flight when the step
        returns, each waited for by the next step just before the first forward that uses its
        bucket (``wait_params`` at the top of the Plan, ``gather_params`` at its end), so that it
        overlaps that step's forward. The TrainState then holds them in an ``InFlightParams``,
        which waits for them all on any other read of ``state.params`` (engine/layout/in_flight.py).

        The default (None): not on a CPU, yes elsewhere. The gathered buffers are the next
        step's parameters, so the overlap holds no byte more than the wait at the step's end did,
        and it moves no work: on NCCL the gathers of every bucket but the first run on their own
        stream beside the forward's kernels. On a CPU (gloo) the gather's copies run on gloo's
        threads, on the cores the forward uses: measured on 2 cores (load 7-16, world 2, paired
        against the wait at the step's end, ten runs of ZeRO-1/2 on the benchmarks' MLP and GPT,
        benchmarks/README.md) 0.87-1.11, median 1.05, while the time waited for the gathers fell
        from 14.8 to 9.7 ms per step (MLP, ZeRO-2): no gain, so a CPU waits at the step's end,
        as ``updates_in_buckets``. ``overlap_gather=True`` overlaps there too."""
        if self.stage == 3:
            return False
        if self.overlap_gather is not None:
            return self.overlap_gather
        return not self.gather_into_params and torch.device(device).type not in ("cpu", "meta")

    def prefetches_backward_after(self, device: torch.device | str) -> bool:
        """Whether a backward issues its prefetches after each compute and that unit's reduce-scatter
        (the prefetch overlaps the reduction), not before the compute, on ``device``: on a CPU, not
        elsewhere.

        Issued before the compute, the next unit's gathered buffer and gloo's receive copy of it (two
        units) sit beside the computing unit, its fresh gradient and (at the reduce-scatter) its flat
        copy: FSDP2's schedule, and the step's peak on a CPU (issue 25: 157 MiB per rank on 12 x
        Linear(2048) at world 8, as FSDP2). Issued after the reduce-scatter, they meet only the
        donated flat gradient. On a CPU the compute and the collectives share the cores, so the
        overlap with the compute is not what it is on a GPU, where the prefetch stays before it.
        The backward's last unit is gathered the same way, during the previous unit's reduce-scatter,
        where every other unit's gradient shard is held: the step's peak on a CPU, one shard above
        the unit before's (it replaced gathering that unit only when its compute came, which kept it
        apart from the reduce-scatter, and from its overlap). Since gloo's gathers of 64 KiB and more
        per member became direct exchanges, received straight into the unit, the receive copy is
        gone, and FSDP2's order is still no faster here (paired, stage 3, quiet: MLP world 2 1.08x,
        world 4 1.01x, TinyGPT world 2 1.03x the time of this order)."""
        return torch.device(device).type in ("cpu", "meta")

    def bucket_limit(self) -> int | None:
        """Bytes a bucket of gradients may hold (stages 1-2); None: each unit reduced alone (stage 3,
        whose units are gathered and freed one by one)."""
        if self.stage == 3:
            return None
        return int((DEFAULT_BUCKET_MB if self.bucket_mb is None else self.bucket_mb) * 2**20)

    def buckets(self, order: Sequence[str], sizes: Mapping[str, tuple[int, str]]) -> list[tuple[str, ...]]:
        """The units reduced in ``order`` grouped into buckets (``sizes``: unit -> (bytes, dtype) of
        its gradient on the wire)."""
        return bucket_units(order, sizes, self.bucket_limit())

    def insert(
        self,
        actions: Sequence[Action],
        stage_needs: Mapping[int, tuple[str, ...]],
        *,
        reshard: bool,
        pipelined: bool,
        deferred: set[str],
        device: torch.device | str = "cpu",
        holds_shards: bool = False,
    ) -> list[Action]:
        """The rank's computes with ZeRO's gathers, frees and (not deferred) reduce-scatters;
        ``holds_shards``: the state holds shards at rest (stage 3, and stages 1-2 under a narrowing
        precision policy: ``engine/plan/lower.zero_holds_shards``), which the step gathers."""
        out = insert_gathers(
            actions, stage_needs, stage=self.stage, reshard=reshard, prefetch=self.prefetch_depth,
            pipelined=pipelined, axis=self.axis, prefetch_backward_after=self.prefetches_backward_after(device),
            holds_shards=holds_shards,
        )
        each = self.stage >= 2 and self.reduces_each_microbatch()
        return insert_reduces(out, stage_needs, deferred, self.axis, each_microbatch=each)
