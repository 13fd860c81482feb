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
    steps: tuple[torch.Tensor, torch.Tensor] | None = None  # the same of the steps' digests

    def batches_differ(self, ranks: Sequence[int]) -> bool:
        """Whether the ``ranks`` that summed their batch fingerprints passed different batches."""
        return _summed_differ(self.batch, ranks)

    def steps_differ(self, ranks: Sequence[int]) -> bool:
        """Whether the ``ranks`` that summed their steps' digests called steps built differently."""
        return _summed_differ(self.steps, ranks)

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


def _summed_differ(pair: tuple[torch.Tensor, torch.Tensor] | None, ranks: Sequence[int]) -> bool:
    """Whether the ``ranks`` that summed a value f and ``batch_weight(rank) * f`` (``pair``) had
    different values: with one f everywhere the weighted sum is (the sum of the weights) x (the mean
    f), and a rank whose f differs leaves a residual of the order of its difference (linear in it:
    no squares to cancel)."""
    if pair is None or len(ranks) <= 1:
        return False
    total, weighted = (float(v) for v in pair)
    weights = sum(batch_weight(r) for r in ranks)
    mean = total / len(ranks)
    residual = abs(weighted - weights * mean)
    # A sum of n values rounds by at most (n - 1) eps of their magnitudes: twice that is slack.
    eps = torch.finfo(pair[0].dtype).eps
    return residual > 4 * len(ranks) * eps * (abs(weighted) + weights * abs(mean)) + 1e-300


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
    # A distributed step's check that every rank passed the same global batch to the same step: a
    # fingerprint of the batch and a digest of the step (its optimizer, loss, precision, clipping,
    # ...), each with a weighted copy, ride along (they add no collective: nothing is exchanged for
    # them alone).
    batch: bool = False

    @property
    def empty(self) -> bool:
        return not (self.loss or self.norm or self.finite or self.count)

    @property
    def length(self) -> int:
        """How many values one exchange sums."""
        return int(self.loss) + int(self.norm) + int(self.finite) + int(self.count) + 4 * int(self.batch)

    def local(
        self,
        losses: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        counts: Sequence[torch.Tensor] = (),
        fingerprint: torch.Tensor | None = None,
        rank: int = 0,
        step_digest: float | None = None,
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
            assert fingerprint is not None and step_digest is not None, "a checking step computes both"
            for f in (fingerprint.to(device=device, dtype=torch.float64),
                      torch.tensor(step_digest, dtype=torch.float64, device=device)):
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
        steps = (next(values), next(values)) if self.batch else None
        return Summed(loss_sum, sq_norm, finite, count=count, batch=batch, steps=steps)


def different_batches(who: str = "the ranks") -> str:
    """The refusal of a step whose ranks passed different batches."""
    return (
        f"{who} passed different batches to this step (their fingerprints differ): every rank passes "
        "the same global batch, and the step gives each its part (under shard_params its rows, under "
        "pipeline its micro-batches, under tensor_parallel all of it). Draw the batches with the same "
        "seed on every rank, or load them on one rank and broadcast them"
    )


def different_steps() -> str:
    """The refusal of a step whose ranks called steps built differently."""
    return (
        "the ranks called steps built differently (another optimizer or learning rate, loss function, "
        "precision policy, gradient clipping, token weighting, metrics or transform stack on some rank): "
        "each would update its part of the model by its own rule. Build the step alike on every rank, "
        "and switch to another step (a new learning rate, say) on every rank at the same step"
    )


def batch_weight(rank: int) -> float:
    """A weight in [1, 2) for ``rank``'s batch fingerprint, unlike its neighbours' (see batches_differ)."""
    return 1.0 + ((rank * 2654435761) % 1009) / 1009


def batch_fingerprint(batch: Any) -> torch.Tensor:
    """One number per batch, the same on every rank given the same batch and unlike it for another.

    Each tensor's elements are read as integer words, equal exactly when the values are (NaN as
    NaN, -0.0 as 0.0, infinities as themselves), and hashed by a multilinear hash: the sum of each
    word times an odd key drawn for its position and its tensor's position in the tree (swapped
    inputs and targets differ, so do rows moved). An odd key is invertible modulo the words' width,
    so a batch that differs in one element always gets another sum; that sum is then mixed into a
    number in [-1, 1). Plus small terms for each tensor's shape and the tree's structure. The sum is
    of integers, so it is the same whatever order a device adds in. Four passes over the batch
    (the words, their products, the sum), on its device, with one copy to the host at the end: the
    step pays it on every distributed step that exchanges metrics."""
    leaves, treespec = optree.tree_flatten(batch)
    sums: list[torch.Tensor] = []
    rows_of: list[int] = []  # how many of ``sums`` each leaf has (one per row of _ROW words)
    # The structure (a dict's keys, a tuple's length): a batch of other containers differs too.
    shape_terms = 1e-3 * zlib.crc32(str(treespec).encode()) / 2**32
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            n = leaf.numel()
            shape_terms += 1e-3 * leaf.dim() + 1e-6 * n**0.5  # a reshaped batch differs too
            if n:
                rows = _keyed_row_sums(leaf, index)
                sums.extend(rows)
                rows_of.append(len(rows))
    # One copy of the sums to the host, where mixing a few numbers costs less than a tensor op.
    host = iter(torch.stack([t.to(sums[0].device) for t in sums]).tolist() if sums else [])
    total = 0.0
    for count in rows_of:
        if count == 1:
            total += _unit(_mix64(next(host)))
            continue
        # A leaf of several rows: each row's sum mixed with its row number, the mixes added modulo
        # 2**64 (as tensor_digest): a change within one row changes its sum, so its mix, so the total.
        word = 0
        for row in range(count):
            word = (word + _mix64(next(host) + row * 0x9E3779B97F4A7C15)) & _WORD
        total += _unit(_mix64(word))
    return torch.tensor(total + shape_terms, dtype=torch.float64, device="cpu")


def _keyed_row_sums(leaf: torch.Tensor, index: int) -> list[torch.Tensor]:
    """Leaf ``index``'s words times their keys, summed (0-d int64s): one sum for a leaf of at most ``_ROW``
    elements, else one per row of that many, all from the leaf's one cached row of keys (a prefix of it for a
    shorter leaf or last row), so nothing per leaf size is kept: batches of varying lengths kept a key row per
    size (up to 16 of 8 MiB). ``_DIGESTED_ROWS`` rows at a time: the words copied stay 4 MiB at most, as
    when a 16 MB batch's keys and words made for the whole leaf at once took 144 MB."""
    flat = leaf.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)  # a word per real part and per imaginary part
    n = flat.numel()
    keys = _cached_keys(_ROW, index, flat.device, _word_dtype(flat))
    if n <= _ROW:
        return [_keyed_sum(flat, keys[:n])]
    sums: list[torch.Tensor] = []
    for start in range(0, n, _ROW * _DIGESTED_ROWS):
        piece = flat[start : start + _ROW * _DIGESTED_ROWS]
        whole = piece.numel() // _ROW * _ROW
        if whole:  # int32 products (each wrapped to 32 bits) summed in int64, as _keyed_sum's
            sums.extend(_words(piece[:whole]).view(-1, _ROW).mul_(keys).sum(dim=1, dtype=torch.int64).unbind())
        if whole < piece.numel():  # the last row, shorter
            sums.append(_keyed_sum(piece[whole:], keys[: piece.numel() - whole]))
    return sums


