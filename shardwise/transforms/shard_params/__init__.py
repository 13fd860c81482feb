"""shard_params: data parallel over a mesh axis with ZeRO-1/2/3 (FSDP) sharding."""

from __future__ import annotations

from ...engine.layout.sharding import UnitLayout
from ...engine.optim.optimizers import updates_in_place
from ...engine.stack.compose import add
from ...engine.step.step import Step
from .spec import DEFAULT_BUCKET_MB, ShardSpec

__all__ = ["DEFAULT_BUCKET_MB", "ShardSpec", "UnitLayout", "shard_params"]


def shard_params(
    step: Step,
    axis: str = "dp",
    stage: int = 3,
    *,
    reshard_after_forward: bool | None = None,
    prefetch: int | None = None,
    accumulation: int = 1,
    reduce_in_flight: int | None = None,
    bucket_mb: float | None = None,
    replicate: str | None = None,
    update_in_buckets: bool | None = None,
    overlap_gather: bool | None = None,
    gather_into_params: bool | None = None,
    reduce_each_microbatch: bool | None = None,
) -> Step:
    """Make ``step`` data parallel over mesh ``axis``, sharding what ZeRO ``stage`` shards.

    The global batch is split over ``axis`` (its size must divide the batch)
    and the result equals ``step`` on the whole batch. Stage 1 shards the
    optimizer state; stage 2 also reduce-scatters each layer's gradient as
    soon as its backward is done; stage 3 also keeps parameters sharded at
    rest, all-gathering each layer's parameters just before use (``prefetch``
    computes ahead, asynchronously; 1 by default; on a CPU the backward issues each prefetch
    after the previous layer's reduce-scatter, beside which it travels, not before that layer's
    compute, which keeps it out of the step's peak) and freeing them after use
    (``reshard_after_forward=True``: gathered again in backward, but the last forward's units,
    which the backward starts with, are kept across the loss) or keeping
    them until backward (``False``). The default (None) reshards, except under
    a pipeline, where a rank's units stay gathered from their first compute of
    the step to their last (torchtitan's rule). Each
    layer's parameters travel as one flat buffer, padded to a multiple of the
    axis size; padding never reaches results. ``accumulation=k`` splits each
    rank's batch into ``k`` micro-batches. Stage 3 reduce-scatters each
    micro-batch's gradients as soon as its backward made them, summed into the
    shards (``reduce_each_microbatch``, default True at stage 3: a rank never
    holds more than a unit's full gradient, at one reduction of the model's
    gradients per micro-batch, as FSDP2); stages 1 and 2 reduce only after the
    last micro-batch (every full gradient held to then; stage 2 takes
    ``reduce_each_microbatch=True`` too). Under a pipeline the same holds per
    micro-batch of the schedule.

    ``reduce_in_flight`` bounds how many of the backward's gradient reduce-scatters (stages 2
    and 3) are in flight at once: each holds its unit's full gradient until it is waited for.
    0 waits for each before the next compute (least memory); 1 lets it overlap the next unit's
    backward. The default (None) is 1, except for stage 3 where the parameters are on a CPU: 0.
    A CPU's collectives run on the same cores as the computes (gloo, threads: the overlap
    measured within the noise), so there the choice is by memory: one more unit's full gradient
    at stage 3 (4-10% of the Plan's peak on the benchmarks' models; FSDP2 on CPU holds none), at
    most one more bucket at stage 2 (0-0.2%). The Plan shows the waits and counts the buffers
    (``memory["reduce_buffers"]``).

    At stages 1 and 2 the gradients of consecutive units travel in buckets of at most
    ``bucket_mb`` MiB (a larger unit alone; default ``DEFAULT_BUCKET_MB``). At stage 2 each
    bucket's reduce-scatter is issued as soon as its last unit's gradient is complete, during
    the backward; stage 1, which holds the full gradients, issues them all after the backward.
    The updated shards come back in the same buckets. With ``update_in_buckets`` (default: not on
    a CPU, yes elsewhere) a built-in optimizer updates one bucket at a time and each bucket's
    all-gather is issued as soon as its shards are updated, overlapping the next bucket's update
    (``update(6+4) gather_params(6+4) update(2+0) ...``).
    Without it the optimizer updates every shard at once, then the all-gathers are issued. On a
    CPU (gloo) the pipeline measured no faster (see ``ShardSpec.updates_in_buckets``).

    ``overlap_gather`` (stages 1-2; default None: not on a CPU, where gloo measured no gain, yes
    elsewhere; see ``ShardSpec.overlaps_gather``) leaves those all-gathers in flight when the
    step returns: the next step waits for each bucket just before the first forward that uses
    it (``wait_params(0+2) F(0, mb=0) ...`` at the top of the Plan; the gathers are issued in
    that order), so the gather overlaps the next forward instead of ending the step. The
    returned ``state.params`` then holds the gathers in flight, and any read of it other than
    the next step's (indexing, iterating, ``sw.checkpoint.save``, ``step.full_params``,
    ``torch.save``, optree) waits for them all first: stale parameters cannot be read. An older
    state stays valid (its gathers were waited for by the step that read it).
    ``overlap_gather=False`` waits for them at the step's end; there, with an in-place optimizer
    (``inplace=True``, which consumes the state it is given), each bucket's all-gather is waited
    for and written into the parameters the step was given before the next is issued
    (``gather_params(6+4) wait_params(6+4) gather_params(2+0) ...``), so the step's end holds the
    parameters once instead of twice (``plan.lower.gathers_into_params``). On one host's gloo ranks
    a bucket big enough for the exchanges is copied from the peers' shared-memory slots straight
    into the parameters (no buffer, no copy more than handing it on); elsewhere the gathered buffer
    is copied in at the wait, a copy of the parameters per step, and the gathers run one after
    another: ``gather_into_params=False`` hands the gathered buffers on instead; ``True`` asks for
    it (the gathers then waited for and the update at once on every device; refused with an
    optimizer that does not update in place). Stage 3 reduces and gathers
    unit by unit (its units are gathered and freed one at a time). Each bucket is one action of
    the Plan (``reduce_scatter(2+0)``), listed when the plan is made with the parameters.

    Under a precision policy that computes in a narrower dtype than it stores (``mixed_precision``
    with bf16 or fp16 compute of float32 parameters, in either order), stages 1 and 2 hold only
    this rank's float32 shards at rest, as stage 3 does (``state.params`` holds them), and each
    step gathers every layer in the compute dtype before its first forward, keeping it to its last
    backward: float32 lives only in the shards, as in DeepSpeed's bf16 ZeRO-1/2. ``prefetch`` says
    how far ahead those gathers go, and
    ``reshard_after_forward=False`` states what they do (True is stage 3's layout, refused here). No
    all-gather of the updated shards ends such a step, so ``overlap_gather``, ``update_in_buckets``
    and ``gather_into_params`` set to True are refused. Without such a policy stages 1 and 2 gather
    no parameters, and ``prefetch`` or ``reshard_after_forward=False`` are refused.

    Composed with a pipeline (in either order), each pipeline rank's layers are
    sharded over ``axis`` of a 2-D mesh such as ``Mesh(dp=2, pp=2)``.

    ``replicate`` names a second data-parallel axis (HSDP, torch FSDP2's 2-D mesh): the units are
    sharded over ``axis`` only and every index of ``replicate`` holds the same shards. The batch is
    cut over both axes (``replicate`` first); each unit's (or bucket's) gradient is reduce-scattered
    over ``axis`` and the shard then all-reduced over ``replicate`` (in the reduce dtype, waited for
    before the update), so the step still equals ``step`` on the whole batch. With ``axis`` within a
    node and ``replicate`` across nodes (``Mesh(node=8, dp=8)``: the last axis varies fastest), the
    gathers and reduce-scatters stay on the fast links and only the shard's all-reduce crosses the
    slow ones, at the cost of holding a ``replicate``-th of the model per rank rather than a
    ``(replicate x axis)``-th. Every stage, option and composition of ``axis`` applies unchanged.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(
    ...     torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ... )
    >>> base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> step = sw.shard_params(base, "dp", stage=3)
    >>> print(" ".join(map(str, step.plan(sw.Mesh(dp=2)).for_rank(0)[:5])))
    gather(0) gather(2) wait_gather(0) F(0, mb=0) free(0)
    >>> hsdp = sw.shard_params(base, "dp", stage=3, replicate="node")  # shards over dp, replicas over node
    >>> print(" ".join(str(a) for a in hsdp.plan(sw.Mesh(node=2, dp=2)).for_rank(0) if "replicas" in a.kind))
    reduce_replicas(2) reduce_replicas(0) wait_replicas(2) wait_replicas(0)
    """
    if not isinstance(step, Step):
        raise TypeError(f"shard_params(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if isinstance(axis, (tuple, list)) and len(axis) == 2 and all(isinstance(a, str) for a in axis):
        raise TypeError(
            f"shard_params(axis={axis!r}): HSDP (replicate over one axis, shard over another) is spelled "
            f"shard_params(step, {axis[1]!r}, replicate={axis[0]!r}): axis is the one axis the units are sharded over"
        )
    if not isinstance(axis, str):
        raise TypeError(f"shard_params(axis={axis!r}): the axis is a mesh axis name such as 'dp'")
    if replicate is not None and not isinstance(replicate, str):
        raise TypeError(
            f"shard_params(replicate={replicate!r}): the axis the shards are replicated over is one mesh axis "
            "name such as 'node' (or None: no replicas)"
        )
    if replicate == axis:
        raise ValueError(
            f"shard_params(axis={axis!r}, replicate={replicate!r}): the units cannot be sharded and replicated "
            "over the same axis; name two axes of one mesh, e.g. sw.Mesh(node=2, dp=4) with "
            "shard_params(step, 'dp', replicate='node')"
        )
    if stage not in (1, 2, 3):
        raise ValueError(f"shard_params(stage={stage!r}): ZeRO stages are 1, 2 or 3")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise ValueError(f"shard_params(prefetch={prefetch!r}): the prefetch depth is an int >= 0")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"shard_params(accumulation={accumulation!r}): the number of micro-batches is an int >= 1")
    if reduce_in_flight is not None and (
        isinstance(reduce_in_flight, bool) or not isinstance(reduce_in_flight, int) or reduce_in_flight < 0
    ):
        raise ValueError(
            f"shard_params(reduce_in_flight={reduce_in_flight!r}): the number of gradient reductions in flight "
            "is an int >= 0 (0: wait for each before the next compute), or None for the device's default"
        )
    if bucket_mb is not None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"shard_params(bucket_mb={bucket_mb!r}): a bucket's size in MiB is a number > 0")
        if stage == 3:
            raise ValueError(
                f"shard_params(stage=3, bucket_mb={bucket_mb!r}): stage 3 reduces each unit as its backward ends "
                "(its units are gathered and freed one by one); buckets are for stages 1 and 2: drop bucket_mb"
            )
    _check_stage12_flag("update_in_buckets", update_in_buckets, stage, "the update by buckets")
    _check_stage12_flag("overlap_gather", overlap_gather, stage, "the overlap of that gather with the next forward")
    _check_stage12_flag("gather_into_params", gather_into_params, stage, "gathering into the parameters")
    if gather_into_params:
        clash = [f"{n}=True" for n, v in (("overlap_gather", overlap_gather), ("update_in_buckets", update_in_buckets))
                 if v]
        if clash:
            raise ValueError(
                f"shard_params(gather_into_params=True, {', '.join(clash)}): gathering into the parameters waits "
                "for each bucket's gather before the next, after the whole update; drop one of the options"
            )
        if not updates_in_place(step.optimizer):
            raise ValueError(
                "shard_params(gather_into_params=True): the optimizer does not update in place, so the state "
                "a step is given stays valid and its parameters may not be written; use the optimizer with "
                "inplace=True, or drop the option"
            )
    if reduce_each_microbatch is not None:
        if not isinstance(reduce_each_microbatch, bool):
            raise TypeError(f"shard_params(reduce_each_microbatch={reduce_each_microbatch!r}): True, False or None "
                            "(the default: True at stage 3, False at stage 2)")
        if stage == 1 and reduce_each_microbatch:
            raise ValueError(
                "shard_params(stage=1, reduce_each_microbatch=True): stage 1 holds every full gradient and reduces "
                "them after the backward; reducing each micro-batch's is stage 2 or 3: use stage=2 or drop the option"
            )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"shard_params(reshard_after_forward={reshard_after_forward!r}): True, False or None (the default)"
        )
    # At stages 1 and 2 what reshard_after_forward and prefetch mean depends on the precision policy, which
    # may be applied after this transform: checked with the whole step (engine/step/layouts.py).
    spec = ShardSpec(axis, stage, reshard_after_forward, prefetch, accumulation,
                     reduce_in_flight, None if bucket_mb is None else float(bucket_mb), replicate,
                     update_in_buckets, overlap_gather, gather_into_params, reduce_each_microbatch)
    return add(step, spec)


def _check_stage12_flag(name: str, value: object, stage: int, what: str) -> None:
    """A stages-1-2 option: True, False or None (the device's default), refused at stage 3."""
    if value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(f"shard_params({name}={value!r}): True, False or None (the device's default)")
    if stage == 3:
        raise ValueError(
            f"shard_params(stage=3, {name}={value!r}): stage 3 holds shards and gathers no updated parameters "
            f"at the step's end (it gathers each unit before use, prefetch=); {what} is for stages 1 and 2: "
            "drop the option"
        )
