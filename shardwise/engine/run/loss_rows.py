"""Whether ``loss_fn`` is a mean over what the step cuts (the batch's rows, each sequence's tokens): probed once.

A step that cuts the batch (shard_params' shares, a split's batch axes such as expert parallel's,
accumulation, a pipeline's micro-batches) calls ``loss_fn`` on each part and takes the mean of the parts'
losses. That is the single-device step's loss only when ``loss_fn`` returns the mean of per-row terms
(torch's default ``reduction="mean"``): a sum over the rows (``reduction="sum"``: the step's loss and
gradients shrink by the number of parts), a mean normalised by anything but the rows (a class-weighted
cross-entropy, a pad id as ``ignore_index``) or a loss over the whole batch (a contrastive loss whose
negatives are the batch's other rows) train another model, without an error. A step that cuts each
sequence into parts (context parallel) takes the mean of the parts' losses likewise: it needs the mean
of per-token terms (a loss summed over the tokens, or per sequence, shrinks by the number of parts).
``batch_cut.refuse_padded_mean`` sees one such case in the batch (labels of -100); this probe sees the
loss itself.

On the step's first call (once per layout and rank: ``step/batch_cut.py`` says when it applies), each
rank that computes a loss evaluates ``loss_fn`` once more, under ``no_grad``, on the first rows of its
first micro-batch's output and targets (4 rows, else 2) and on their two halves, before its own call on
the micro-batch: the output is the model's, so nothing is run again (dropout in the model cannot differ),
and the probe's few rows take less memory than the loss of the whole micro-batch that follows. Where the
step cuts each sequence, the probe also evaluates it on the halves of those rows' tokens (of their first
even number of tokens), along the dim the split cuts the targets on; where the rows are not cut, on the
tokens' halves alone. A mean of per-row (per-token) terms gives the mean of the halves' losses to
rounding; a sum gives twice it; an in-batch contrastive loss another value. Beyond a tolerance of the
dtype (1e-6 relative in float64, else 2e-2: matmuls inside a loss may round differently on fewer rows),
the step is refused, naming the fix.

Which dims of the output hold the rows: of one tensor whose dim 0 alone has the rows' size, dim 0; else
those whose size follows the rows in the chain's output on half the rows, run on fake tensors (no
arithmetic): a rows x rows similarity matrix (CLIPModel's
``logits_per_text``) is cut on both, a sequence as long as the batch is not, nor is a tensor whose dim 0
merely equals the rows (prototypes returned beside the features). Where the chain cannot run on fake
tensors, or under a split (whose layers run on fake tensors only inside its predicting block, and note
what they ran: tensor parallel's split head), dim 0 where it is the only dim of the rows' size in every
tensor. Which dim holds the tokens: the targets' sequence dim, where no other dim of any tensor has the
tokens' count (dim 0 aside, where it holds the rows). So a feature dim is never cut (a vocabulary, or a
tensor-parallel rank's slice of it, of the rows' or the tokens' count makes the dims ambiguous: not
probed). Not probed (and not refused): an output where that cannot be told (a tensor with no dim of the
rows' size, such as the scalar ``loss`` of a Hugging Face model's own loss; no dim-0 rows in a chain
that cannot run on fake tensors); a ``loss_fn`` that raises on fewer rows, returns no scalar, draws
random numbers (what it drew is set back) or issues a collective. The probe runs inside ``no_mesh`` (no
collective runs there, not even one naming its mesh: it raises at once, so no rank waits on another)
and ``in_layer.probing_loss``, where a split's loss functions compute without the other ranks: the
vocabulary-parallel cross-entropy on logits split over the vocabulary reduces a per-row term of the
rank's own slice as it reduces its terms (how ``loss_fn`` reduces the rows shows all the same), and
tensor parallel's loss leaves its record of the split head for the step's own call. A probe whose values
are not finite, or all zero, says nothing: it runs again on the next call.

The rank that finds a difference raises; every rank computing a loss finds it alike for a sum, and the
others stop as on any error of ``loss_fn`` (a launch aborts them, torchrun ends the job).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ...collectives.mesh_context import no_mesh
from ..stack import in_layer

PROBE_ROWS = 4  # the rows probed where the micro-batch has them (halves of 2), else 2 (halves of 1)
RTOL_FLOAT64 = 1e-6
RTOL = 2e-2  # below float64: bf16 rounds each loss to 3 digits; TF32 / bf16 matmuls may round by rows


@dataclass(frozen=True)
class ProbeCut:
    """What cuts a rank's micro-batch where the step probes ``loss_fn``, in words: ``rows``, what cuts
    its rows (shard_params' shares, a split's batch axes, micro-batches; None: nothing), and
    ``sequence``, what cuts each of its sequences into parts (context parallel; None: nothing), along
    ``sequence_dim`` of the inputs and targets."""

    rows: str | None
    sequence: str | None = None
    sequence_dim: int = 1


@dataclass(frozen=True)
class Measured:
    """``loss_fn`` on the first ``rows`` rows (``whole``) and on two halves of them (``halves``), in float64:
    halves of the rows (``along="rows"``), or of their first ``tokens`` tokens (``along="tokens"``)."""

    rows: int
    whole: float
    halves: tuple[float, float]
    rtol: float
    along: str = "rows"
    tokens: int = 0

    @property
    def mean(self) -> float:
        return (self.halves[0] + self.halves[1]) / 2

    def _close(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.rtol * max(abs(self.whole), *(abs(h) for h in self.halves))

    @property
    def agrees(self) -> bool:
        return self._close(self.whole, self.mean)

    @property
    def is_sum(self) -> bool:
        return self._close(self.whole, self.halves[0] + self.halves[1])


@dataclass(frozen=True)
class LossProbe:
    """The probe of one rank's step: ``cut`` says what cuts the batch; ``done`` marks the layout probed
    (the step's later calls run without it); ``predict(inputs)`` gives the shape of each leaf of the
    chain's output on ``inputs`` (on fake tensors; None where the chain cannot run on them)."""

    cut: ProbeCut
    done: Callable[[], None]
    predict: Callable[[Any], Sequence[torch.Size | None] | None]

    def check(
        self, loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
        generators: Sequence[torch.Generator], restore: bool,
    ) -> None:
        """Probe ``loss_fn`` on ``output`` and ``targets`` (a micro-batch of ``inputs``' rows) and refuse a
        loss that is not their mean. ``generators``: the ones a draw would advance; ``restore``: whether
        this rank may set them back (it holds them, or they are its own)."""
        sequence_dim = self.cut.sequence_dim if self.cut.sequence is not None else None
        found = measure(loss_fn, output, inputs, targets, generators, restore, self.predict,
                        rows_cut=self.cut.rows is not None, sequence_dim=sequence_dim)
        if found is RETRY:
            return
        self.done()
        if isinstance(found, Measured) and not found.agrees:
            raise ValueError(refusal(self.cut, found))


RETRY = "retry"  # the values say nothing (not finite, or all zero): probe again on the next call
UNKNOWN = "unknown"  # cannot be probed on this step's outputs: not again

# A part of the micro-batch the probe evaluates loss_fn on: for each output leaf, then for the targets,
# the (dim, start, stop) slices taken.
_Slices = tuple[tuple[int, int, int], ...]
_Part = tuple[tuple[_Slices, ...], _Slices]


def measure(
    loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
    generators: Sequence[torch.Generator], restore: bool,
    predict: Callable[[Any], Sequence[torch.Size | None] | None],
    *, rows_cut: bool = True, sequence_dim: int | None = None,
) -> Measured | str:
    """``loss_fn`` on the first rows of ``output`` and ``targets`` and on their halves (``rows_cut``), and
    on the halves of their tokens along ``sequence_dim`` (not None); or why not. Of what was measured,
    the first that disagrees, else the first."""
    rows = _rows(inputs)
    if rows is None or not _rows_first(targets, rows):
        return UNKNOWN
    leaves, tree = optree.tree_flatten(output)
    n = PROBE_ROWS if rows >= PROBE_ROWS else min(rows, 2)
    row_dims = _row_dims(leaves, rows, inputs, predict) if n >= 2 else None
    first_rows = _row_slices(leaves, row_dims, 0, n)  # where the row dims are not known: every row
    halvings: list[tuple[str, int, list[_Part]]] = []
    if rows_cut and row_dims is not None:
        halvings.append(("rows", 0, [_row_slices(leaves, row_dims, lo, hi) for lo, hi in ((0, n), (0, n // 2),
                                                                                          (n // 2, n))]))
    tokens = None if sequence_dim is None else _tokens(targets, sequence_dim)
    token_dims = None if tokens is None else _token_dims(leaves, rows, sequence_dim or 0, tokens)
    if tokens is not None and token_dims is not None and sequence_dim is not None:
        h = tokens // 2
        parts = [_with_tokens(first_rows, token_dims, sequence_dim, lo, hi, tokens) for lo, hi in
                 ((0, 2 * h), (0, h), (h, 2 * h))]
        halvings.append(("tokens", 2 * h, parts))
    if not halvings:
        return UNKNOWN
    states = [g.get_state() for g in generators]
    values: dict[_Part, torch.Tensor] = {}
    try:
        with torch.no_grad(), no_mesh(), in_layer.probing_loss():
            for _, _, parts in halvings:
                for part in parts:
                    if part in values:
                        continue
                    out_slices, target_slices = part
                    cut = optree.tree_unflatten(tree, [_cut(t, c) for t, c in zip(leaves, out_slices, strict=True)])
                    got = loss_fn(cut, optree.tree_map(functools.partial(_cut, slices=target_slices), targets))
                    if any(not torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True)):
                        return UNKNOWN  # it draws random numbers: its parts would differ by their draws
                    if not (isinstance(got, torch.Tensor) and got.dim() == 0 and got.is_floating_point()):
                        return UNKNOWN  # the step's own call says what it must return
                    values[part] = got
    except Exception:  # a loss that cannot run on fewer rows is not probed; its own call runs next
        return UNKNOWN
    finally:
        if restore:
            for g, s in zip(generators, states, strict=True):
                g.set_state(s)
    read = dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist(), strict=True))
    if not all(map(_finite_number, read.values())) or not any(read.values()):
        return RETRY
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    dtypes = {v.dtype for v in values.values()} | {t.dtype for t in floats}
    rtol = RTOL_FLOAT64 if dtypes <= {torch.float64} else RTOL
    found = [
        Measured(n if along == "rows" or row_dims is not None else rows, read[whole], (read[first], read[second]),
                 rtol, along, count)
        for along, count, (whole, first, second) in halvings
    ]
    return next((m for m in found if not m.agrees), found[0])


def _row_slices(leaves: list[Any], row_dims: list[tuple[int, ...]] | None, lo: int, hi: int) -> _Part:
    """Rows ``lo:hi`` of each output leaf along its row dims (none where they are not known) and of the targets."""
    if row_dims is None:
        return tuple(() for _ in leaves), ()
    return tuple(tuple((d, lo, hi) for d in dims) for dims in row_dims), ((0, lo, hi),)


def _with_tokens(rows: _Part, token_dims: list[tuple[int, ...]], dim: int, lo: int, hi: int, tokens: int) -> _Part:
    """``rows`` cut further to tokens ``lo:hi`` (nothing more where that is all ``tokens`` of them)."""
    if (lo, hi) == (0, tokens):
        return rows
    out, target = rows
    cut = tuple((*slices, *((d, lo, hi) for d in dims)) for slices, dims in zip(out, token_dims, strict=True))
    return cut, (*target, (dim, lo, hi))


def _tokens(targets: Any, dim: int) -> int | None:
    """The length of the targets' sequences along ``dim`` (one for every leaf, at least 2), or None."""
    if dim < 1:
        return None
    lengths = {int(t.shape[dim]) for t in optree.tree_leaves(targets) if isinstance(t, torch.Tensor) and t.dim() > dim}
    if len(lengths) != 1 or len(optree.tree_leaves(targets)) == 0:
        return None
    if any(not isinstance(t, torch.Tensor) or t.dim() <= dim for t in optree.tree_leaves(targets)):
        return None
    (length,) = lengths
    return length if length >= 2 else None


def _token_dims(leaves: list[Any], rows: int, dim: int, tokens: int) -> list[tuple[int, ...]] | None:
    """The dim of each output leaf that holds the tokens of the targets' sequence dim ``dim``: ``dim``
    itself, where no other dim of the leaf has the tokens' count (dim 0 aside, where it holds the rows),
    in every tensor; None where that cannot be told. A feature dim (a vocabulary, or a rank's slice of
    it) is never cut: where it has the tokens' count, the leaf's dims cannot be told."""
    dims: list[tuple[int, ...]] = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            dims.append(())
            continue
        if t.dim() <= dim or t.shape[dim] != tokens:
            return None
        others = [d for d in range(t.dim()) if d != dim and t.shape[d] == tokens and not (d == 0 and tokens == rows)]
        if others:
            return None
        dims.append((dim,))
    return dims if any(dims) else None


def _row_dims(
    leaves: list[Any], rows: int, inputs: Any, predict: Callable[[Any], Sequence[torch.Size | None] | None],
) -> list[tuple[int, ...]] | None:
    """The dims of each output leaf that hold the micro-batch's rows (() for a leaf that is no tensor,
    or one that does not follow the rows: each half's loss gets it whole), or None where that cannot
    be told. One tensor whose dim 0 alone has the rows' size (the usual output, ``[rows, ...]``): dim
    0. Else those whose size follows the rows in the chain's output on half the rows, on fake
    tensors: a tensor whose dim 0 merely equals the rows (a class table or prototypes the model
    returns beside its features) is not cut. Where the chain cannot run on fake tensors, dim 0 where
    it is the only dim of the rows' size in every tensor. A tensor without such a dim (a scalar loss
    the model computed over the batch) cannot be halved."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or not any(rows in t.shape for t in tensors):
        return None
    dim_0 = all(t.dim() > 0 and t.shape[0] == rows and rows not in t.shape[1:] for t in tensors)
    if dim_0 and len(tensors) == 1:  # the usual output, [rows, ...]: no fake run (its first imports sympy)
        return [(0,) if isinstance(t, torch.Tensor) else () for t in leaves]
    half = rows // 2
    shapes = predict(optree.tree_map(lambda t: t[:half], inputs))
    if shapes is None or len(shapes) != len(leaves):
        return [(0,) if isinstance(t, torch.Tensor) else () for t in leaves] if dim_0 else None
    dims: list[tuple[int, ...]] = []
    for t, shape in zip(leaves, shapes, strict=True):
        if not isinstance(t, torch.Tensor):
            dims.append(())
            continue
        if shape is None or len(shape) != t.dim():
            return None
        follows = tuple(d for d, (a, b) in enumerate(zip(t.shape, shape, strict=True)) if a != b)
        if any(t.shape[d] != rows or shape[d] != half for d in follows):
            return None
        dims.append(follows)
    return dims if any(dims) else None


def _cut(t: Any, slices: tuple[tuple[int, int, int], ...]) -> Any:
    """``t`` cut to ``start:stop`` along ``dim`` for each of ``slices``."""
    if not slices:
        return t
    index: list[slice] = [slice(None)] * (max(d for d, _, _ in slices) + 1)
    for d, lo, hi in slices:
        index[d] = slice(lo, hi)
    return t[tuple(index)]


def refusal(cut: ProbeCut, found: Measured) -> str:
    """The refusal of a ``loss_fn`` that is not a mean over rows (or over tokens): what was measured and the fixes."""
    return _token_refusal(cut, found) if found.along == "tokens" else _row_refusal(cut, found)


def _row_refusal(cut: ProbeCut, found: Measured) -> str:
    sums = " (their sum: a loss summed over the rows, reduction='sum'?)" if found.is_sum else ""
    return (
        f"loss_fn is not a mean over the batch's rows, which a step that cuts the batch ({cut.rows}) needs: the step "
        "takes the mean of the losses of the parts it computes, the single-device step's loss only when loss_fn "
        f"returns the mean of per-row terms. On the first {found.rows} rows of this rank's first micro-batch it "
        f"gave {found.whole:.6g}, and {found.halves[0]:.6g} and {found.halves[1]:.6g} on their two halves, whose "
        f"mean is {found.mean:.6g}{sums}: this step would train another model than the single-device step. "
        "Return the mean over the rows (torch's losses with reduction='mean', their default); for a mean over "
        "counted tokens or a weighted mean (cross_entropy(weight=...), a pad id as ignore_index), pass "
        "train_step(tokens='sum') with loss_fn returning (the summed losses, their count or total weight), or "
        "tokens=count_fn with loss_fn the mean over count_fn(inputs, targets) tokens; a loss over the whole "
        "batch (a contrastive loss with in-batch negatives) cannot be computed on a part of it: do not cut the "
        "batch (one device, tensor_parallel alone, a pipeline of one micro-batch), or pass "
        "tokens='per_shard_mean' to train on the mean of the parts' losses knowingly (what DDP computes)"
    )


def _token_refusal(cut: ProbeCut, found: Measured) -> str:
    sums = " (their sum: a loss summed over the tokens, reduction='sum' or a sum per sequence?)" if found.is_sum else ""
    return (
        f"loss_fn is not a mean over the tokens of the batch's sequences, which a step that cuts each sequence "
        f"({cut.sequence}) needs: each rank computes the loss of its part of every sequence, and the step takes "
        "the mean of the parts' losses, the single-device step's loss only when loss_fn returns the mean of "
        f"per-token terms. On the first {found.tokens} tokens of the first {found.rows} rows of this rank's part "
        f"it gave {found.whole:.6g}, and {found.halves[0]:.6g} and {found.halves[1]:.6g} on the two halves of "
        f"those tokens, whose mean is {found.mean:.6g}{sums}: this step would train another model than the "
        "single-device step. Return the mean over the tokens (cross_entropy over the flattened tokens with "
        "reduction='mean', its default; a loss summed per sequence divided by the tokens); for a mean over "
        "counted tokens or a weighted mean (padding, cross_entropy(weight=...)), pass train_step(tokens='sum') "
        "with loss_fn returning (the summed losses, their count or total weight), or tokens=count_fn with "
        "loss_fn the mean over count_fn(inputs, targets) tokens; a loss that shifts or drops tokens itself "
        "(logits[:, :-1] against targets[:, 1:]) needs targets shifted on the whole sequence before the step; "
        "or pass tokens='per_shard_mean' to train on the mean of the parts' losses knowingly"
    )


def _rows(inputs: Any) -> int | None:
    """The micro-batch's rows: dim 0 of its inputs (the step cut every leaf along it)."""
    for t in optree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _rows_first(tree: Any, rows: int) -> bool:
    """Whether every leaf of ``tree`` (the targets) is a tensor with the rows along dim 0, as the step cut them."""
    return all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows for t in optree.tree_leaves(tree))


def _finite_number(x: float) -> bool:
    return x == x and abs(x) != float("inf")
