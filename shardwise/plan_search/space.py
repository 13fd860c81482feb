"""The search space: which candidates to try for a world size, and the ones left out before
any transform is applied (with the reason).

Every ``dp x pp x tp`` factorisation of the world (of what is left of it after the context
parallel, expert parallel and HSDP replica sizes asked for), and for each the options that
apply: ZeRO stages over dp (and resharding for ZeRO-3 under a pipeline), schedules and
micro-batch counts over pp, remat policies and precisions everywhere. Options that do not apply
to a shape are not multiplied in (a schedule without pp), and schedules whose table is the same
at a micro-batch count (GPipe and 1F1B at one micro-batch: the same actions on every rank) are
one candidate, the first listed: so every candidate is distinct and is planned once. Whether a
candidate can work is for the transforms to say (``Candidate.apply``): the space knows nothing
of the composition rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from ..engine.layout.precision import Policy
from ..transforms.pipeline.builtins import check_schedule_name, get_schedule
from ..transforms.pipeline.schedule import Schedule
from ..transforms.pipeline.spec import PipelineSpec
from ..transforms.remat.rewrite import POLICIES
from .candidate import Candidate


@dataclass(frozen=True)
class Space:
    """The options to combine. ``remat`` and ``precision`` hold None for "leave as it is".

    >>> [str(c) for c in Space(zero_stages=(3,), remat=(None,)).candidates(2, tensor_parallel=False)]
    ['dp2 zero3', 'pp2 gpipe mb1', 'pp2 gpipe mb2', 'pp2 gpipe mb4', 'pp2 1f1b mb2', 'pp2 1f1b mb4']
    """

    zero_stages: tuple[int, ...] = (1, 2, 3)
    reshard_under_pipeline: tuple[bool | None, ...] = (None,)
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    microbatches: tuple[int, ...] = (1, 2, 4)
    remat: tuple[str | None, ...] = (None, "nothing_saveable")
    precision: tuple[str | None, ...] = (None,)
    max_tp: int | None = None
    max_pp: int | None = None
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] = (1,)
    replicate: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for name in ("zero_stages", "schedules", "microbatches", "remat", "precision", "reshard_under_pipeline",
                     "cp", "ep", "replicate"):
            value = getattr(self, name)
            if not isinstance(value, tuple | list):  # (a str would be searched letter by letter)
                raise TypeError(f"Space({name}={value!r}): a tuple of options, e.g. {name}=({value!r},)")
            if not value:
                raise ValueError(f"Space({name}=()): give at least one option (None where it means 'as it is')")
        for schedule in self.schedules:
            if not isinstance(schedule, str):
                raise TypeError(f"Space(schedules={self.schedules!r}): {schedule!r} is not a schedule's name")
            try:
                check_schedule_name(schedule)
            except ValueError as err:
                raise ValueError(f"Space(schedules={self.schedules!r}): {err}") from None
        if unknown := [r for r in self.remat if r is not None and r not in POLICIES]:
            raise ValueError(f"Space(remat={self.remat!r}): {unknown} are not remat policies; use None or one of "
                             f"{sorted(POLICIES)}")
        for text in self.precision:
            if text is not None:
                try:
                    Policy.parse(text)
                except (ValueError, TypeError, AttributeError) as err:
                    raise ValueError(f"Space(precision={self.precision!r}): {text!r} is not a precision policy "
                                     f"({err})") from None
        if bad := [s for s in self.zero_stages if s not in (1, 2, 3)]:
            raise ValueError(f"Space(zero_stages={self.zero_stages}): {bad} are not ZeRO stages (1, 2, 3)")
        for name in ("microbatches", "cp", "ep", "replicate"):
            values = getattr(self, name)
            if bad := [k for k in values if isinstance(k, bool) or not isinstance(k, int) or k < 1]:
                raise ValueError(f"Space({name}={values}): {bad} are not counts >= 1")

    def shapes(self, world: int, tensor_parallel: bool = True) -> Iterator[tuple[int, int, int]]:
        """(dp, pp, tp) with ``dp * pp * tp == world``: data parallel first, then pipelines, then tp."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world={world!r}: the number of ranks is an int >= 1")
        for dp in sorted((d for d in range(1, world + 1) if world % d == 0), reverse=True):
            rest = world // dp
            for pp in sorted(d for d in range(1, rest + 1) if rest % d == 0):
                tp = rest // pp
                if (tp > 1 and not tensor_parallel) or (self.max_tp and tp > self.max_tp) or (
                        self.max_pp and pp > self.max_pp):
                    continue
                yield dp, pp, tp

    def candidates(self, world: int, tensor_parallel: bool = True, *, cp: bool = True,
                   ep: bool = True) -> Iterator[Candidate]:
        """Every combination of the options that applies to each shape of ``world`` ranks;
        ``tensor_parallel=False`` (no TP plan) leaves out the shapes with tp > 1, ``cp=False`` and
        ``ep=False`` (the model allows neither) those with cp > 1 or ep > 1."""
        for rep, e, c in itertools.product(self.replicate, self.ep if ep else (1,), self.cp if cp else (1,)):
            if world % (rep * e * c):
                continue
            for dp, pp, tp in self.shapes(world // (rep * e * c), tensor_parallel):
                if rep > 1 and dp == 1:
                    continue  # HSDP replicates shards: it needs a sharded axis
                yield from self._options(dp, pp, tp, rep, e, c)

    def _options(self, dp: int, pp: int, tp: int, rep: int, e: int, c: int) -> Iterator[Candidate]:
        zeros: tuple[int, ...] = self.zero_stages if dp > 1 else (0,)
        pipes: list[tuple[str | None, int]] = _distinct_schedules(self.schedules, self.microbatches, pp) \
            if pp > 1 else [(None, 1)]
        for zero, (schedule, k), remat, precision in itertools.product(zeros, pipes, self.remat, self.precision):
            reshards = self.reshard_under_pipeline if zero == 3 and pp > 1 else (None,)
            for reshard in reshards:
                yield Candidate(dp=dp, tp=tp, pp=pp, zero_stage=zero, reshard_after_forward=reshard,
                                schedule=schedule, microbatches=k, remat=remat, precision=precision,
                                cp=c, ep=e, replicate=rep)


def _distinct_schedules(names: tuple[str, ...], microbatches: tuple[int, ...], pp: int) -> list[tuple[str | None, int]]:
    """(schedule, micro-batches) pairs, less those whose schedule table equals an earlier one's at that
    count (a schedule that cannot be built for it is kept: the transform says why when applied)."""
    kept: list[tuple[str | None, int]] = []
    tables: set[tuple[Schedule, int]] = set()
    for name in names:
        for k in microbatches:
            try:  # the table the pipeline transform will run (its stage count for this schedule)
                table = get_schedule(name, pp, PipelineSpec("pp", name, k).num_stages(pp), k)
            except (ValueError, TypeError):
                kept.append((name, k))
                continue
            if (table, k) not in tables:
                tables.add((table, k))
                kept.append((name, k))
    return kept
