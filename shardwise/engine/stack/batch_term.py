"""A loss term of the whole batch beside a token-weighted loss (``train_step(tokens=...)``).

A token-weighted step multiplies each micro-batch's loss by that micro-batch's token count on this
rank (``tokens=count_fn``; under ``tokens="sum"`` loss_fn returns the sum and the count itself), sums
over the ranks and micro-batches, and divides the loss and the gradients by the global count. A term
that belongs to the whole batch once (the router aux loss) must not be weighed so: a rank with few
tokens would shrink its part of it, one with none would drop it. A loss wrapper that adds such a term
returns :class:`WithBatchTerm`: what the wrapped loss_fn returned, and the term already scaled by the
global count (its part on this rank times the count of the micro-batch over every rank, which
:func:`counted_tokens` and ``in_layer.batch_sum`` give it). The engine weighs the first as ever and
adds the term as it is, so after the division the term counts once and its gradient is the term's.

>>> import torch
>>> with counting_tokens(torch.tensor(3)):
...     inside = counted_tokens()
>>> int(inside), counted_tokens()
(3, None)
>>> loss_tensor(WithBatchTerm((torch.tensor(6.0), 3), torch.tensor(1.5)))
tensor(7.5000)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_counted: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "shardwise_counted_tokens", default=None
)


@contextlib.contextmanager
def counting_tokens(count: torch.Tensor | None) -> Iterator[None]:
    """A block (the engine's call of loss_fn) whose loss weighs its micro-batch by ``count`` tokens."""
    token = _counted.set(count)
    try:
        yield
    finally:
        _counted.reset(token)


def counted_tokens() -> torch.Tensor | None:
    """Under ``train_step(tokens=count_fn)``: the count the step multiplies the calling loss's value by
    (``count_fn`` of this micro-batch's inputs and targets on this rank, as a tensor). None elsewhere: a
    mean loss, ``tokens="sum"`` (loss_fn returns the count itself), or loss_fn called outside a step's run
    (the Plan's prediction on fake tensors)."""
    return _counted.get()


@dataclass(frozen=True)
class WithBatchTerm:
    """A token-weighted step's loss value with a term of the whole batch: ``loss``, what the wrapped loss_fn
    returned (the mean over the counted tokens, or the ``(sum, count)`` pair), and ``term``, a scalar
    tensor the step adds to the micro-batch's summed loss as it is, not weighed by its count. For the term
    ``T`` to count once, each rank gives its part of ``T`` times the micro-batch's global token count."""

    loss: Any
    term: torch.Tensor


def loss_tensor(loss: Any) -> torch.Tensor:
    """The tensor the backward starts from, of what loss_fn returned: a mean, a ``(sum, count)`` pair's
    sum, a :class:`WithBatchTerm`'s loss (its mean or sum) plus its term. For the Plan's prediction,
    which runs loss_fn on fake tensors and needs only what the backward reaches."""
    if isinstance(loss, WithBatchTerm):
        return loss_tensor(loss.loss) + loss.term
    return loss[0] if isinstance(loss, (tuple, list)) else loss
