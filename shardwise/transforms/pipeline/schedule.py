"""Pipeline schedules as plain data: one list of ``PipeOp`` per rank, plus a stage placement.

A schedule says *what* each rank computes and in which order; it says nothing
about tensors, so it can be written by hand, printed, parsed back, validated,
simulated and drawn without a runtime. Its text form is one line per rank::

    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1

where ``0F1`` is the forward of stage 0 on microbatch 1. Kinds: ``F``
forward, ``B`` full backward, ``I`` backward for the stage's input only,
``W`` backward for its weights only (``I`` + ``W`` replace ``B`` in
zero-bubble schedules).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

F, B, I, W = "F", "B", "I", "W"  # noqa: E741  (the kind names of the zero-bubble paper)
KINDS = (F, B, I, W)

_OP = re.compile(r"(\d+)([FBIW])(\d+)")
_RANK_PREFIX = re.compile(r"rank\s+(\d+)\s*:", re.IGNORECASE)


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the rank, the action and the rule."""


@dataclass(frozen=True, order=True)
class PipeOp:
    """One compute action: ``kind`` of ``stage`` on ``microbatch``; prints as ``0F3``."""

    stage: int
    microbatch: int
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PipeOp kind must be one of {'/'.join(KINDS)}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> PipeOp:
        """``PipeOp.parse("3W12") == PipeOp(stage=3, microbatch=12, kind="W")``."""
        match = _OP.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read {text!r} as a pipeline action: write <stage><kind><microbatch>, "
                f"kind one of {'/'.join(KINDS)}, e.g. '0F3'"
            )
        return cls(int(match[1]), int(match[3]), match[2])


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists in execution order, ``placement[stage]`` = the rank holding it.

    ``name`` is a label: it is not compared, so a schedule equals its parsed
    text form. Construction only normalizes to tuples; ``validate`` checks
    the rules (every op present once, placement, order, no deadlock).
    """

    ranks: tuple[tuple[PipeOp, ...], ...]
    placement: tuple[int, ...]
    microbatches: int
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        # Accept lists and action strings ("0F3") from hand-written code; store tuples of PipeOps
        # so schedules hash and compare, and validate reads actions, not the characters of a string.
        if isinstance(self.ranks, str):
            raise TypeError(
                "Schedule(ranks=...) got a string: give one list of actions per rank, or read the text "
                "form with Schedule.parse(text)"
            )
        object.__setattr__(self, "ranks", tuple(_rank_ops(rank, ops) for rank, ops in enumerate(self.ranks)))
        object.__setattr__(self, "placement", tuple(
            _whole(rank, f"placement[{stage}]", f"the rank holding stage {stage}")
            for stage, rank in enumerate(self.placement)
        ))
        count = _whole(self.microbatches, "microbatches", "the number of micro-batches")
        object.__setattr__(self, "microbatches", count)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def split_backward(self) -> bool:
        """True if any backward is split into ``I`` and ``W``."""
        return any(op.kind in (I, W) for op in self.ops())

    def ops(self) -> Iterator[PipeOp]:
        """Every action, rank by rank, in order."""
        for ops in self.ranks:
            yield from ops

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``placement`` puts on ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    @cached_property
    def _all_ops(self) -> frozenset[PipeOp]:
        return frozenset(self.ops())

    def dependencies(self, op: PipeOp) -> tuple[PipeOp, ...]:
        """The actions ``op`` needs the results of (on its own rank or another one).

        F(s, m) needs F(s-1, m); B or I of (s, m) needs F(s, m) and, below the
        last stage, the input gradient of (s+1, m), i.e. its B or its I;
        W(s, m) needs I(s, m).
        """
        s, m = op.stage, op.microbatch
        if op.kind == F:
            return (PipeOp(s - 1, m, F),) if s > 0 else ()
        if op.kind == W:
            return (PipeOp(s, m, I),)
        deps = [PipeOp(s, m, F)]
        if s + 1 < self.num_stages:
            full = PipeOp(s + 1, m, B)
            deps.append(full if full in self._all_ops else PipeOp(s + 1, m, I))
        return tuple(deps)

    def __str__(self) -> str:
        return "\n".join(
            f"rank {r}:" + "".join(f" {op}" for op in ops) for r, ops in enumerate(self.ranks)
        )

    @classmethod
    def parse(
        cls, text: str, *, placement: Sequence[int] | None = None, name: str = "custom"
    ) -> Schedule:
        """Read the text form (``str(schedule)``); ``parse(str(s)) == s``.

        One line per rank, optionally prefixed ``rank k:`` (then lines may come
        in any order and an idle rank is written ``rank k:``). Blank lines and
        ``#`` comments are ignored. ``placement`` is inferred when every
        stage's actions sit on one rank; pass it otherwise. The number of
        microbatches is one more than the largest microbatch index.
        """
        prefixed: dict[int, tuple[PipeOp, ...]] = {}
        plain: list[tuple[PipeOp, ...]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            prefix = _RANK_PREFIX.match(line)
            body = line[prefix.end() :] if prefix else line
            try:
                ops = tuple(PipeOp.parse(token) for token in body.split())
            except ValueError as err:
                raise ScheduleError(f"line {lineno}: {err}") from None
            if prefix is None:
                plain.append(ops)
                continue
            rank = int(prefix[1])
            if rank in prefixed:
                raise ScheduleError(f"line {lineno}: rank {rank} is listed twice")
            prefixed[rank] = ops
        if prefixed and plain:
            raise ScheduleError("either prefix every rank line with 'rank k:' or none of them")
        if prefixed:
            missing = sorted(set(range(max(prefixed) + 1)) - set(prefixed))
            if missing:
                raise ScheduleError(f"no line for rank(s) {missing}: write 'rank k:' for an idle rank")
            plain = [prefixed[r] for r in range(len(prefixed))]
        if not plain:
            raise ScheduleError("the schedule text has no rank lines")
        all_ops = [op for ops in plain for op in ops]
        microbatches = max((op.microbatch for op in all_ops), default=-1) + 1
        if placement is None:
            placement = _infer_placement(plain)
        return cls(tuple(plain), tuple(placement), microbatches, name)


def _whole(value: Any, where: str, what: str) -> int:
    """``value`` as an int (a numpy integer too), or a TypeError naming ``where``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"Schedule({where.split('[')[0]}=...): {where} is {value!r}; it is {what}, an int") from None


