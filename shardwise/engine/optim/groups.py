"""Parameter groups: per-parameter weight decay, learning-rate scale, or no update at all.

A :class:`Group` picks parameters by name pattern (``fnmatch``, case-sensitive) and/or a
predicate on ``(name, meta tensor)``, and says how they differ from the optimizer's
defaults; optax's ``masked`` / ``multi_transform`` label parameters the same way::

    adamw(3e-4, weight_decay=0.1, groups=[group("*.bias", "*norm*", weight_decay=0.0)])

Rules, stated once:

- The first group that matches a parameter wins; unmatched parameters take the defaults.
- A group that gets no parameter (it matches none, or only ones an earlier group took) is
  refused: a misspelled pattern must not train every parameter with the defaults silently.
- A parameter's names are its path in the tree (``"layer.local"``) and, under a Step, its
  module's ``state_dict`` key; a pattern may match either. The predicate gets the first
  name and a meta tensor of the parameter's *global* shape and stored dtype, so it decides
  alike on one device, on a tensor-parallel slice and on a ZeRO shard.

The optimizers apply options run by run (:class:`Runs`): a leaf is cut into contiguous
element ranges, each with one :class:`Options`. A whole tensor is one run; a ZeRO flat
shard, which mixes parameters, is one run per parameter range it holds. The math is
elementwise with scalar options, so every element sees the same operations and scalars
as in the unsharded update: the results agree bitwise.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

__all__ = ["Group", "Options", "ParamGroups", "ParamInfo", "Pieces", "Runs", "group", "tree_runs"]

Predicate = Callable[[str, Tensor], bool]


@dataclass(frozen=True)
class Options:
    """What one parameter's update uses: its weight decay, a factor on the learning rate, and
    whether it is frozen (not updated at all: neither it nor its optimizer state changes)."""

    weight_decay: float
    lr_scale: float = 1.0
    frozen: bool = False


@dataclass(frozen=True)
class Group:
    """Parameters chosen by ``patterns`` (any may match) and ``where`` (must also hold), and the
    options that replace the defaults for them (None: the optimizer's)."""

    patterns: tuple[str, ...] = ()
    where: Predicate | None = None
    weight_decay: float | None = None
    lr_scale: float = 1.0
    frozen: bool = False

    def __post_init__(self) -> None:
        if not self.patterns and self.where is None:
            raise ValueError(
                f"{self}: selects nothing; give name patterns (e.g. '*.bias') or where="
            )
        bad = [p for p in self.patterns if not isinstance(p, str) or not p]
        if bad:
            raise TypeError(f"{self}: patterns must be non-empty strings, got {bad!r}")
        if self.where is not None and not callable(self.where):
            raise TypeError(f"{self}: where= must be a callable (name, tensor) -> bool")
        for name, value in (("weight_decay", self.weight_decay), ("lr_scale", self.lr_scale)):
            if value is not None and (not value >= 0 or math.isinf(value)):
                raise ValueError(f"{self}: {name} must be finite and >= 0, got {value}")
        if self.frozen and (self.weight_decay is not None or self.lr_scale != 1.0):
            raise ValueError(
                f"{self}: a frozen group is not updated, so weight_decay and lr_scale would be "
                "ignored; "
                "drop them or frozen=True"
            )

    def __str__(self) -> str:
        parts = [repr(p) for p in self.patterns]
        if self.where is not None:
            parts.append(f"where={getattr(self.where, '__qualname__', self.where)}")
        if self.weight_decay is not None:
            parts.append(f"weight_decay={self.weight_decay}")
        if self.lr_scale != 1.0:
            parts.append(f"lr_scale={self.lr_scale}")
        if self.frozen:
            parts.append("frozen=True")
        return f"group({', '.join(parts)})"

    def matches(self, info: ParamInfo) -> bool:
        if self.patterns and not any(
            fnmatch.fnmatchcase(n, p) for n in info.names for p in self.patterns
        ):
            return False
        if self.where is None:
            return True
        try:
            verdict = self.where(info.names[0], torch.empty(info.shape, dtype=info.dtype, device="meta"))
        except (RuntimeError, NotImplementedError) as error:
            if "meta" not in str(error):
                raise
            raise ValueError(
                f"{self}: where({info.names[0]!r}, p) read the parameter's values, but p is a meta tensor of the "
                "parameter's global shape and dtype (the step decides the groups once, alike on every rank and "
                "before any value exists on a meta-built model): decide by name, shape or dtype. "
                f"torch said: {error}"
            ) from error
        if not isinstance(verdict, bool):
            raise TypeError(
                f"{self}: where({info.names[0]!r}, ...) returned {verdict!r}; it must return a bool"
            )
        return verdict

    def options(self, default: Options) -> Options:
        if self.frozen:
            return Options(default.weight_decay, 1.0, frozen=True)
        wd = default.weight_decay if self.weight_decay is None else float(self.weight_decay)
        return Options(wd, float(self.lr_scale))


def group(
    *patterns: str,
    where: Predicate | None = None,
    weight_decay: float | None = None,
    lr_scale: float = 1.0,
    frozen: bool = False,
) -> Group:
    """A parameter group for ``sgd(..., groups=[...])`` / ``adamw(..., groups=[...])``.

    ``patterns``: fnmatch patterns on the parameter's names (``"*.bias"``, ``"*norm*"``);
    ``where(name, tensor) -> bool``: a predicate on its name and a meta tensor of its global
    shape and dtype (nanoGPT's rule: ``where=lambda name, p: p.dim() < 2``). Both given: both
    must hold. ``weight_decay`` replaces the optimizer's, ``lr_scale`` multiplies its learning
    rate (schedules included), ``frozen=True`` leaves the parameters and their state untouched.
    """
    return Group(tuple(patterns), where, weight_decay, lr_scale, frozen)


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as groups see it: its names (the first is shown and given to ``where``),
    global shape and stored dtype."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    # The other state_dict names of a tied weight (GPT-2's lm_head.weight for transformer.wte.weight): not matched
    # (torch's named_parameters() gives the first alone), only named where a group matches nothing else.
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParamGroups:
    """An optimizer's groups and its defaults: the part of its description that decides which
    parameter gets what (so Step.init's cross-rank agreement compares it)."""

    groups: tuple[Group, ...]
    default: Options

    @classmethod
    def of(cls, groups: Iterable[Group] | None, weight_decay: float) -> ParamGroups | None:
        if groups is None:
            return None
        if isinstance(groups, Group):
            groups = [groups]
        listed = tuple(groups)
        wrong = [g for g in listed if not isinstance(g, Group)]
        if wrong:
            raise TypeError(f"groups: expected sw.optim.group(...) values, got {wrong[0]!r}")
        if not listed:
            raise ValueError("groups: an empty list; pass None for no groups")
        return cls(listed, Options(float(weight_decay)))

    def resolve(self, params: Mapping[Any, ParamInfo]) -> dict[Any, Options]:
        """Each parameter's options (first matching group, else the defaults); refuses a group
        that gets none."""
        taken: dict[Any, int] = {}
        for key, info in params.items():
            hit = next((i for i, g in enumerate(self.groups) if g.matches(info)), None)
            if hit is not None:
                taken[key] = hit
        got = set(taken.values())
        for i, g in enumerate(self.groups):
            if i not in got:
                raise ValueError(_unmatched(i, g, params))
        return {
            key: self.default if key not in taken else self.groups[taken[key]].options(self.default)
            for key in params
        }

    def summary(self, params: Mapping[Any, ParamInfo]) -> list[tuple[str, int, int]]:
        """``(group, parameters, elements)`` per group and for the defaults, frozen ones marked."""
        options = self.resolve(params)
        rows = []
        for label, opts in [(str(g), g.options(self.default)) for g in self.groups] + [
            ("defaults", self.default)
        ]:
            keys = [k for k, o in options.items() if o == opts]
            rows.append((label, len(keys), sum(math.prod(params[k].shape) for k in keys)))
        return rows


def _unmatched(index: int, g: Group, params: Mapping[Any, ParamInfo]) -> str:
    names = [info.names[0] for info in params.values()]
    shown = ", ".join(repr(n) for n in names[:6]) + (
        f", ... ({len(names)} in all)" if len(names) > 6 else ""
    )
    tied = [f"{alias!r} is {info.names[0]!r} (tied)" for info in params.values() for alias in info.aliases
            if any(fnmatch.fnmatchcase(alias, p) for p in g.patterns)]
    return (
        f"groups[{index}] {g}: matches no parameter that an earlier group has not taken, so it "
        f"would change nothing; the parameters are named {shown}. "
        + (f"{'; '.join(tied[:4])}: name it by that name. " if tied else "")
        + "Fix the pattern (fnmatch, case-sensitive: '*' for any prefix) or the predicate, or remove the group"
    )


@dataclass(frozen=True)
class Runs:
    """One leaf's contiguous element ranges ``(start, stop, options)`` over its flattened
    elements, in order and covering it (a pytree leaf: optree does not descend into it)."""

    runs: tuple[tuple[int, int, Options], ...]

    @classmethod
    def whole(cls, numel: int, options: Options) -> Runs:
        return cls(((0, numel, options),))

    @classmethod
    def merged(cls, runs: Iterable[tuple[int, int, Options]]) -> Runs:
        """``runs`` with neighbours of the same options joined (fewer pieces, the same values)."""
        out: list[tuple[int, int, Options]] = []
        for start, stop, opts in runs:
            if out and out[-1][2] == opts and out[-1][1] == start:
                out[-1] = (out[-1][0], stop, opts)
            elif start < stop:
                out.append((start, stop, opts))
        return cls(tuple(out))


def tree_runs(groups: ParamGroups | None, default: Options, params: Any) -> list[Runs]:
    """The runs of each leaf of ``params`` when no Step says them: whole leaves, named by their
    path in the tree (``"layer.local"``), decided on the leaves' own shapes."""
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    if groups is None:
        return [Runs.whole(t.numel(), default) for t in leaves]
    key = tuple(
        (".".join(map(str, p)), tuple(t.shape), t.dtype) for p, t in zip(paths, leaves, strict=True)
    )
    return _resolved_runs(groups, key)


@functools.lru_cache(maxsize=32)
def _resolved_runs(
    groups: ParamGroups, key: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
) -> list[Runs]:
    # Cached: a direct caller updates the same tree every step; resolving matches every pattern.
    infos = {i: ParamInfo((name,), shape, dtype) for i, (name, shape, dtype) in enumerate(key)}
    options = groups.resolve(infos)
    return [Runs.whole(math.prod(shape), options[i]) for i, (_, shape, _) in enumerate(key)]


class Pieces:
    """Leaves cut into runs and sorted by options: what the optimizers' math runs over.

    ``classes()`` lists each trainable option set with the indices of its pieces; ``take``
    cuts a leaf list into those pieces (views, so in-place math writes the leaves);
    ``assemble`` puts the per-piece results back into leaves of the original shapes.
    """

    def __init__(self, runs: Sequence[Runs], leaves: Sequence[Tensor | int]) -> None:
        """``leaves``: the tensors, or their numbers of elements."""
        self.cuts: list[tuple[int, int, int, bool]] = []  # (leaf, start, stop, whole leaf)
        self.options: list[Options] = []
        self._classes: list[tuple[Options, list[int]]] | None = None
        for i, (r, leaf) in enumerate(zip(runs, leaves, strict=True)):
            total = r.runs[-1][1] if r.runs else 0
            numel = leaf if isinstance(leaf, int) else leaf.numel()
            if r.runs and (r.runs[0][0] != 0 or total != numel):
                raise ValueError(
                    f"parameter runs: leaf {i} has {numel} elements but its runs cover "
                    f"[{r.runs[0][0]}, {total}); the runs must cover every element"
                )
            for start, stop, opts in r.runs:
                self.cuts.append((i, start, stop, len(r.runs) == 1))
                self.options.append(opts)
        self.leaf_runs = [len(r.runs) for r in runs]

    def classes(self) -> list[tuple[Options, list[int]]]:
        if self._classes is None:
            by: dict[Options, list[int]] = {}
            for j, opts in enumerate(self.options):
                if not opts.frozen:
                    by.setdefault(opts, []).append(j)
            self._classes = list(by.items())
        return self._classes

    def take(self, leaves: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
        out = []
        for j in indices:
            leaf, start, stop, whole = self.cuts[j]
            out.append(leaves[leaf] if whole else _flat(leaves[leaf])[start:stop])
        return out

    def assemble(
        self, leaves: Sequence[Tensor], results: Mapping[int, Tensor], inplace: bool
    ) -> list[Tensor]:
        """New leaves: in place, the leaves themselves (their pieces were written through views);
        else each leaf from its pieces' results, a frozen piece's values copied unchanged."""
        if inplace:
            return list(leaves)
        pieces: list[list[Tensor]] = [[] for _ in leaves]
        for j, (i, start, stop, whole) in enumerate(self.cuts):
            value = results.get(j)
            if (
                value is None
            ):  # frozen: the old values, in a new tensor (the update returns new ones)
                value = leaves[i].clone() if whole else _flat(leaves[i])[start:stop]
            pieces[i].append(value)
        out = []
        for leaf, parts in zip(leaves, pieces, strict=True):
            if not parts:  # an empty leaf has no run
                out.append(leaf.clone())
            else:
                out.append(parts[0] if len(parts) == 1 else torch.cat(parts).view(leaf.shape))
        return out


@functools.lru_cache(maxsize=64)
def whole_pieces(numels: tuple[int, ...], options: Options) -> Pieces:
    """The :class:`Pieces` of whole leaves of ``numels`` elements, all with ``options`` (what
    ``tree_runs`` gives without groups). Cached: an optimizer without groups updates the same
    leaves every step, and nothing changes a Pieces once made."""
    return Pieces([Runs.whole(n, options) for n in numels], numels)


def _flat(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        # A view of a non-contiguous tensor's elements in flat order does not exist.
        raise ValueError(
            f"parameter runs: a tensor of shape {tuple(t.shape)} cut into runs must be contiguous"
        )
    return t.view(-1)
