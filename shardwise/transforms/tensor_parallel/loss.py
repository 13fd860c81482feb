"""The vocabulary-parallel cross-entropy: the loss of logits split over the vocabulary, never gathered.

Each rank holds ``logits[..., its vocabulary slice]``. The loss needs, per
token, the log of the sum of every exponential and the target's logit: each rank
computes its part of both, the parts are summed over the axis (an all-gather of
the per-token maxima first, for stability), and the gradient of each rank's
slice is its own softmax slice minus the target's one-hot slice. Megatron's
``vocab_parallel_cross_entropy``; the bytes moved are three per-token values,
not the vocabulary.

:func:`vocab_parallel_cross_entropy` is plain ``F.cross_entropy`` wherever the
logits are whole (the single-device step, or a tensor-parallel step whose head
gathers its output), so one ``loss_fn`` serves the reference and the
tensor-parallel step; :func:`vocab_parallel_logsumexp` likewise (a z-loss term).
A tensor-parallel step whose head leaves the logits split refuses a loss that
does not call it, and any other computation on the split logits (they reach the
loss as :class:`SplitLogits`, which lets through only what keeps the vocabulary
dimension whole: reshapes, slices of the leading dimensions, casts): a loss of
each rank's vocabulary slice would train silently wrong.

Inside the engine's loss probe (``in_layer.probing_loss``: ``loss_fn`` evaluated
again on a few rows, where no collective may run) both compute on the rank's
slice alone, reduced as the whole's loss is (a sum, or the mean over the rows not
ignored): the probe asks only how ``loss_fn`` reduces the rows. The probe's calls
leave the record that the head left the logits split for the step's own call.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...engine.stack import in_layer
from .comm import all_max, leave
from .rank_flow import forget_split_output, output_is_split, split_width

_split_over: contextvars.ContextVar[_Split | None] = contextvars.ContextVar("shardwise_vocab_split", default=None)


@dataclass
class _Split:
    axis: str
    calls: int = 0


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(logits, targets)`` over logits of shape ``(..., vocab)`` and integer targets
    of shape ``(...)``; inside a tensor-parallel step whose head splits the vocabulary, computed
    from each rank's slice without gathering the logits.

    >>> import torch, shardwise as sw
    >>> logits, targets = torch.randn(4, 10, dtype=torch.float64), torch.tensor([1, 2, -100, 9])
    >>> want = torch.nn.functional.cross_entropy(logits, targets)
    >>> bool(sw.tp.vocab_parallel_cross_entropy(logits, targets) == want)
    True
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy(reduction={reduction!r}): use 'mean' or 'sum'")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {list(logits.shape)} need targets of shape "
            f"{list(logits.shape[:-1])} (one per row), got {list(targets.shape)}"
        )
    split = _split_over.get()
    logits = plain(logits)
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy(label_smoothing={label_smoothing}): use a value in [0, 1]")
    if split is None:
        return F.cross_entropy(flat, flat_targets, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    split.calls += 1
    if in_layer.probing_loss_now():  # the engine's loss probe: no collective runs there
        return _probe_stand_in(flat, flat_targets, ignore_index, reduction)
    axis, label = split.axis, "vocab_parallel_cross_entropy"
    rows = flat.shape[-1]
    vocab = rows * in_layer.size(axis)
    if not in_layer.predicting_now():
        wrong = (flat_targets != ignore_index) & ((flat_targets < 0) | (flat_targets >= vocab))
        if bool(wrong.any()):
            raise IndexError(
                f"vocab_parallel_cross_entropy: target {int(flat_targets[wrong][0])} is out of bounds for a "
                f"vocabulary of {vocab} (ignore_index={ignore_index})"
            )
    start = in_layer.index(axis) * rows
    # Half-precision logits are summed in float32, across the vocabulary and over the ranks (as
    # torch's cross-entropy accumulates them): bf16 sums of exponentials would lose the loss.
    given = flat.dtype
    if given in (torch.float16, torch.bfloat16):
        flat = flat.float()
    top = all_max(flat.max(-1).values, axis, label)
    shifted = flat - top.unsqueeze(-1)
    log_sum = leave(shifted.exp().sum(-1), axis, None, label).log()
    mine = (flat_targets >= start) & (flat_targets < start + rows)
    local = (flat_targets - start).clamp(0, rows - 1)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    target_logit = leave(picked, axis, None, label)
    valid = flat_targets != ignore_index
    losses = log_sum - target_logit
    if label_smoothing:  # torch's: (1 - e) * nll + e * the mean over the vocabulary of -log p
        mean_logit = leave(shifted.sum(-1), axis, None, label) / vocab
        losses = (1 - label_smoothing) * losses + label_smoothing * (log_sum - mean_logit)
    losses = losses.masked_fill(~valid, 0.0)
    total = losses.sum()
    loss = total if reduction == "sum" else total / valid.sum().to(total.dtype)
    return loss.to(given)


def _probe_stand_in(
    flat: torch.Tensor, flat_targets: torch.Tensor, ignore_index: int, reduction: str
) -> torch.Tensor:
    """What the cross-entropy gives on split logits inside the engine's loss probe (``in_layer.probing_loss``,
    where no collective runs): a per-row term of this rank's slice alone (its log-sum-exp), reduced as
    the cross-entropy reduces its terms (summed, or the mean over the rows not ignored). The probe asks
    only how ``loss_fn`` reduces the rows, which this answers as the whole vocabulary's loss would."""
    given = flat.dtype
    values = flat.float() if given in (torch.float16, torch.bfloat16) else flat
    valid = flat_targets != ignore_index
    total = values.logsumexp(-1).masked_fill(~valid, 0.0).sum()
    loss = total if reduction == "sum" else total / valid.sum().to(total.dtype)
    return loss.to(given)


