"""pipeline(schedule=...) as the user writes it: a Schedule, its text or a builder runs whatever its
placement and stages per rank, and what cannot run is refused where it is passed, naming the
argument to change.

float64 on the threads backend, compared with the single-device step at 1e-12 relative (as in
test_pipeline_step.py: only the order of the micro-batch sums changes).
"""

from __future__ import annotations

import re

import pytest
import torch

import shardwise as sw
from shardwise.schedules import Schedule
from shardwise.testing.models import mlp

F64_RTOL = 1e-12
INTERLEAVED = "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\nrank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"


def _problem(widths: list[int]):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp(widths, "tanh").double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, widths[0], generator=gen, dtype=torch.float64),
                torch.randn(4, widths[-1], generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


@pytest.mark.parametrize("form", ["text", "Schedule"])
def test_a_schedule_with_several_stages_per_rank_runs_as_text_as_it_does_as_a_schedule(form: str) -> None:
    """The text form was refused ("stages=4 ... but the pipeline needs ... stages=2"): its stage
    count was inferred from a Schedule only."""
    step, params, batches = _problem([4, 8, 8, 8, 2])
    schedule = INTERLEAVED if form == "text" else Schedule.parse(INTERLEAVED)
    piped = sw.pipeline(step, "pp", schedule, 2, poison=True)
    assert piped.layout(sw.Mesh(pp=2), params).schedule.placement == (0, 1, 0, 1)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize(
    "text,ranks",
    [
        ("rank 0: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\nrank 1: 2F0 3F0 2F1 3F1 3B0 2B0 3B1 2B1", 2),  # [0, 0, 1, 1]
        ("rank 0: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\nrank 1: 2F0 2B0 2F1 2B1", 2),  # [0, 0, 1]
        ("rank 0: 1F0 1B0 1F1 1B1\nrank 1: 0F0 0F1 0B0 0B1", 2),  # reversed: [1, 0]
        ("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 2F0 2B0 2F1 2B1\nrank 2: 1F0 1F1 1B0 1B1", 3),  # [0, 2, 1]
    ],
)
def test_any_placement_holding_a_stage_on_every_rank_runs(text: str, ranks: int) -> None:
    """What the idle-rank refusal must not catch: contiguous, reversed and non-monotone placements."""
    step, params, batches = _problem([4, 8, 8, 8, 2])
    piped = sw.pipeline(step, "pp", text, 2, poison=True)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=ranks), batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize(
    "text,idle,fewer",
    [
        ("rank 0: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\nrank 1:", [1], "pp=1"),
        ("rank 0:\nrank 1: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1", [0], "pp=1"),
        ("rank 0: 0F0 0F1 0B0 0B1\nrank 1:\nrank 2: 1F0 1B0 1F1 1B1", [1], "pp=2"),
    ],
)
def test_a_schedule_with_an_idle_rank_is_refused_where_it_is_passed(text: str, idle: list[int], fewer: str) -> None:
    """validate accepts an idle rank (a schedule to simulate or draw), but a pipeline rank holding no
    stage has no part of the model: the Plan and the step failed with a bare ``KeyError: 1``."""
    step, _, _ = _problem([4, 8, 8, 2])
    words = (
        rf"rank\(s\) {re.escape(str(idle))} of pipeline axis 'pp' hold no stage \(placement .*\); "
        rf"a pipeline needs every rank of its axis to hold one. "
        rf"Give each of those ranks a stage, or drop their lines .* {fewer}"
    )
    with pytest.raises(ValueError, match=words):
        sw.pipeline(step, "pp", text, 2)
    with pytest.raises(ValueError, match=words):
        sw.pipeline(step, "pp", Schedule.parse(text), 2)


def test_a_builder_whose_schedule_leaves_a_rank_idle_is_refused_before_it_runs() -> None:
    step, params, _ = _problem([4, 8, 8, 2])

    def all_on_rank_0(ranks: int, stages: int, microbatches: int) -> Schedule:
        return Schedule.parse("rank 0: 0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\nrank 1:")

    piped = sw.pipeline(step, "pp", all_on_rank_0, 2)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of pipeline axis 'pp' hold no stage"):
        piped.plan(sw.Mesh(pp=2), params)


def test_a_schedule_of_another_shape_is_refused_at_pipeline_naming_the_argument() -> None:
    """Refused only at the first step before, with a message naming no argument."""
    step, _, _ = _problem([4, 8, 8, 2])
    four = Schedule.parse(
        "rank 0: 0F0 0F1 0I0 0F2 0I1 0W0 0F3 0I2 0W1 0I3 0W2 0W3\n"
        "rank 1: 1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2 1F3 1I3 1W3", name="my_zb"
    )
    with pytest.raises(ValueError, match=r"pipeline\(microbatches=1\): schedule 'my_zb' runs 4 micro-batches; "
                                         r"pass pipeline\(\.\.\., microbatches=4\)"):
        sw.pipeline(step, "pp", four)
    with pytest.raises(ValueError, match=r"pipeline\(stages=4\): schedule 'my_zb' has 2 stages; "
                                         r"pass pipeline\(\.\.\., stages=2\) or leave stages out"):
        sw.pipeline(step, "pp", four, 4, stages=4)
    with pytest.raises(sw.schedules.ScheduleError, match="no backward"):
        sw.pipeline(step, "pp", "0F0\n1F0 1B0", 1)  # invalid text: refused here too, not at the first step


@pytest.mark.parametrize("schedule", [42, None, 1.5])
def test_what_is_not_a_schedule_is_refused_at_pipeline(schedule: object) -> None:
    step, _, _ = _problem([4, 8, 2])
    with pytest.raises(TypeError, match=rf"pipeline\(schedule={schedule!r}\): a schedule is a built-in's name .*"
                                        rf"got {type(schedule).__name__}"):
        sw.pipeline(step, "pp", schedule)
