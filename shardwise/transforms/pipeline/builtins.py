"""The built-in schedules, each a function ``(ranks, stages, microbatches) -> Schedule``.

References: GPipe (Huang et al. 2019); 1F1B (PipeDream-Flush, Narayanan et al.
2021); interleaved 1F1B and its warm-up counts (Megatron-LM, Narayanan et al.
2021, ``forward_backward_pipelining_with_interleaving``); looped BFS (Lamy-Poirier
2023, "Breadth-First Pipeline Parallelism"); ZB-H1 and ZB-V (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", sections 3.1 and 6). Costs and bubbles of
these orders are computed by ``simulate``, not asserted here.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from typing import TypeAlias

from .schedule import B, F, I, PipeOp, Schedule, W, loop_placement, v_placement
from .validate import validate

Builder: TypeAlias = Callable[[int, int, int], Schedule]


def _check(name: str, ranks: int, stages: int, microbatches: int) -> None:
    for arg, value in (("ranks", ranks), ("stages", stages), ("microbatches", microbatches)):
        if value < 1:
            raise ValueError(f"{name}: {arg} must be >= 1, got {value}")


def _one_stage_per_rank(name: str, ranks: int, stages: int) -> None:
    if stages != ranks:
        raise ValueError(
            f"{name} runs one stage per rank: stages must equal ranks ({ranks}), got stages={stages}; "
            f"use interleaved_1f1b or looped_bfs for several stages per rank"
        )


def _stage_multiple(name: str, ranks: int, stages: int) -> None:
    if stages % ranks:
        raise ValueError(
            f"{name} places stages in a loop over ranks: stages must be a multiple of ranks ({ranks}), "
            f"got stages={stages}; use stages={ranks * max(1, round(stages / ranks))}"
        )


def gpipe(ranks: int, stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe); each rank holds every microbatch's activations.

    Forwards run microbatch by microbatch (stage order within one), backwards
    microbatch by microbatch from the last stage down. With several stages per
    rank (loop placement) this fills the pipeline depth first; ``looped_bfs``
    is the breadth-first counterpart.
    """
    _check("gpipe", ranks, stages, microbatches)
    _stage_multiple("gpipe", ranks, stages)
    placement = loop_placement(ranks, stages)
    rows = []
    for rank in range(ranks):
        mine = [s for s in range(stages) if placement[s] == rank]
        forwards = [PipeOp(s, m, F) for m in range(microbatches) for s in mine]
        backwards = [PipeOp(s, m, B) for m in range(microbatches) for s in reversed(mine)]
        rows.append(tuple(forwards + backwards))
    return Schedule(tuple(rows), placement, microbatches, "gpipe")


def one_f_one_b(ranks: int, stages: int, microbatches: int) -> Schedule:
    """1F1B: rank r runs ``ranks - 1 - r`` warm-up forwards, then alternates F and B, then drains.

    Rank r holds at most ``min(ranks - r, microbatches)`` activations (GPipe: all of them).
    """
    _check("one_f_one_b", ranks, stages, microbatches)
    _one_stage_per_rank("one_f_one_b", ranks, stages)
    rows = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        ops = [PipeOp(rank, m, F) for m in range(warmup)]
        for m in range(microbatches - warmup):
            ops += [PipeOp(rank, warmup + m, F), PipeOp(rank, m, B)]
        ops += [PipeOp(rank, m, B) for m in range(microbatches - warmup, microbatches)]
        rows.append(tuple(ops))
    return Schedule(tuple(rows), loop_placement(ranks, stages), microbatches, "1f1b")


