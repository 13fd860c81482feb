"""shard_params: data parallel over a mesh axis with ZeRO-1/2/3 (FSDP) sharding."""

from __future__ import annotations

from ...engine.data_parallel import DataParallel
from ...engine.flat import UnitLayout
from ...engine.step import Step
from .lowering import ShardingOptions
from .step import ShardedLayout, ShardedStep

__all__ = ["ShardedLayout", "ShardedStep", "ShardingOptions", "UnitLayout", "shard_params"]


def shard_params(
    step: Step,
    axis: str = "dp",
    stage: int = 3,
    *,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    accumulation: int = 1,
) -> Step:
    """Make ``step`` data parallel over mesh ``axis``, sharding what ZeRO ``stage`` shards.

    The global batch is split over ``axis`` (its size must divide the batch)
    and the result equals ``step`` on the whole batch. Stage 1 shards the
    optimizer state; stage 2 also reduce-scatters each layer's gradient as
    soon as its backward is done; stage 3 also keeps parameters sharded at
    rest, all-gathering each layer's parameters just before use (``prefetch``
    layers ahead, asynchronously) and freeing them after use
    (``reshard_after_forward=True``: gathered again in backward) or keeping
    them until backward (``False``). Each layer's parameters travel as one
    flat buffer, padded to a multiple of the axis size; padding never reaches
    results. ``accumulation=k`` splits each rank's batch into ``k``
    micro-batches and reduces gradients only after the last one.

    On a pipelined step (either order of the two transforms), each pipeline
    rank's layers are sharded over ``axis``: gathered once per step before
    their first compute and reduce-scattered after the last backward.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    >>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1)), "dp", stage=3)
    >>> print(step.plan(sw.Mesh(dp=2)).for_rank(0)[:4])
    (Action(kind='gather', layer='0', microbatch=None, args=()), Action(kind='gather', layer='2', microbatch=None, args=()), Action(kind='wait_gather', layer='0', microbatch=None, args=()), Action(kind='forward', layer='0', microbatch=0, args=()))
    """
    if isinstance(step, ShardedStep):
        raise ValueError(
            f"shard_params was applied twice (already sharded over axis {step.axis!r}); apply it once"
        )
    if not isinstance(step, Step):
        raise TypeError(f"shard_params(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if not isinstance(axis, str):
        raise TypeError(f"shard_params(axis={axis!r}): the axis is a mesh axis name such as 'dp'")
    if stage not in (1, 2, 3):
        raise ValueError(f"shard_params(stage={stage!r}): ZeRO stages are 1, 2 or 3")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"shard_params(prefetch={prefetch!r}): the prefetch depth is an int >= 0")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"shard_params(accumulation={accumulation!r}): the number of micro-batches is an int >= 1")
    if type(step) is not Step:
        # A step that drives its own computation (a pipeline) holds its layers sharded itself.
        if accumulation != 1 or prefetch != 1:
            raise ValueError(
                f"shard_params(accumulation={accumulation}, prefetch={prefetch}) on a {type(step).__name__}: "
                "that step schedules the computation, so gather units once per step and accumulate over its "
                "own micro-batches; drop these options"
            )
        return step.with_data_parallel(DataParallel(axis, stage))
    if stage != 3 and not reshard_after_forward:
        raise ValueError(
            f"shard_params(stage={stage}, reshard_after_forward=False): only stage 3 shards parameters, "
            "so there is nothing to keep or reshard; drop the option or use stage=3"
        )
    return ShardedStep(
        **step.base_fields(),
        axis=axis,
        stage=stage,
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        accumulation=accumulation,
    )