def vocab_parallel_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logits.logsumexp(-1)``; inside a tensor-parallel step whose head splits the vocabulary,
    computed from each rank's slice (the maxima and the sums of exponentials summed over the
    axis), in float32 for half-precision logits and returned in their dtype. For a z-loss:
    ``loss = ce + 1e-4 * vocab_parallel_logsumexp(logits).pow(2).mean()``.

    >>> import torch, shardwise as sw
    >>> logits = torch.randn(3, 5, dtype=torch.float64)
    >>> bool(torch.equal(sw.tp.vocab_parallel_logsumexp(logits), logits.logsumexp(-1)))
    True
    """
    split = _split_over.get()
    logits = plain(logits)
    if split is None:
        return logits.logsumexp(-1)
    split.calls += 1
    axis, label = split.axis, "vocab_parallel_logsumexp"
    given = logits.dtype
    values = logits.float() if given in (torch.float16, torch.bfloat16) else logits
    if in_layer.probing_loss_now():  # the engine's loss probe: this rank's slice stands in for the whole
        return values.logsumexp(-1).to(given)
    top = all_max(values.max(-1).values, axis, label)
    log_sum = leave((values - top.unsqueeze(-1)).exp().sum(-1), axis, None, label).log()
    return (log_sum + top).to(given)


class SplitLogitsMisuse(ValueError):
    """A computation on logits split over the vocabulary other than the vocab-parallel ones. Not a
    TypeError: torch turns a TypeError raised in an operator (``logits ** 2``) into NotImplemented, and
    Python then says only that the operand types are unsupported."""

    def __init__(self, op: str) -> None:
        super().__init__(_misuse(op))
        self.op = op


# Ops that keep the vocabulary dimension whole (the last): the result is still the rank's slice
# of the same logits, so the vocab-parallel functions still compute on it right.
_LAYOUT = frozenset({
    "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "float",
    "double", "half", "bfloat16", "to", "type_as", "__getitem__", "narrow", "select", "clone",
    "detach", "requires_grad_", "retain_grad",
})


class SplitLogits(torch.Tensor):
    """The logits a split head gives the loss: this rank's slice of the vocabulary. Only the
    vocab-parallel functions compute on them (unwrapped); reshapes, slices of the leading
    dimensions and casts keep the wrapper; any other op is refused, naming it: a logsumexp,
    softmax or sum over a slice of the vocabulary is each rank's part, not the whole."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") or ""
        # Tensor attributes (shape, dtype, device, ...) are read through their getters.
        if name == "__get__" or _is_query(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _LAYOUT:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            first = args[0] if args else None
            if isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and out.dim() and first.dim() and \
                    out.shape[-1] == first.shape[-1] and out.is_floating_point():
                return out.as_subclass(SplitLogits)
            if isinstance(out, torch.Tensor) and out.is_floating_point() and name not in ("detach",):
                raise SplitLogitsMisuse(f"{name} changing the vocabulary dimension")
            return out
        raise SplitLogitsMisuse(name or repr(func))


def _is_query(func: Any) -> bool:
    """Reads that compute nothing on the values (size, dim, dtype, device, is_floating_point)."""
    return getattr(func, "__name__", "") in {
        "size", "dim", "numel", "is_floating_point", "is_complex", "element_size", "stride",
        "__len__", "is_contiguous", "data_ptr", "get_device", "__repr__", "__format__",
    }


def _misuse(what: str) -> str:
    return (
        f"tensor_parallel: the loss computes {what} on logits split over the vocabulary (each rank "
        "holds a slice of it, Colwise(output='sharded')): that is each rank's part, not the whole, "
        "and would train silently wrong. Use sw.tp.vocab_parallel_cross_entropy for the cross-entropy "
        "and sw.tp.vocab_parallel_logsumexp for a z-loss term, or give the head "
        "Colwise(output='replicated') to compute any loss on whole logits."
    )


def plain(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as a plain tensor (a :class:`SplitLogits` unwrapped; autograd sees the same value)."""
    return logits.as_subclass(torch.Tensor) if isinstance(logits, SplitLogits) else logits


def _wrap_split(output: Any, width: int | None) -> Any:
    """The head's output with its floating tensors that have a dim of the split's ``width`` as SplitLogits (what
    the loss may do with them is then checked op by op; every floating tensor where the width is not known).
    Others are not the split head's (statistics carried beside the logits, such as router_aux_loss's routing
    counts): whole on every rank, which the loss may compute on as it likes."""
    import optree

    def wrapped(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return t
        if width is not None and width not in t.shape:  # (any dim: a head's logits transposed (B, V, T) too)
            return t
        return t.as_subclass(SplitLogits)

    return optree.tree_map(wrapped, output, none_is_leaf=True)


class SplitLogitsLoss:
    """A tensor-parallel step's loss. When the head left the logits split over ``axis`` (the last
    split module this rank ran was a sharded Colwise: what ran decides, not the plan's order),
    ``loss_fn`` must compute its cross-entropy with :func:`vocab_parallel_cross_entropy`, which
    then works on the slices; otherwise it runs as it is."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], axis: str) -> None:
        self.loss_fn, self.axis = loss_fn, axis

    def __call__(self, output: Any, targets: Any) -> Any:
        split_logits, width = output_is_split(), split_width()
        if not in_layer.probing_loss_now():  # the probe's calls come before the step's own: they leave it
            forget_split_output()  # the forward is over: the next one starts whole
        if not split_logits:
            return self.loss_fn(output, targets)
        split = _Split(self.axis)
        token = _split_over.set(split)
        guarded = output if in_layer.predicting_now() else _wrap_split(output, width)  # fake tensors: shapes only
        try:
            loss = plain(self.loss_fn(guarded, targets))
        except SplitLogitsMisuse as err:
            if split.calls == 0:  # the whole loss ignored the split: say that first
                raise ValueError(f"{self._refusal()} (it computed {err.op} on them)") from err
            raise
        except Exception as err:
            if split.calls == 0:  # most likely a loss of the whole vocabulary meeting a slice of it
                raise ValueError(self._refusal()) from err
            raise
        finally:
            _split_over.reset(token)
        if split.calls == 0:
            raise ValueError(self._refusal())
        return loss

    def _refusal(self) -> str:
        return (
            f"tensor_parallel: the head leaves the logits split over {self.axis!r} (Colwise(output='sharded')), "
            "but loss_fn never called sw.tp.vocab_parallel_cross_entropy, so it would compute a loss of each "
            "rank's slice of the vocabulary; compute the cross-entropy with sw.tp.vocab_parallel_cross_entropy "
            "(plain cross-entropy wherever the logits are whole), or give the head Colwise(output='replicated')"
        )

    def __repr__(self) -> str:
        return f"SplitLogitsLoss({self.loss_fn!r}, axis={self.axis!r})"
