"""pipeline(): the public transform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...engine.stack.compose import add
from ...engine.step.step import Step
from .builtins import check_every_rank_holds_a_stage, check_schedule_type, fixed_schedule
from .schedule import Schedule
from .spec import PipelineSpec
from .validate import validate


def pipeline(
    step: Step,
    axis: str = "pp",
    schedule: Any = "1f1b",
    microbatches: int = 1,
    *,
    stages: int | None = None,
    partition: Sequence[int] | None = None,
    trace: bool = False,
    poison: bool = False,
    follow_batches: bool = False,
) -> Step:
    """Cut ``step``'s chain into stages over mesh ``axis`` and run them by ``schedule``.

    ``schedule`` is a built-in name ("gpipe", "1f1b", "interleaved_1f1b",
    "looped_bfs", "zb_h1", "zb_v"), a function ``(ranks, stages,
    microbatches) -> Schedule``, a Schedule, or its text form. Each rank's
    batch is cut into ``microbatches`` equal micro-batches; the loss of each
    counts ``1/microbatches``, so the result equals ``step`` on the whole
    batch. ``stages`` defaults to the axis size (twice it for "zb_v"); the
    layers are split to balance parameter counts unless ``partition`` gives
    the number of layers of every stage. ``trace=True`` adds the measured
    (rank, op, start, end) events to the metrics; ``poison=True`` fills every
    received buffer with NaN once it is used up (a test of stale reuse).

    What a stage passes on is predicted on fake tensors, which cannot read the
    batch: a value a model leaves out on some batches (a Hugging Face attention
    mask, None without a padded row) follows functionalize's ``example_input``,
    and a micro-batch unlike it is refused. ``follow_batches=True`` also runs
    the chain's first layer on each real micro-batch (fake parameters) so each
    is predicted on itself: padded and unpadded micro-batches then mix freely,
    for one extra run of the first layer per micro-batch and step (for a small
    BERT, about 40% more step time on a CPU).

    The loss and gradient norm it reports are global, the same on every rank:
    one small all-reduce per step, which the rank that finishes last waits
    for, and a pass over its gradients for the norm. ``step.with_metrics(())``
    reports neither and sums nothing (unless clipping or mixed precision need
    it), the work torch's pipeline schedules do.

    Weights tied across stages on different ranks (a GPT head sharing the
    embedding) stay tied: each rank using one holds a copy, and the copies'
    gradients are exchanged and summed so they take the same update.

    Over a shard_params step (or with shard_params applied after), every
    pipeline rank's layers are also ZeRO-sharded over the data-parallel axis
    of a 2-D mesh such as ``Mesh(dp=2, pp=2)``: the Plan shows those gathers
    and reduce-scatters among the schedule's computes.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(
    ...     torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ... )
    >>> step = sw.pipeline(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "gpipe", 2)
    >>> print(step.plan(sw.Mesh(pp=2), params).for_rank(1)[0])
    recv_activation(stage1, mb=0, from=0)
    """
    if not isinstance(step, Step):
        raise TypeError(f"pipeline(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if not isinstance(axis, str):
        raise TypeError(f"pipeline(axis={axis!r}): the axis is a mesh axis name such as 'pp'")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline(microbatches={microbatches!r}): the number of micro-batches is an int >= 1")
    if not isinstance(follow_batches, bool):
        raise TypeError(f"pipeline(follow_batches={follow_batches!r}): True or False")
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise ValueError(f"pipeline(stages={stages!r}): the number of stages is an int >= 1")
    # Here, not at the first step: a misspelled name, a wrong type, or a Schedule (or its text) whose
    # shape differs from the arguments is known now.
    check_schedule_type(schedule)
    fixed = fixed_schedule(schedule)
    if fixed is not None:
        check_fixed_shape(fixed, microbatches, stages, axis)
    spec = PipelineSpec(
        axis=axis,
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        partition=None if partition is None else tuple(partition),
        poison=poison,
        trace=trace,
        follow_batches=follow_batches,
    )
    return add(step, spec)


def check_fixed_shape(schedule: Schedule, microbatches: int, stages: int | None, axis: str) -> None:
    """Refuse a Schedule (or its text) that cannot run with these arguments on any mesh, naming the
    argument to change; its rank count is checked against the mesh at the first step."""
    validate(schedule)
    if schedule.microbatches != microbatches:
        raise ValueError(
            f"pipeline(microbatches={microbatches}): schedule {schedule.name!r} runs {schedule.microbatches} "
            f"micro-batch{'es' if schedule.microbatches > 1 else ''}; "
            f"pass pipeline(..., microbatches={schedule.microbatches})"
        )
    if stages is not None and stages != schedule.num_stages:
        raise ValueError(
            f"pipeline(stages={stages}): schedule {schedule.name!r} has {schedule.num_stages} stages; "
            f"pass pipeline(..., stages={schedule.num_stages}) or leave stages out"
        )
    check_every_rank_holds_a_stage(schedule, axis)
