"""Whether ``loss_fn`` is a mean over the batch's rows, which a step that cuts the batch needs: probed once.

A step that cuts the batch (shard_params' shares, accumulation, a pipeline's micro-batches) calls
``loss_fn`` on each part and takes the mean of the parts' losses. That is the single-device step's loss
only when ``loss_fn`` returns the mean of per-row terms (torch's default ``reduction="mean"``): a sum over
the rows (``reduction="sum"``: the step's loss and gradients shrink by the number of parts), a mean
normalised by anything but the rows (a class-weighted cross-entropy, a pad id as ``ignore_index``) or a
loss over the whole batch (a contrastive loss whose negatives are the batch's other rows) train another
model, without an error. ``batch_cut.refuse_padded_mean`` sees one such case in the batch (labels of
-100); this probe sees the loss itself.

On the step's first call (once per layout and rank: ``step/batch_cut.py`` says when it applies), each
rank that computes a loss evaluates ``loss_fn`` once more, under ``no_grad``, on the first rows of its
first micro-batch's output and targets (4 rows, else 2) and on their two halves, before its own call on
the micro-batch: the output is the model's, so nothing is run again (dropout in the model cannot differ),
and the probe's few rows take less memory than the loss of the whole micro-batch that follows. A mean
of per-row terms gives the mean of the halves' losses to rounding; a sum gives twice it; an in-batch
contrastive loss another value. Beyond a tolerance of the dtype (1e-6 relative in float64, else 2e-2:
matmuls inside a loss may round differently on fewer rows), the step is refused, naming the fix.

Which dims of the output hold the rows: of one tensor whose dim 0 alone has the rows' size, dim 0; else
those whose size follows the rows in the chain's output on half the rows, run on fake tensors (no
arithmetic): a rows x rows similarity matrix (CLIPModel's
``logits_per_text``) is cut on both, a sequence as long as the batch is not, nor is a tensor whose dim 0
merely equals the rows (prototypes returned beside the features). Where the chain cannot run on fake
tensors, dim 0 where it is the only dim of the rows' size in every tensor. Not probed (and not refused):
an output where that cannot be told (a tensor with no dim of the rows' size, such as the scalar ``loss``
of a Hugging Face model's own loss; no dim-0 rows in a chain that cannot run on fake tensors); a
``loss_fn`` that raises on fewer rows, returns no scalar, draws random numbers (what
it drew is set back) or issues a collective (it runs without a current mesh here: the Plan lists no such
collective). A probe whose values are not finite, or all zero, says nothing: it runs again on the next
call.

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

PROBE_ROWS = 4  # the rows probed where the micro-batch has them (halves of 2), else 2 (halves of 1)
RTOL_FLOAT64 = 1e-6
RTOL = 2e-2  # below float64: bf16 rounds each loss to 3 digits; TF32 / bf16 matmuls may round by rows


@dataclass(frozen=True)
class Measured:
    """``loss_fn`` on the first ``rows`` rows (``whole``) and on their two halves (``halves``), in float64."""

    rows: int
    whole: float
    halves: tuple[float, float]
    rtol: float

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
    """The probe of one rank's step: ``cut`` says in words what cuts the batch; ``done`` marks the layout
    probed (the step's later calls run without it); ``predict(inputs)`` gives the shape of each leaf of the
    chain's output on ``inputs`` (on fake tensors; None where the chain cannot run on them)."""

    cut: str
    done: Callable[[], None]
    predict: Callable[[Any], Sequence[torch.Size | None] | None]

    def check(
        self, loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
        generators: Sequence[torch.Generator], restore: bool,
    ) -> None:
        """Probe ``loss_fn`` on ``output`` and ``targets`` (a micro-batch of ``inputs``' rows) and refuse a
        loss that is not their mean. ``generators``: the ones a draw would advance; ``restore``: whether
        this rank may set them back (it holds them, or they are its own)."""
        found = measure(loss_fn, output, inputs, targets, generators, restore, self.predict)
        if found is RETRY:
            return
        self.done()
        if isinstance(found, Measured) and not found.agrees:
            raise ValueError(refusal(self.cut, found))


RETRY = "retry"  # the values say nothing (not finite, or all zero): probe again on the next call
UNKNOWN = "unknown"  # cannot be probed on this step's outputs: not again


def measure(
    loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
    generators: Sequence[torch.Generator], restore: bool,
    predict: Callable[[Any], Sequence[torch.Size | None] | None],
) -> Measured | str:
    """``loss_fn`` on the first rows of ``output`` and ``targets`` and on their halves, or why not."""
    rows = _rows(inputs)
    if rows is None or rows < 2 or not _rows_first(targets, rows):
        return UNKNOWN
    leaves, tree = optree.tree_flatten(output)
    dims = _row_dims(leaves, rows, inputs, predict)
    if dims is None:
        return UNKNOWN
    n = PROBE_ROWS if rows >= PROBE_ROWS else 2
    parts = [(0, n), (0, n // 2), (n // 2, n)]
    states = [g.get_state() for g in generators]
    values: list[torch.Tensor] = []
    try:
        with torch.no_grad(), no_mesh():
            for lo, hi in parts:
                part = optree.tree_unflatten(tree, [_cut(t, d, lo, hi) for t, d in zip(leaves, dims, strict=True)])
                got = loss_fn(part, optree.tree_map(functools.partial(_cut, dims=(0,), lo=lo, hi=hi), targets))
                if any(not torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True)):
                    return UNKNOWN  # it draws random numbers: its parts would differ by their draws
                if not (isinstance(got, torch.Tensor) and got.dim() == 0 and got.is_floating_point()):
                    return UNKNOWN  # the step's own call says what it must return
                values.append(got)
    except Exception:  # a loss that cannot run on fewer rows is not probed; its own call runs next
        return UNKNOWN
    finally:
        if restore:
            for g, s in zip(generators, states, strict=True):
                g.set_state(s)
    whole, first, second = torch.stack([v.detach().double() for v in values]).tolist()
    if not all(map(_finite_number, (whole, first, second))) or whole == first == second == 0.0:
        return RETRY
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    dtypes = {v.dtype for v in values} | {t.dtype for t in floats}
    rtol = RTOL_FLOAT64 if dtypes <= {torch.float64} else RTOL
    return Measured(n, whole, (first, second), rtol)


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


def _cut(t: Any, dims: tuple[int, ...], lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of ``t`` along each of ``dims``."""
    if not dims:
        return t
    index = [slice(None)] * (max(dims) + 1)
    for d in dims:
        index[d] = slice(lo, hi)
    return t[tuple(index)]


def refusal(cut: str, found: Measured) -> str:
    """The refusal of a ``loss_fn`` that is not a mean over rows: what was measured and the fixes."""
    sums = " (their sum: a loss summed over the rows, reduction='sum'?)" if found.is_sum else ""
    return (
        f"loss_fn is not a mean over the batch's rows, which a step that cuts the batch ({cut}) needs: the step "
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
