"""What the router's auxiliary loss needs of each MoE block, carried beside the activations to the loss.

A block reports :class:`RouterStats` of its router's logits (its top-k assignments per expert, its
probabilities summed over its rows, and its rows) to the layer running it (:func:`collecting`); the
layer adds them to what came in with its input and hands on ``Carried(output, stats)``; the last layer's
stats reach the loss (and, under a pipeline, cross stages with the activations, as any pytree does).
The probabilities keep their graph: the loss's gradient reaches every router through them. A batch
with an ``attention_mask`` weighs each row by it (HF leaves padding out of the aux loss): the first
layer reads it from the batch and it travels on in ``Carried.weights``.

>>> import torch
>>> with collecting() as found:
...     report(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), top_k=1)
>>> found[0].counts.tolist(), round(float(found[0].probs.sum()), 6), float(found[0].rows)
([1.0, 0.0, 1.0], 2.0, 2.0)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch


class RouterStats(NamedTuple):
    """The routing of some rows, summed over them (and over the layers that reported)."""

    counts: torch.Tensor  # [E]: top-k assignments to each expert (no gradient)
    probs: torch.Tensor  # [E]: each expert's router probability summed over the rows
    rows: torch.Tensor  # []: the rows routed (tokens x layers), no gradient

    def __add__(self, other: Any) -> RouterStats:
        return RouterStats(self.counts + other.counts, self.probs + other.probs, self.rows + other.rows)


class Carried(NamedTuple):
    """A layer's output with the routing statistics of every MoE block up to it, and the weight of each
    token row (the batch's attention mask, flat; None: every row counts)."""

    value: Any
    router: RouterStats
    weights: torch.Tensor | None = None


class _Sink(NamedTuple):
    found: list[RouterStats]
    weights: torch.Tensor | None
    routed: list[tuple[torch.Tensor, torch.Tensor]]  # (probabilities, chosen experts) of each report


_sink: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar("shardwise_router_stats", default=None)


@contextlib.contextmanager
def collecting(weights: torch.Tensor | None = None) -> Iterator[list[RouterStats]]:
    """A block whose MoE blocks append their :class:`RouterStats` to the yielded list, each row weighted
    by ``weights`` (flat, one per token row; None: 1)."""
    found: list[RouterStats] = []
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []
    token = _sink.set(_Sink(found, weights, routed))
    try:
        yield found
    finally:
        _sink.reset(token)
        # Weighed here, after the block ran: under remat its recomputation runs outside collecting() and
        # without the mask, so the ops it replays (softmax, top k) must not depend on the weights.
        found.extend(_weighed(probs, chosen, weights) for probs, chosen in routed)


def router_stats(logits: torch.Tensor, top_k: int, weights: torch.Tensor | None = None) -> RouterStats:
    """HF's ``load_balancing_loss_func`` per layer: softmax over the experts, the top ``top_k`` of it
    counted, the probabilities summed (in float32 at least, float64 in float64), each row weighted by
    ``weights`` (HF's attention mask) when given."""
    return _weighed(*_routed(logits, top_k), weights)


def _routed(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's probabilities [rows, E] and its chosen experts [rows, top_k] (no gradient)."""
    work = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits.to(work), dim=-1)
    return probs, torch.topk(probs.detach(), top_k, dim=-1).indices


def _weighed(probs: torch.Tensor, chosen_k: torch.Tensor, weights: torch.Tensor | None) -> RouterStats:
    work, top_k = probs.dtype, chosen_k.shape[-1]
    chosen = chosen_k.reshape(-1)  # row-major: row 0's k, row 1's, ...
    if weights is None:
        counts = probs.new_zeros(probs.shape[-1]).index_add(0, chosen, probs.new_ones(chosen.shape[0]))
        return RouterStats(counts, probs.sum(dim=0), probs.new_full((), float(probs.shape[0])))
    w = weights.detach().to(work)
    counts = probs.new_zeros(probs.shape[-1]).index_add(0, chosen, w.repeat_interleave(top_k))
    return RouterStats(counts, (probs * w.unsqueeze(-1)).sum(dim=0), w.sum())


def report(logits: torch.Tensor, top_k: int, where: str = "a MoE block") -> None:
    """A block's router ``logits`` [rows, E], to the layer collecting them (none: computed, then dropped,
    so that a recomputation under remat runs the same operations as the forward did)."""
    sink = _sink.get()
    weights = None if sink is None else sink.weights
    if weights is not None and weights.shape[0] != logits.shape[0]:
        raise ValueError(
            f"router_aux_loss: {where} routes {logits.shape[0]} rows, but the batch's attention_mask has "
            f"{weights.shape[0]} tokens: a MoE block must route every token of the batch once (its rows the "
            "flattened [batch, sequence]) for the mask to weigh them"
        )
    routed = _routed(logits, top_k)
    if sink is not None:
        sink.routed.append(routed)


def zeros_like_stats(num_experts: int, dtype: torch.dtype, device: torch.device) -> RouterStats:
    """No routing yet (a layer before the first MoE block)."""
    work = torch.promote_types(dtype, torch.float32)
    zeros = torch.zeros(num_experts, dtype=work, device=device)
    return RouterStats(zeros, zeros.clone(), torch.zeros((), dtype=work, device=device))
