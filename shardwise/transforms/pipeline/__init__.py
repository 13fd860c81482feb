"""Pipeline schedules as public data: built-ins, validation, deadlock detection, simulation, drawings.

A schedule is one list of actions (``0F3``: forward of stage 0 on microbatch
3) per rank. Write one by hand or take a built-in, ``validate`` it, ``simulate``
it for its bubble and activation peak, and draw it:

>>> from shardwise.transforms.pipeline import ascii_timeline, one_f_one_b, simulate
>>> timeline = simulate(one_f_one_b(ranks=2, stages=2, microbatches=2))
>>> print(ascii_timeline(timeline))
1f1b: makespan 9, bubble 33.3%
rank 0 |0F0 0F1 ........0B0     ....0B1     |
rank 1 |....1F0 1B0     1F1 1B1     ........|
legend: 0F1 = stage 0, micro-batch 1 (F forward, B backward); . idle

``simulate`` and the drawings also take a whole step's Plan (``step.plan(mesh,
params, batch)``, any composition): a ``PlanTimeline`` with every transfer and
collective, under ``PlanCosts`` (computes) and a ``CommModel`` (latency +
bandwidth), both fitted from measured runs; ``PlanTimeline.from_measured``
reads a run made with ``step.with_trace()`` (or ``pipeline(..., trace=True)``).
"""

from ...engine.simulate.costs import CommModel, PlanCosts, measured_transfers
from ...engine.simulate.simulation import PlanDeadlock, PlanMismatch
from ...engine.simulate.timeline import PlanSlot, PlanTimeline
from .api import pipeline
from .builtins import (
    SCHEDULES,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    zb_h1,
    zb_v,
)
from .draw import ascii_timeline, gantt, write_chrome_trace
from .schedule import B, F, I, PipeOp, Schedule, ScheduleError, W, loop_placement, v_placement
from .simulate import Costs, Slot, Timeline, plan_costs, simulate
from .spec import PipelineSpec
from .validate import validate

__all__ = [
    "SCHEDULES",
    "B",
    "CommModel",
    "Costs",
    "F",
    "I",
    "PipeOp",
    "PipelineSpec",
    "PlanCosts",
    "PlanDeadlock",
    "PlanMismatch",
    "PlanSlot",
    "PlanTimeline",
    "Schedule",
    "ScheduleError",
    "Slot",
    "Timeline",
    "W",
    "ascii_timeline",
    "gantt",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "looped_bfs",
    "measured_transfers",
    "one_f_one_b",
    "pipeline",
    "plan_costs",
    "simulate",
    "v_placement",
    "validate",
    "write_chrome_trace",
    "zb_h1",
    "zb_v",
]