def interleaved_1f1b(ranks: int, stages: int, microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``v = stages // ranks`` virtual stages per rank, loop placement.

    Microbatches go in groups of ``ranks``; a rank runs one group through its
    first local stage, then the same group through its next local stage, and
    so on (backwards visit local stages in reverse). Rank r warms up with
    ``2 * (ranks - 1 - r) + (v - 1) * ranks`` forwards, then alternates F and B.
    """
    name = "interleaved_1f1b"
    _check(name, ranks, stages, microbatches)
    _stage_multiple(name, ranks, stages)
    if microbatches % ranks:
        raise ValueError(
            f"{name}: microbatches must be a multiple of ranks ({ranks}), as in Megatron-LM, "
            f"got microbatches={microbatches}; use microbatches={ranks * (microbatches // ranks + 1)}"
        )
    v = stages // ranks
    total = v * microbatches

    def op(rank: int, k: int, kind: str) -> PipeOp:
        group, within = divmod(k, ranks * v)
        chunk = within // ranks
        if kind == B:
            chunk = v - 1 - chunk
        return PipeOp(chunk * ranks + rank, group * ranks + within % ranks, kind)

    rows = []
    for rank in range(ranks):
        warmup = min(2 * (ranks - 1 - rank) + (v - 1) * ranks, total)
        ops = [op(rank, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [op(rank, warmup + k, F), op(rank, k, B)]
        ops += [op(rank, k, B) for k in range(total - warmup, total)]
        rows.append(tuple(ops))
    return Schedule(tuple(rows), loop_placement(ranks, stages), microbatches, name)


def looped_bfs(ranks: int, stages: int, microbatches: int) -> Schedule:
    """Breadth first over loop-placed stages: every microbatch through one local stage before the next.

    Backwards visit local stages in reverse, each for every microbatch.
    """
    _check("looped_bfs", ranks, stages, microbatches)
    _stage_multiple("looped_bfs", ranks, stages)
    placement = loop_placement(ranks, stages)
    rows = []
    for rank in range(ranks):
        mine = [s for s in range(stages) if placement[s] == rank]
        forwards = [PipeOp(s, m, F) for s in mine for m in range(microbatches)]
        backwards = [PipeOp(s, m, B) for s in reversed(mine) for m in range(microbatches)]
        rows.append(tuple(forwards + backwards))
    return Schedule(tuple(rows), placement, microbatches, "looped_bfs")


def zb_h1(ranks: int, stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each B split into I then W, rank r deferring its first r W's.

    Input gradients (I) travel up the pipeline without waiting for weight
    gradients, and the deferred W's fill the cool-down bubbles. Warm-up is as
    in 1F1B, so rank r holds ``(ranks - 1 - r) + 1 + r = ranks`` activations
    at most (held until W): the peak of 1F1B's rank 0. With F = I = W the
    bubble drops from 1F1B's ``(p-1)(F+B)`` to ``(p-1)(F+I-W)`` per rank.
    """
    _check("zb_h1", ranks, stages, microbatches)
    _one_stage_per_rank("zb_h1", ranks, stages)
    rows = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        ops = [PipeOp(rank, m, F) for m in range(warmup)]
        weights = 0
        for m in range(microbatches - warmup):
            ops += [PipeOp(rank, warmup + m, F), PipeOp(rank, m, I)]
            if m >= rank:
                ops.append(PipeOp(rank, weights, W))
                weights += 1
        for m in range(microbatches - warmup, microbatches):
            ops.append(PipeOp(rank, m, I))
            if m >= rank:
                ops.append(PipeOp(rank, weights, W))
                weights += 1
        ops += [PipeOp(rank, m, W) for m in range(weights, microbatches)]
        rows.append(tuple(ops))
    return Schedule(tuple(rows), loop_placement(ranks, stages), microbatches, "zb_h1")


def zb_v(ranks: int, stages: int, microbatches: int) -> Schedule:
    """ZB-V: two stages per rank folded in a V (rank r holds stages r and 2p-1-r), I/W split.

    The order follows the paper's handcrafted ZB-V (section 6): rank r warms
    up with ``2(p-r)-1`` forwards of its first stage, then alternates its two
    stages with F, I, W of each in the steady state, then drains I's and
    W's. It is built for ``max(microbatches, 2p-1)`` microbatches and the
    extra ones are dropped, which keeps every rank's order executable.
    """
    _check("zb_v", ranks, stages, microbatches)
    if stages != 2 * ranks:
        raise ValueError(
            f"zb_v runs two stages per rank in a V: stages must be 2 * ranks = {2 * ranks}, got stages={stages}"
        )
    rows = tuple(_zb_v_rank(ranks, rank, microbatches) for rank in range(ranks))
    return Schedule(tuple(rows), v_placement(ranks), microbatches, "zb_v")


def _zb_v_rank(p: int, rank: int, microbatches: int) -> tuple[PipeOp, ...]:
    down, up = rank, 2 * p - 1 - rank
    n = max(microbatches, 2 * p - 1)
    count = {(s, k): 0 for s in (down, up) for k in (F, I, W)}
    ops: list[PipeOp] = []

    def emit(*pairs: tuple[int, str]) -> None:
        for stage, kind in pairs:
            ops.append(PipeOp(stage, count[stage, kind], kind))
            count[stage, kind] += 1

    for _ in range(2 * (p - rank) - 1):
        emit((down, F))
    for _ in range(rank):
        emit((up, F), (down, F))
    for _ in range(p - rank):
        emit((up, F), (up, I), (up, W))
    while count[up, F] < count[down, F] or count[down, F] < n:
        if count[down, F] < n:
            emit((down, F))
        emit((down, I), (down, W), (up, F), (up, I), (up, W))
    for _ in range(rank):
        emit((down, I), (up, I))
    for _ in range(p - rank):
        emit((down, I), (down, W))
    while count[up, W] < count[up, I]:
        emit((up, W))
    while count[down, W] < count[down, I]:
        emit((down, W))
    return tuple(op for op in ops if op.microbatch < microbatches)


SCHEDULES: Mapping[str, Builder] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zb_v": zb_v,
}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def check_schedule_name(spec: str) -> None:
    """Refuse a string that is neither a built-in name nor schedule text (a misspelled name was
    read as text, and failed as a pipeline action)."""
    if _key(spec) in SCHEDULES or _is_schedule_text(spec):
        return
    close = difflib.get_close_matches(_key(spec), list(SCHEDULES), n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown pipeline schedule {spec!r}{guess}: use "
        f"one of {sorted(SCHEDULES)}, a function (ranks, stages, microbatches) -> Schedule, a "
        "Schedule, or its text form: one line of actions per rank, such as '0F0 0F1 0B0 0B1'"
    )


