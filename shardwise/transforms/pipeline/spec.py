"""pipeline's spec: frozen data in the step's stack, and what the lowering asks of it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ...collectives.mesh import Mesh
from ...engine.layout.state_layout import Placement
from ...engine.model.chain import Chain
from ...engine.plan.actions import Action
from ...engine.stack.compose import PLACEMENT
from .builtins import check_every_rank_holds_a_stage, fixed_schedule, get_schedule
from .lowering import rank_computes
from .partition import balanced_partition, check_partition, param_counts, stage_layers
from .schedule import Schedule
from .simulate import simulate
from .validate import validate


@dataclass(frozen=True)
class PipelineSpec:
    """The chain cut into stages over ``axis``, run by ``schedule`` (see :func:`pipeline`)."""

    axis: str
    schedule: Any = "1f1b"
    microbatches: int = 1
    stages: int | None = None
    partition: tuple[int, ...] | None = None
    poison: bool = False
    trace: bool = False
    follow_batches: bool = False

    name: ClassVar[str] = "pipeline"
    role: ClassVar[str] = PLACEMENT

    def __str__(self) -> str:
        extra = "".join(
            f", {k}={v!r}" for k, v in (("stages", self.stages), ("partition", self.partition)) if v is not None
        )
        return f"pipeline(axis={self.axis!r}, schedule={self.schedule_text}, microbatches={self.microbatches}{extra})"

    @property
    def schedule_text(self) -> str:
        """The schedule in words that tell two schedules apart: a built-in's name, a function's
        qualified name, a Schedule's (or schedule text's) own digest."""
        schedule = self.schedule
        if isinstance(schedule, str) and "\n" not in schedule and ":" not in schedule:
            return repr(schedule)
        if callable(schedule) and not isinstance(schedule, Schedule):
            return f"{getattr(schedule, '__module__', '?')}.{getattr(schedule, '__qualname__', repr(schedule))}"
        text = str(schedule)
        return f"<schedule {hashlib.sha1(text.encode()).hexdigest()[:12]}>"

    def num_stages(self, ranks: int) -> int:
        if self.stages is not None:
            return self.stages
        fixed = fixed_schedule(self.schedule)  # a Schedule or its text has its own stage count
        if fixed is not None:
            return fixed.num_stages
        return 2 * ranks if self.schedule == "zb_v" else ranks

    def place(self, chain: Chain, mesh: Mesh, params: Mapping[str, Any] | None) -> tuple[Placement, Schedule]:
        """Stages, schedule and placement on ``mesh``; refuses anything that cannot run."""
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"pipeline(axis={self.axis!r}): {mesh!r} has no axis {self.axis!r}; use one of {mesh.axis_names}"
            )
        ranks = mesh.axis_size(self.axis)
        count = self.num_stages(ranks)
        names = list(chain.names)
        if self.partition is not None:
            if len(self.partition) != count and self.stages is None and fixed_schedule(self.schedule) is None:
                # A partition of more stages than ranks: stages= says how many (interleaved, zb_v: several a rank)
                raise ValueError(
                    f"pipeline(partition={list(self.partition)}) gives {len(self.partition)} stages, and "
                    f"schedule={self.schedule_text} on {ranks} ranks of axis {self.axis!r} runs {count} "
                    f"(stages= not given); pass stages={len(self.partition)} for that many (an interleaved schedule "
                    "runs several a rank), or a partition of "
                    f"{count} counts"
                )
            counts = check_partition(self.partition, len(names), count)
        elif params is not None:
            counts = balanced_partition(param_counts(names, params), count)
        else:
            raise ValueError(
                "pipeline balances stages by parameter count: pass the params (step.plan(mesh, params)) "
                "or give the layer counts with pipeline(..., partition=[...])"
            )
        schedule = get_schedule(self.schedule, ranks, count, self.microbatches)
        validate(schedule)
        check_every_rank_holds_a_stage(schedule, self.axis)
        return Placement.pipelined(chain, self.axis, stage_layers(names, counts), schedule.placement), schedule

    def rank_computes(self, placement: Placement, schedule: Schedule, index: int) -> list[Action]:
        return rank_computes(schedule, placement, self.axis, index)

    def kept_per_index(
        self, schedule: Schedule, per_stage: Sequence[int], of_batch: Sequence[int] | None = None
    ) -> tuple[int, ...]:
        """Activation bytes kept for backward per pipeline index: the schedule's peak number of
        micro-batch activations on the rank (from the simulator) times the largest per-micro-batch
        figure of its stages, plus, once, what its stages keep of the batch itself (``of_batch``,
        per stage: every micro-batch is a view of that one storage). Exact with one stage per
        rank, an upper bound with more."""
        peaks = simulate(schedule).peak_activations
        shared = of_batch if of_batch is not None else [0] * len(per_stage)
        return tuple(
            peaks[index] * max((per_stage[s] for s, p in enumerate(schedule.placement) if p == index), default=0)
            + sum(shared[s] for s, p in enumerate(schedule.placement) if p == index)
            for index in range(schedule.num_ranks)
        )
