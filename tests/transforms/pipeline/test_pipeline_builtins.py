"""The built-in schedules: each validates over drawn sizes, refuses bad sizes clearly; get_schedule."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing.models import mlp
from shardwise.transforms.pipeline import (
    SCHEDULES,
    B,
    F,
    I,
    PipeOp,
    Schedule,
    ScheduleError,
    W,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    looped_bfs,
    one_f_one_b,
    v_placement,
    validate,
    zb_h1,
    zb_v,
)


def _ops(text: str) -> tuple[PipeOp, ...]:
    return Schedule.parse(text, placement=[0]).ranks[0]


def _kinds(s: Schedule) -> Counter[str]:
    return Counter(op.kind for op in s.ops())


@given(p=st.integers(1, 4), v=st.integers(1, 3), m=st.integers(1, 8))
def test_every_builtin_validates(p: int, v: int, m: int) -> None:
    cases = [
        (gpipe(p, p * v, m), loop_placement(p, p * v)),
        (looped_bfs(p, p * v, m), loop_placement(p, p * v)),
        (one_f_one_b(p, p, m), loop_placement(p, p)),
        (interleaved_1f1b(p, p * v, p * m), loop_placement(p, p * v)),
        (zb_h1(p, p, m), loop_placement(p, p)),
        (zb_v(p, 2 * p, m), v_placement(p)),
    ]
    for s, placement in cases:
        validate(s)
        assert s.placement == placement
        n = s.num_stages * s.microbatches
        assert _kinds(s) == (Counter({F: n, I: n, W: n}) if s.split_backward else Counter({F: n, B: n}))
        assert s.split_backward == (s.name in ("zb_h1", "zb_v"))


def test_one_f_one_b_shape() -> None:
    """Rank r warms up with p-1-r forwards, then alternates."""
    s = one_f_one_b(3, 3, 4)
    assert str(s) == (
        "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )


def test_zb_h1_defers_weights_on_later_ranks() -> None:
    """Rank r skips W in its first r steady steps; the skipped W's come at the end."""
    s = zb_h1(3, 3, 4)
    assert str(s) == (
        "rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3\n"
        "rank 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3\n"
        "rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"
    )


def test_gpipe_and_looped_bfs_orders() -> None:
    """Both run all forwards first; GPipe goes microbatch by microbatch, looped BFS stage by stage."""
    assert gpipe(2, 4, 2).ranks[0] == _ops("0F0 2F0 0F1 2F1 2B0 0B0 2B1 0B1")
    assert looped_bfs(2, 4, 2).ranks[0] == _ops("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1")


def test_bad_sizes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="one_f_one_b runs one stage per rank: stages must equal ranks"):
        one_f_one_b(2, 4, 4)
    with pytest.raises(ValueError, match=r"zb_h1 runs one stage per rank.*use interleaved_1f1b"):
        zb_h1(2, 3, 4)
    with pytest.raises(ValueError, match=r"stages must be a multiple of ranks \(2\), got stages=3; use stages="):
        looped_bfs(2, 3, 4)
    with pytest.raises(ValueError, match=r"gpipe.*multiple of ranks"):
        gpipe(3, 4, 4)
    with pytest.raises(
        ValueError, match=r"microbatches must be a multiple of ranks \(4\), as in Megatron-LM.*use microbatches=8"
    ):
        interleaved_1f1b(4, 8, 6)
    with pytest.raises(ValueError, match=r"zb_v runs two stages per rank in a V: stages must be 2 \* ranks = 6"):
        zb_v(3, 3, 6)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        gpipe(2, 2, 0)


def test_get_schedule_sources() -> None:
    by_name = get_schedule("1f1b", 2, 2, 4)
    assert by_name == one_f_one_b(2, 2, 4) and by_name.name == "1f1b"
    assert get_schedule("ZB-H1", 2, 2, 4) == zb_h1(2, 2, 4)
    assert get_schedule(gpipe, 2, 2, 3) == gpipe(2, 2, 3)
    assert get_schedule(zb_v(2, 4, 3), 2, 4, 3).name == "zb_v"
    assert get_schedule(str(one_f_one_b(2, 2, 2)), 2, 2, 2) == one_f_one_b(2, 2, 2)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v"}


def test_get_schedule_refusals() -> None:
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*'1f1b'"):
        get_schedule("pipedream", 2, 2, 2)
    with pytest.raises(
        ValueError,
        match="has ranks=2, stages=2, microbatches=2 but the pipeline needs ranks=2, stages=2, microbatches=4",
    ):
        get_schedule(one_f_one_b(2, 2, 2), 2, 2, 4)
    with pytest.raises(ScheduleError, match="no backward"):
        get_schedule("0F0\n1F0 1B0", 2, 2, 1)
    with pytest.raises(TypeError, match="a name, a function, a Schedule or text"):
        get_schedule(3, 2, 2, 2)  # type: ignore[arg-type]


def test_a_shape_mismatch_names_the_argument_to_change() -> None:
    with pytest.raises(ValueError, match=r"it runs 2 micro-batches: pass pipeline\(\.\.\., microbatches=2\)"):
        get_schedule(one_f_one_b(2, 2, 2), 2, 2, 4)
    with pytest.raises(ValueError, match=r"it has 4 stages: pass pipeline\(\.\.\., stages=4\)"):
        get_schedule(interleaved_1f1b(2, 4, 2), 2, 2, 2)
    with pytest.raises(ValueError, match="it has a line for each of 2 ranks but the pipeline axis has 3"):
        get_schedule(one_f_one_b(2, 2, 2), 3, 2, 2)


def test_schedule_text_with_several_stages_per_rank_is_its_schedule() -> None:
    """Text is read like the Schedule it parses to, whatever its number of stages per rank."""
    text = str(interleaved_1f1b(2, 4, 2))
    assert get_schedule(text, 2, 4, 2) == interleaved_1f1b(2, 4, 2)


@pytest.mark.parametrize("returned", ["0F0 0B0\n1F0 1B0", None])
def test_a_builder_returning_no_schedule_is_refused_naming_it(returned: object) -> None:
    """It failed with "'str' object has no attribute 'num_ranks'"."""

    def builder(ranks: int, stages: int, microbatches: int) -> Schedule:
        return returned  # type: ignore[return-value]

    hint = r" \(Schedule.parse\(text\) reads text\)" if isinstance(returned, str) else ""
    with pytest.raises(
        TypeError,
        match=rf"schedule builder .*builder\(2, 2, 1\) returned {type(returned).__name__}, not a Schedule: "
        rf"return one{hint}",
    ):
        get_schedule(builder, 2, 2, 1)


@pytest.mark.parametrize("name", ["zbh1", "1f1b_v2", "interleaved1f1b"])
def test_a_misspelled_name_with_digits_is_refused_not_read_as_schedule_text(name: str) -> None:
    """A name with a digit was read as schedule text, and failed as a pipeline action."""
    known = r"use one of \['1f1b', 'gpipe', .*'zb_v'\].*its text form: one line of actions per rank"
    refused = rf"unknown pipeline schedule '{name}' \(did you mean .*\): {known}"
    with pytest.raises(ValueError, match=refused):
        get_schedule(name, 2, 2, 2)
    chain, _ = sw.functionalize(mlp([3, 4, 2]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=rf"unknown pipeline schedule '{name}'"):
        sw.pipeline(step, "pp", name, 2)  # refused here, before any mesh