def _rank_ops(rank: int, ops: Any) -> tuple[PipeOp, ...]:
    """Rank ``rank``'s actions as PipeOps: each a PipeOp or its text (``"0F3"``)."""
    if isinstance(ops, str):
        raise TypeError(
            f"Schedule(ranks=...): ranks[{rank}] is the string {ops!r}; give its actions as a list "
            f"({ops.split()!r}), or read the whole text form with Schedule.parse(text)"
        )
    if isinstance(ops, PipeOp) or not isinstance(ops, Iterable):
        raise TypeError(
            f"Schedule(ranks=...): ranks[{rank}] is {ops!r}; give one list of actions per rank, "
            "such as [sw.schedules.PipeOp(0, 0, 'F'), sw.schedules.PipeOp(0, 0, 'B')] or ['0F0', '0B0']"
        )
    found: list[PipeOp] = []
    for index, op in enumerate(ops):
        if isinstance(op, str):
            try:
                op = PipeOp.parse(op)
            except ValueError as err:
                raise ScheduleError(f"Schedule(ranks=...): ranks[{rank}][{index}]: {err}") from None
        elif not isinstance(op, PipeOp):
            raise TypeError(
                f"Schedule(ranks=...): ranks[{rank}][{index}] is {op!r} ({type(op).__name__}); an action is "
                "a PipeOp or its text, such as '0F3'"
            )
        found.append(op)
    return tuple(found)


def _infer_placement(ranks: Sequence[Sequence[PipeOp]]) -> tuple[int, ...]:
    holders: dict[int, set[int]] = {}
    for rank, ops in enumerate(ranks):
        for op in ops:
            holders.setdefault(op.stage, set()).add(rank)
    num_stages = max(holders, default=-1) + 1
    for stage in range(num_stages):
        where = sorted(holders.get(stage, ()))
        if len(where) != 1:
            found = f"on ranks {where}" if where else "nowhere"
            raise ScheduleError(
                f"cannot infer the placement: stage {stage} has actions {found}; "
                f"pass placement=[rank of stage 0, rank of stage 1, ...]"
            )
    return tuple(next(iter(holders[s])) for s in range(num_stages))


def loop_placement(ranks: int, stages: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % ranks`` (interleaved / looped schedules)."""
    if ranks < 1 or stages < 1:
        raise ValueError(f"loop_placement needs ranks >= 1 and stages >= 1, got ranks={ranks}, stages={stages}")
    return tuple(s % ranks for s in range(stages))


def v_placement(ranks: int) -> tuple[int, ...]:
    """``2 * ranks`` stages folded in a V: stage ``s`` on rank ``s``, then back up (ZB-V)."""
    if ranks < 1:
        raise ValueError(f"v_placement needs ranks >= 1, got {ranks}")
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))
