"""validate(): broken schedules are refused with a message naming the rank, the action and the rule."""

from __future__ import annotations

import pytest

from shardwise.transforms.pipeline import (
    Schedule,
    ScheduleError,
    one_f_one_b,
    simulate,
    validate,
)


def refused(text: str, match: str, placement: list[int] | None = None, microbatches: int | None = None) -> str:
    s = Schedule.parse(text, placement=placement)
    if microbatches is not None:
        s = Schedule(s.ranks, s.placement, microbatches)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(s)
    return str(info.value)


def test_valid_ones_pass() -> None:
    validate(one_f_one_b(3, 3, 5))
    validate(Schedule.parse("0F0 1F0 1I0 0B0 1W0", placement=[0, 0]))
    assert issubclass(ScheduleError, ValueError)


def test_missing_backward() -> None:
    refused(
        "rank 0: 0F0 0F1 0B0\nrank 1: 1F0 1B0 1F1 1B1",
        r"rank 0, stage 0, microbatch 1: no backward; add 0B1, or 0I1 and 0W1, to rank 0",
    )


def test_missing_forward_and_half_split() -> None:
    refused("rank 0: 0F0 0B0 0B1", r"stage 0, microbatch 1: no forward; add 0F1 to rank 0")
    refused("rank 0: 0F0 0I0", r"a split backward needs both I and W; add 0W0")
    refused("rank 0: 0F0 0B0 0I0 0W0", r"both a full backward \(B\) and a split one")


def test_forward_after_backward() -> None:
    refused(
        "rank 0: 0F0 0B1 0F1 0B0\nrank 1: 1F0 1B0 1F1 1B1",
        r"rank 0, action 1 \(0B1\) comes before 0F1 \(action 2\), which it needs: on a stage, F comes before B or I",
    )


def test_weight_before_input() -> None:
    refused("rank 0: 0F0 0W0 0I0", r"rank 0, action 1 \(0W0\) comes before 0I0 .*I comes before W")


def test_same_rank_stage_order() -> None:
    refused(
        "rank 0: 1F0 0F0 0B0 1B0",
        r"rank 0, action 0 \(1F0\) comes before 0F0 \(action 1\), which it needs: F\(s, m\) needs F\(s-1, m\)",
        placement=[0, 0],
    )
    refused(
        "rank 0: 0F0 1F0 0B0 1B0",
        r"rank 0, action 2 \(0B0\) comes before 1B0 .*the backward of \(s, m\) needs that of \(s\+1, m\)",
        placement=[0, 0],
    )


def test_wrong_rank() -> None:
    refused(
        "rank 0: 0F0 0B0 1F0\nrank 1: 1B0",
        r"rank 0, action 2 \(1F0\): stage 1 is placed on rank 1, so its actions belong on rank 1",
        placement=[0, 1],
    )


def test_out_of_range_and_duplicates() -> None:
    refused(
        "rank 0: 0F0 0B0 0F1 0B1",
        r"rank 0, action 2 \(0F1\): microbatch 1 out of range.*microbatches 0..0",
        microbatches=1,
    )
    refused("rank 0: 0F0 0B0 1F0", r"rank 0, action 2 \(1F0\): stage 1 out of range.*stages 0..0", placement=[0])
    refused(
        "rank 0: 0F0 0F0 0B0",
        r"rank 0, action 1 \(0F0\): a second F of stage 0, microbatch 0 \(the first is rank 0, action 0\)",
    )
    refused("rank 0: 0F0 0B0", r"placement\[0\] = 3, but the schedule has ranks 0..0", placement=[3])


def test_cross_rank_cycle_deadlocks() -> None:
    """Rank 1 starts microbatch 1 first while rank 0 insists on finishing microbatch 0: a cycle."""
    text = "rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0"
    message = refused(text, "the schedule deadlocks")
    assert "rank 0 waits at 0B0 (action 1) for 1B0, which rank 1 reaches only after 1F1" in message
    assert "rank 1 waits at 1F1 (action 0) for 0F1, which rank 0 reaches only after 0B0" in message
    assert "cycle: rank 0 -> rank 1 -> rank 0" in message
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(Schedule.parse(text))


def test_rank_blocked_behind_a_cycle_is_listed() -> None:
    """Rank 2 is not in the cycle but waits on it: the message lists it with what it waits for."""
    text = "rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0\nrank 2: 2F0 2B0 2F1 2B1"
    message = refused(text, "deadlocks")
    assert "rank 2 waits at 2F0 (action 0) for 1F0, which rank 1 reaches only after 1F1" in message
    assert "cycle: rank 0 -> rank 1 -> rank 0" in message


def test_cycle_through_shared_ranks() -> None:
    """Four stages looped over two ranks; rank 1 runs stage 3 before the stage-1 forward rank 0 needs."""
    text = "rank 0: 0F0 2F0 2B0 0B0\nrank 1: 3F0 1F0 3B0 1B0"
    message = refused(text, "deadlocks", placement=[0, 1, 0, 1])
    assert "rank 0 waits at 2F0 (action 1) for 1F0, which rank 1 reaches only after 3F0" in message
    assert "rank 1 waits at 3F0 (action 0) for 2F0, which rank 0 has reached but cannot run yet" in message
