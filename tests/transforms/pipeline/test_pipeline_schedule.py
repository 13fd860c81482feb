"""The schedule data model: PipeOp, Schedule, its text form and the placements."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.transforms.pipeline import (
    SCHEDULES,
    B,
    F,
    I,
    PipeOp,
    Schedule,
    ScheduleError,
    W,
    loop_placement,
    v_placement,
    validate,
)


def random_valid_schedule(rng: random.Random) -> Schedule:
    """Any placement, a random mix of B and I/W, and each rank's list cut from one random
    topological order of all actions, which is therefore always executable."""
    ranks = rng.randint(1, 4)
    stages = rng.randint(1, 6)
    microbatches = rng.randint(1, 4)
    placement = tuple(rng.randrange(ranks) for _ in range(stages))
    split = {(s, m): rng.random() < 0.5 for s in range(stages) for m in range(microbatches)}
    todo = {PipeOp(s, m, F) for s in range(stages) for m in range(microbatches)}
    for (s, m), is_split in split.items():
        todo |= {PipeOp(s, m, I), PipeOp(s, m, W)} if is_split else {PipeOp(s, m, B)}
    probe = Schedule((tuple(todo),), (0,) * stages, microbatches)  # only to ask for dependencies
    done: set[PipeOp] = set()
    rows: list[list[PipeOp]] = [[] for _ in range(ranks)]
    while todo:
        ready = sorted(op for op in todo if all(d in done for d in probe.dependencies(op)))
        op = rng.choice(ready)
        todo.remove(op)
        done.add(op)
        rows[placement[op.stage]].append(op)
    return Schedule(tuple(tuple(r) for r in rows), placement, microbatches)


def builtin(name: str, p: int, v: int, m: int) -> Schedule:
    if name in ("1f1b", "zb_h1"):
        return SCHEDULES[name](p, p, m)
    if name == "zb_v":
        return SCHEDULES[name](p, 2 * p, m)
    if name == "interleaved_1f1b":
        return SCHEDULES[name](p, p * v, p * m)
    return SCHEDULES[name](p, p * v, m)


def test_pipe_op_text() -> None:
    assert str(PipeOp(0, 0, F)) == "0F0"
    assert str(PipeOp(3, 12, W)) == "3W12"
    assert PipeOp.parse("3W12") == PipeOp(3, 12, W)
    with pytest.raises(ValueError, match="kind must be one of"):
        PipeOp(0, 0, "X")
    with pytest.raises(ValueError, match=r"<stage><kind><microbatch>"):
        PipeOp.parse("F0")
    assert sorted([PipeOp(1, 0, F), PipeOp(0, 1, F), PipeOp(0, 0, B)]) == [
        PipeOp(0, 0, B),
        PipeOp(0, 1, F),
        PipeOp(1, 0, F),
    ]


def test_schedule_text_form_and_properties() -> None:
    s = Schedule(([PipeOp(0, 0, F), PipeOp(0, 0, B)], [PipeOp(1, 0, F), PipeOp(1, 0, I), PipeOp(1, 0, W)]), [0, 1], 1)
    assert str(s) == "rank 0: 0F0 0B0\nrank 1: 1F0 1I0 1W0"
    assert (s.num_ranks, s.num_stages, s.split_backward) == (2, 2, True)
    assert isinstance(s.ranks[0], tuple) and s.placement == (0, 1)
    assert s.stages_of(1) == (1,)
    assert s.dependencies(PipeOp(0, 0, B)) == (PipeOp(0, 0, F), PipeOp(1, 0, I))
    assert s.dependencies(PipeOp(1, 0, W)) == (PipeOp(1, 0, I),)
    assert s.dependencies(PipeOp(1, 0, F)) == (PipeOp(0, 0, F),)


def test_parse_forms() -> None:
    text = """
    # a hand-written 1F1B on two ranks
    rank 1: 1F0 1B0 1F1 1B1   # lines may come in any order
    rank 0: 0F0 0F1 0B0 0B1

    rank 2:
    """
    s = Schedule.parse(text, placement=[0, 1], name="mine")
    assert s.ranks[2] == () and s.placement == (0, 1) and s.microbatches == 2 and s.name == "mine"
    plain = Schedule.parse("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1")
    assert plain.placement == (0, 1) and plain.num_ranks == 2
    assert Schedule.parse(str(plain)) == plain


def test_parse_errors() -> None:
    with pytest.raises(ScheduleError, match="stage 0 has actions on ranks \\[0, 1\\]; pass placement="):
        Schedule.parse("0F0 0B0\n0F1 0B1")
    with pytest.raises(ScheduleError, match="stage 0 has actions nowhere"):
        Schedule.parse("1F0 1B0")
    with pytest.raises(ScheduleError, match="line 2: cannot read 'X'"):
        Schedule.parse("0F0 0B0\nX")
    with pytest.raises(ScheduleError, match="rank 0 is listed twice"):
        Schedule.parse("rank 0: 0F0\nrank 0: 0B0")
    with pytest.raises(ScheduleError, match=r"no line for rank\(s\) \[1\]"):
        Schedule.parse("rank 0: 0F0 0B0\nrank 2:")
    with pytest.raises(ScheduleError, match="either prefix every rank line"):
        Schedule.parse("rank 0: 0F0 0B0\n1F0 1B0")
    with pytest.raises(ScheduleError, match="no rank lines"):
        Schedule.parse("# nothing\n")
    # Explicit placement lets a stage's ops sit on a wrong rank, for validate to refuse.
    wrong = Schedule.parse("0F0 0B0\n0F1 0B1", placement=[0])
    with pytest.raises(ScheduleError, match="rank 1, action 0 \\(0F1\\): stage 0 is placed on rank 0"):
        validate(wrong)


@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 4),
    v=st.integers(1, 3),
    m=st.integers(1, 6),
)
def test_round_trip_builtins(name: str, p: int, v: int, m: int) -> None:
    s = builtin(name, p, v, m)
    again = Schedule.parse(str(s))
    assert again == s
    assert str(again) == str(s)


@given(rng=st.randoms(use_true_random=False))
def test_round_trip_random_valid(rng: random.Random) -> None:
    s = random_valid_schedule(rng)
    validate(s)  # the generator's promise
    assert Schedule.parse(str(s), placement=s.placement) == s
    # Every stage has actions, so the placement is also recovered from the text alone.
    assert Schedule.parse(str(s)) == s


def test_placements() -> None:
    assert loop_placement(2, 6) == (0, 1, 0, 1, 0, 1)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError, match="ranks >= 1"):
        loop_placement(0, 2)
    with pytest.raises(ValueError, match="ranks >= 1"):
        v_placement(0)


def test_a_hand_built_schedule_reads_actions_written_as_text() -> None:
    """Actions given as their text ("0F0") are read as PipeOps, as Schedule.parse reads them: they
    were stored as strings, and validate failed with "'str' object has no attribute 'stage'"."""
    by_text = Schedule([["0F0", "0B0"], ["1F0", "1B0"]], [0, 1], 1)
    assert by_text == Schedule.parse("0F0 0B0\n1F0 1B0")
    assert all(isinstance(op, PipeOp) for op in by_text.ops())
    validate(by_text)
    mixed = Schedule([[PipeOp(0, 0, F), "0B0"], ["1F0", PipeOp(1, 0, B)]], (0, 1), 1)
    assert mixed == by_text


def test_a_hand_built_schedule_refuses_what_is_not_an_action_naming_where() -> None:
    with pytest.raises(ScheduleError, match=r"ranks\[1\]\[1\]: cannot read '1X0' as a pipeline action"):
        Schedule([["0F0", "0B0"], ["1F0", "1X0"]], [0, 1], 1)
    with pytest.raises(TypeError, match=r"ranks\[0\]\[1\] is 3 \(int\); an action is a PipeOp or its text"):
        Schedule([["0F0", 3]], [0], 1)
    with pytest.raises(TypeError, match=r"ranks\[0\] is the string '0F0 0B0'.*\['0F0', '0B0'\].*Schedule.parse"):
        Schedule(["0F0 0B0"], [0], 1)
    with pytest.raises(TypeError, match=r"got a string: .*Schedule.parse\(text\)"):
        Schedule("0F0 0B0", [0], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"placement\[1\] is '1'; it is the rank holding stage 1, an int"):
        Schedule([["0F0", "0B0"], ["1F0", "1B0"]], [0, "1"], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"microbatches is 1.0; it is the number of micro-batches, an int"):
        Schedule([["0F0", "0B0"]], [0], 1.0)  # type: ignore[arg-type]