def _keyed_sum(flat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The words of 1-d ``flat`` times ``keys``, summed (a 0-d int64)."""
    # int32 products (each wrapped to 32 bits) summed in int64 (exact); int64 ones wrap at 64 bits
    return _words(flat).mul_(keys).sum(dtype=torch.int64)


def _word_dtype(flat: torch.Tensor) -> torch.dtype:
    """The dtype of :func:`_words` of real ``flat``."""
    if not flat.is_floating_point():
        return torch.int64
    return torch.int64 if flat.dtype == torch.float64 else torch.int32


def _words(leaf: torch.Tensor) -> torch.Tensor:
    """The elements of ``leaf`` as integer words in a new tensor (int32 for floats up to 32 bits,
    int64 otherwise), equal exactly when the values are: NaN as NaN, -0.0 as 0.0."""
    flat = leaf.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        return flat.to(torch.int64, copy=True)  # integers and bools exactly, whatever their size
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32  # exact for every smaller float
    # NaN's sign and payload depend on the op that made it: nan_to_num writes one NaN for every
    # NaN (and leaves the infinities); + 0.0 then turns -0.0 into 0.0.
    canonical = torch.nan_to_num(flat.to(wide), nan=_NAN, posinf=_INF, neginf=-_INF)
    canonical += 0.0
    return canonical.view(torch.int64 if wide == torch.float64 else torch.int32)


_NAN, _INF = float("nan"), float("inf")
# Words per row of a batch fingerprint's and a tensor digest's hash. Every row takes its keys from one cached
# row of this width per batch leaf (a prefix of it for a shorter row): 256 KiB of int32 keys, 512 KiB of
# int64. Rows as long as the tensor up to 2**20 words kept a key row per size instead, up to 16 of 4 or 8 MiB
# each, for as long as the process lived: 7 MiB a rank at rest for a 6 + 6 layer BART (d_model 512).
_ROW = 1 << 16
_DIGESTED_ROWS = 16  # rows hashed at once: what they copy stays small


@functools.lru_cache(maxsize=16)  # one row per leaf index, word width and device: made once, not every step
def _cached_keys(n: int, leaf: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An odd pseudo-random word of ``dtype`` per position of tensor ``leaf`` of the tree, ``n`` of them."""
    return _make_keys(n, leaf, device, dtype)


def _make_keys(n: int, leaf: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # splitmix64: a Weyl sequence (step 0x9E3779B97F4A7C15) through the mixer; each leaf starts
    # 2**40 positions further on. Odd, so each key is invertible modulo 2**32 and 2**64.
    z = torch.arange(1, n + 1, device=device, dtype=torch.int64) + (leaf << 40)
    z = z * -7046029254386353131
    return (_mix(z) | 1).to(dtype)


_WORD = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer on one word (as :func:`_mix` on tensors): every bit into every bit."""
    z &= _WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _WORD
    return z ^ (z >> 31)


def _unit(word: int) -> float:
    """A 64-bit word's top 53 bits (signed) as a float in [-1, 1), exactly."""
    return ((word - (1 << 64) if word >> 63 else word) >> 11) * 2.0**-52


def tensor_digest(tensor: torch.Tensor) -> int:
    """A 64-bit word of ``tensor``'s bits (not its shape or dtype): the same for tensors whose
    elements are bitwise equal (a NaN as itself), and always another when any one element differs,
    wherever it is.

    The elements, read as integer words, are cut into rows of ``_ROW``, each row hashed by
    :func:`batch_fingerprint`'s multilinear hash (the same cached odd keys for every row of every
    tensor, a prefix of them for a shorter one, so nothing is made per call and nothing per size is
    kept; sums wrap in the words' width, and an odd key is invertible there), each row's sum mixed
    with its row number by splitmix64's finalizer (a bijection) and the mixes added modulo 2**64: a
    change within one row changes its sum, so its mix, so the total. On the CPU a
    row's sum is one integer matrix-vector product, read straight from the tensor's memory (about
    as long as a copy of a tenth of it); on another device the products are made, a few rows at a
    time, and summed there. One copy of the rows' sums to the host."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    sums = []
    for words in _bit_words(flat):
        width = max(1, min(words.numel(), _ROW))
        keys = _cached_keys(_ROW, 0, words.device, words.dtype)[:width]
        for start in range(0, words.numel(), width * _DIGESTED_ROWS):
            piece = words[start : start + width * _DIGESTED_ROWS]
            whole = piece.numel() // width * width
            sums.append(_row_sums(piece[:whole].view(-1, width), keys))
            if whole < piece.numel():  # the last row, shorter
                sums.append(_row_sums(piece[whole:][None], keys[: piece.numel() - whole]))
    total = 0
    for row, word in enumerate(torch.cat(sums).tolist() if sums else []):
        total = (total + _mix64(word + row * 0x9E3779B97F4A7C15)) & _WORD
    return total


_BIT_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bit_words(flat: torch.Tensor) -> list[torch.Tensor]:
    """A 1-d tensor's bits as integer words of 4 or 8 bytes: views of its memory (several 1- or 2-byte
    elements to a word, those left over widened; of a copy where the view would not be aligned)."""
    size = flat.element_size()
    if size >= 4:
        return [flat.view(_BIT_WORDS[size])]
    whole = flat.numel() // (4 // size) * (4 // size)
    try:
        packed = flat[:whole].view(torch.int32)
    except RuntimeError:  # not on a 4-byte boundary: a copy is (and packs alike)
        return _bit_words(flat.clone())
    return [packed, flat[whole:].view(_BIT_WORDS[size]).to(torch.int32)]


def _row_sums(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row of words times ``keys``, summed (wrapping in the words' width)."""
    if rows.device.type == "cpu":
        return rows @ keys  # no products tensor: the sum is accumulated as the row is read
    return (rows * keys).sum(dim=1, dtype=rows.dtype)  # integer matmul runs on the CPU only


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words: every output bit depends on every input bit."""
    # torch's >> on int64 is arithmetic: the masks make each shift the logical one splitmix64 takes.
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _sum(values: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sum of ``values`` in ``dtype`` (zero for none: a pipeline rank without the last stage)."""
    return torch.stack([x.to(dtype) for x in values]).sum() if values else torch.zeros((), dtype=dtype, device=device)

