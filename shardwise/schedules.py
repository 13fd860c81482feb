"""Pipeline schedules as plain data: the built-ins, parsing, validation, simulation and drawings.

A schedule is one list of actions per rank (``0F3``: the forward of stage 0 on
micro-batch 3; ``B`` a backward, ``I`` / ``W`` its input and weight halves). Take a
built-in or write one, ``validate`` it, ``simulate`` it for its bubble and activation
peak, draw it, and give it to ``sw.pipeline(step, axis, schedule=...)``.

>>> import shardwise as sw
>>> custom = sw.schedules.Schedule.parse("rank 0: 0F0 0F1 0B0 0B1\\nrank 1: 1F0 1B0 1F1 1B1")
>>> print(sw.schedules.ascii_timeline(sw.schedules.simulate(custom)))
custom: makespan 9, bubble 33.3%
rank 0 |0F0 0F1 ........0B0     ....0B1     |
rank 1 |....1F0 1B0     1F1 1B1     ........|
legend: 0F1 = stage 0, micro-batch 1 (F forward, B backward); . idle
"""

from .transforms.pipeline import (
    SCHEDULES,
    Costs,
    PipeOp,
    Schedule,
    ScheduleError,
    Timeline,
    ascii_timeline,
    gantt,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    simulate,
    validate,
    write_chrome_trace,
    zb_h1,
    zb_v,
)

# A traceback names an exception by its module: the public one, not where it happens to live.
ScheduleError.__module__ = __name__
PipeOp.__module__ = __name__

__all__ = [
    "SCHEDULES",
    "Costs",
    "PipeOp",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "ascii_timeline",
    "gantt",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "simulate",
    "validate",
    "write_chrome_trace",
    "zb_h1",
    "zb_v",
]