def _is_schedule_text(spec: str) -> bool:
    """Several lines, a ``rank k:`` prefix, or one line whose every token is an action."""
    lines = [line.split("#", 1)[0].strip() for line in spec.splitlines()]
    if sum(1 for line in lines if line) > 1 or ":" in spec:
        return True
    tokens = spec.split()
    return bool(tokens) and all(_is_action(token) for token in tokens)


def _is_action(token: str) -> bool:
    try:
        PipeOp.parse(token)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def parse_text(text: str) -> Schedule:
    """Schedule text read once: a spec asks for its stage count and shape at every plan and step."""
    return Schedule.parse(text)


def fixed_schedule(spec: object) -> Schedule | None:
    """The schedule ``spec`` is when its shape does not depend on the mesh: a ``Schedule``, or
    schedule text parsed; None for a built-in's name or a builder (built per mesh)."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, str) and _key(spec) not in SCHEDULES:
        check_schedule_name(spec)
        return parse_text(spec)
    return None


def check_schedule_type(spec: object) -> None:
    """Refuse what is not a schedule at all (before a step runs, where the user passed it)."""
    if isinstance(spec, str):
        check_schedule_name(spec)
    elif not isinstance(spec, Schedule) and not callable(spec):
        raise TypeError(
            f"pipeline(schedule={spec!r}): a schedule is a built-in's name (one of {sorted(SCHEDULES)}), "
            f"a function (ranks, stages, microbatches) -> Schedule, a Schedule or its text form, "
            f"got {type(spec).__name__}"
        )


def get_schedule(
    spec: str | Builder | Schedule, ranks: int, stages: int, microbatches: int
) -> Schedule:
    """A validated schedule from a registry name, a builder, a ``Schedule`` or its text form.

    Whatever the source, the result must have ``ranks`` ranks, ``stages``
    stages and ``microbatches`` microbatches, and pass ``validate``.
    """
    fixed = fixed_schedule(spec)
    if fixed is not None:
        schedule = fixed
    elif isinstance(spec, str):
        schedule = SCHEDULES[_key(spec)](ranks, stages, microbatches)
    elif callable(spec):
        schedule = spec(ranks, stages, microbatches)
        if not isinstance(schedule, Schedule):
            builder = getattr(spec, "__qualname__", repr(spec))
            text = " (Schedule.parse(text) reads text)" if isinstance(schedule, str) else ""
            raise TypeError(
                f"schedule builder {builder}({ranks}, {stages}, {microbatches}) returned "
                f"{type(schedule).__name__}, not a Schedule: return one{text}"
            )
    else:
        raise TypeError(f"a pipeline schedule is a name, a function, a Schedule or text, got {type(spec).__name__}")
    check_shape(schedule, ranks, stages, microbatches)
    validate(schedule)
    return schedule


def check_shape(schedule: Schedule, ranks: int, stages: int, microbatches: int) -> None:
    """Refuse ``schedule`` unless it has this many ranks, stages and micro-batches, naming what to change."""
    found = (schedule.num_ranks, schedule.num_stages, schedule.microbatches)
    if found == (ranks, stages, microbatches):
        return
    fixes = []
    if found[0] != ranks:
        fixes.append(
            f"it has a line for each of {found[0]} ranks but the pipeline axis has {ranks}: run it on a mesh "
            f"whose pipeline axis has size {found[0]}, or write one line per rank"
        )
    if found[1] != stages:
        fixes.append(f"it has {found[1]} stages: pass pipeline(..., stages={found[1]})")
    if found[2] != microbatches:
        fixes.append(f"it runs {found[2]} micro-batches: pass pipeline(..., microbatches={found[2]})")
    raise ValueError(
        f"schedule {schedule.name!r} has ranks={found[0]}, stages={found[1]}, microbatches={found[2]} "
        f"but the pipeline needs ranks={ranks}, stages={stages}, microbatches={microbatches}; " + "; ".join(fixes)
    )


def check_every_rank_holds_a_stage(schedule: Schedule, axis: str) -> None:
    """Refuse a schedule with an idle rank for a pipeline: each rank of the axis runs the stages it
    holds, and one holding none would have no part of the model (``validate`` accepts it, as a
    schedule to simulate or draw)."""
    idle = [rank for rank in range(schedule.num_ranks) if not schedule.stages_of(rank)]
    if idle:
        held = schedule.num_ranks - len(idle)
        raise ValueError(
            f"schedule {schedule.name!r}: rank(s) {idle} of pipeline axis {axis!r} hold no stage "
            f"(placement {list(schedule.placement)}); a pipeline needs every rank of its axis to hold one. "
            f"Give each of those ranks a stage, or drop their lines (renumbering the ranks) and run on a "
            f"mesh with {axis}={held}"
        )
