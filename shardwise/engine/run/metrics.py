"""What a step reports after its update, and the values its ranks sum to report it.

A step can report two metrics, each the same on every rank: ``loss`` (the mean
loss over the whole global batch) and ``grad_norm`` (the L2 norm of the whole
gradient, before clipping). ``train_step(..., metrics=...)`` picks them.

Neither is free once the step is distributed. The loss of a pipeline is known
only where the last stage runs, and every rank holds a part of the gradient, so
reporting them takes one small all-reduce per step, and ``grad_norm`` one more
read of every gradient. On a pipeline that sits on the critical path: the rank
that finishes last waits for it. Some rules need the same exchange anyway
(clipping needs the global norm, mixed precision the global finite flag before
the update); without them, a step asked for no metric exchanges nothing.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..layout.precision import all_finite
from ..optim.optimizers import sum_of_squares

REPORTABLE = ("loss", "grad_norm")


def check_metrics(metrics: Iterable[str]) -> tuple[str, ...]:
    """``metrics`` as a tuple in :data:`REPORTABLE` order, or an error naming what is wrong."""
    if isinstance(metrics, str):
        raise TypeError(
            f"metrics: expected a collection of metric names, got the string {metrics!r}; "
            f"write metrics=({metrics!r},)"
        )
    try:
        names = set(metrics)
    except TypeError:
        raise TypeError(
            f"metrics: expected a collection of metric names such as {REPORTABLE}, got {metrics!r}"
        ) from None
    unknown = sorted(str(n) for n in names - set(REPORTABLE))
    if unknown:
        raise ValueError(f"metrics: unknown {unknown}; a step reports any of {REPORTABLE} (or none: metrics=())")
    return tuple(n for n in REPORTABLE if n in names)


@dataclass(frozen=True)
class Summed:
    """The exchanged values, summed over the ranks: ``None`` for what was not exchanged."""

    loss_sum: torch.Tensor | None = None
    sq_norm: torch.Tensor | None = None
    finite: bool = True
    exact_norm: torch.Tensor | None = None  # on one rank: the norm as torch's clip_grad_norm_ computes it
    count: torch.Tensor | None = None  # token-weighted steps: the global number of tokens
    batch: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch fingerprints' sum, and weighted sum

    def batches_differ(self, ranks: Sequence[int]) -> bool:
        """Whether the ``ranks`` that summed their batch fingerprints passed different batches.

        Each rank adds its fingerprint f and ``batch_weight(rank) * f``; with one f everywhere the
        weighted sum is (the sum of the weights) x (the mean f), and a rank whose f differs leaves a
        residual of the order of its difference (linear in it: no squares to cancel)."""
        if self.batch is None or len(ranks) <= 1:
            return False
        total, weighted = (float(v) for v in self.batch)
        weights = sum(batch_weight(r) for r in ranks)
        mean = total / len(ranks)
        residual = abs(weighted - weights * mean)
        # A sum of n values rounds by at most (n - 1) eps of their magnitudes: twice that is slack.
        eps = torch.finfo(self.batch[0].dtype).eps
        return residual > 4 * len(ranks) * eps * (abs(weighted) + weights * abs(mean)) + 1e-300

    @property
    def norm(self) -> torch.Tensor | None:
        """The global gradient norm, if it was exchanged."""
        if self.exact_norm is not None:
            return self.exact_norm
        return None if self.sq_norm is None else self.sq_norm.sqrt()

    def mean_loss(self, losses: int) -> torch.Tensor | None:
        """The global mean loss, if it was exchanged: the sum counted ``losses`` losses."""
        if self.loss_sum is None:
            return None
        return self.loss_sum if losses == 1 else self.loss_sum / losses  # (x / 1 is x, bit for bit)


@dataclass(frozen=True)
class MetricExchange:
    """Which values the ranks of one step sum together after their backward.

    ``loss``: the summed losses, for the ``loss`` metric. ``norm``: the squared
    gradient norm, for ``grad_norm`` or clipping. ``finite``: a count of ranks
    that saw a non-finite gradient, so that every rank skips a bad update together.
    ``count``: the number of tokens, which a token-weighted step divides by.
    """

    loss: bool
    norm: bool
    finite: bool
    count: bool = False
    # A distributed step's check that every rank passed the same global batch: a fingerprint of it
    # and a weighted copy ride along (they add no collective: nothing is exchanged for them alone).
    batch: bool = False

    @property
    def empty(self) -> bool:
        return not (self.loss or self.norm or self.finite or self.count)

    @property
    def length(self) -> int:
        """How many values one exchange sums."""
        return int(self.loss) + int(self.norm) + int(self.finite) + int(self.count) + 2 * int(self.batch)

    def local(
        self,
        losses: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        counts: Sequence[torch.Tensor] = (),
        fingerprint: torch.Tensor | None = None,
        rank: int = 0,
    ) -> torch.Tensor | None:
        """This rank's share, one vector for one all-reduce (``None`` when nothing is exchanged).

        ``losses`` are this rank's per-micro-batch losses (none on a pipeline rank without the
        last stage), ``grads`` the gradients it counts in the norm, ``counts`` its tokens.
        """
        values = []
        if self.loss:
            values.append(_sum(losses, dtype, device))
        if self.norm:
            values.append(sum_of_squares(grads, dtype, device))
        if self.finite:
            values.append(1.0 - all_finite(grads, device).to(dtype))
        if self.count:
            values.append(_sum(counts, dtype, device))
        if self.batch:
            assert fingerprint is not None, "a step that checks its batch computes its fingerprint"
            f = fingerprint.to(device=device, dtype=torch.float64)
            values += [f.to(dtype), (f * batch_weight(rank)).to(dtype)]
        return torch.stack(values) if values else None

    def unpack(self, total: torch.Tensor | None) -> Summed:
        """The summed vector :meth:`local` made, by name."""
        if total is None:
            return Summed()
        values = iter(total)
        loss_sum = next(values) if self.loss else None
        sq_norm = next(values) if self.norm else None
        finite = not self.finite or bool(next(values) == 0)
        count = next(values) if self.count else None
        batch = (next(values), next(values)) if self.batch else None
        return Summed(loss_sum, sq_norm, finite, count=count, batch=batch)


def different_batches(who: str = "the ranks") -> str:
    """The refusal of a step whose ranks passed different batches."""
    return (
        f"{who} passed different batches to this step (their fingerprints differ): every rank passes "
        "the same global batch, and the step gives each its part (under shard_params its rows, under "
        "pipeline its micro-batches, under tensor_parallel all of it). Draw the batches with the same "
        "seed on every rank, or load them on one rank and broadcast them"
    )


def batch_weight(rank: int) -> float:
    """A weight in [1, 2) for ``rank``'s batch fingerprint, unlike its neighbours' (see batches_differ)."""
    return 1.0 + ((rank * 2654435761) % 1009) / 1009


def batch_fingerprint(batch: Any) -> torch.Tensor:
    """One number per batch, the same on every rank given the same batch and unlike it for another.

    Every element is hashed from its bits, its position in its tensor and its tensor's position
    in the tree (swapped inputs and targets differ, so do rows moved), and the hashes averaged
    per tensor: a hash of the bits tells NaN and infinities from every finite value (all NaNs
    alike, and -0.0 as 0.0). Plus small terms for each tensor's shape and the tree's structure.
    In float64, on the batch's device, with one copy to the host at the end."""
    leaves, treespec = optree.tree_flatten(batch)
    parts: list[torch.Tensor] = []
    # The structure (a dict's keys, a tuple's length): a batch of other containers differs too.
    shape_terms = 1e-3 * zlib.crc32(str(treespec).encode()) / 2**32
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            n = leaf.numel()
            shape_terms += 1e-3 * leaf.dim() + 1e-6 * n**0.5  # a reshaped batch differs too
            if n:
                parts.append(_hashes(_bits(leaf), index).mean() * 2.0**-52)  # in [-1, 1)
    if not parts:
        return torch.tensor(shape_terms, dtype=torch.float64)
    return (torch.stack([p.to(parts[0].device) for p in parts]).sum().cpu() + shape_terms).to(torch.float64)


def _bits(leaf: torch.Tensor) -> torch.Tensor:
    """The elements of ``leaf`` as int64 words, equal exactly when the values are (NaN as NaN)."""
    flat = leaf.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        return flat.to(torch.int64)  # integers and bools exactly, whatever their size
    # + 0.0 turns -0.0 into 0.0 (equal values, equal words); NaN's sign and payload depend on
    # the op that made it, so every NaN gets one word, which no finite value or infinity has.
    wide = flat.to(torch.float64) + 0.0
    return torch.where(torch.isnan(wide), _NAN_WORD, wide.view(torch.int64))


_NAN_WORD = 0x7FF8000000000000  # float64's canonical quiet NaN


def _hashes(words: torch.Tensor, leaf: int) -> torch.Tensor:
    """A pseudo-random float64 in [-2**52, 2**52) per word, from the word, its position and
    ``leaf``."""
    # Two multiplications with a xor-shift between (half of splitmix64's finalizer, as the step
    # runs it on every element): the top bits then depend on every bit of word and key.
    z = words ^ _keys(words.numel(), leaf, words.device)
    z = z * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 32) & ((1 << 32) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return (z >> 11).to(torch.float64)  # the top 53 bits, exact in float64


_CACHED_KEYS = 1 << 20  # positions: beyond, the keys are made for each call, not kept


def _keys(n: int, leaf: int, device: torch.device) -> torch.Tensor:
    """A pseudo-random int64 per position of tensor ``leaf`` of the tree."""
    return _cached_keys(n, leaf, device) if n <= _CACHED_KEYS else _make_keys(n, leaf, device)


@functools.lru_cache(maxsize=16)  # a step's batches keep their sizes: made once, not every step
def _cached_keys(n: int, leaf: int, device: torch.device) -> torch.Tensor:
    return _make_keys(n, leaf, device)


def _make_keys(n: int, leaf: int, device: torch.device) -> torch.Tensor:
    # splitmix64: a Weyl sequence (step 0x9E3779B97F4A7C15) through the mixer; each leaf starts
    # 2**40 positions further on.
    z = torch.arange(1, n + 1, device=device, dtype=torch.int64) + (leaf << 40)
    z = z * -7046029254386353131
    return _mix(z)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words: every output bit depends on every input bit."""
    # torch's >> on int64 is arithmetic: the masks make each shift the logical one splitmix64 takes.
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _sum(values: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sum of ``values`` in ``dtype`` (zero for none: a pipeline rank without the last stage)."""
    return torch.stack([x.to(dtype) for x in values]).sum() if values else torch.zeros((), dtype=dtype, device=device)

