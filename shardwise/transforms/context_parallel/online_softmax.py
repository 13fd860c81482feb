"""Attention over one block of keys, and the log-sum-exp merge that joins blocks into one softmax.

A block's result is its normalised output and the log-sum-exp of its scores, row by row. Two blocks
over disjoint keys merge exactly: with ``lse = logaddexp(lse1, lse2)``,
``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)`` is the softmax attention over the keys of
both (the online softmax of flash attention and ring attention). Every row must see at least one key
in every block it is given: a row with none would have ``lse = -inf`` and make the merge NaN, so the
callers only pass blocks where each row sees a key.

>>> import torch
>>> g = torch.Generator().manual_seed(0)  # its own stream: thread ranks in other doctests share the global one
>>> q, k, v = (torch.randn(1, 1, n, 4, generator=g, dtype=torch.float64) for n in (3, 6, 6))
>>> whole = attend_block(q, k, v, scale=0.5)
>>> halves = merge_blocks(attend_block(q, k[..., :2, :], v[..., :2, :], 0.5),
...                       attend_block(q, k[..., 2:, :], v[..., 2:, :], 0.5))
>>> torch.allclose(whole.out, halves.out) and torch.allclose(whole.lse, halves.lse)
True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Block(NamedTuple):
    """Attention of some queries over one block of keys: the normalised output and each row's log-sum-exp."""

    out: torch.Tensor  # [..., q_len, v_dim]
    lse: torch.Tensor  # [..., q_len, 1]


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: int | None = None) -> Block:
    """Softmax attention of ``q`` over ``k``/``v`` (same heads), keeping the log-sum-exp.

    ``diagonal``: None, every key visible; else key ``diagonal + j`` is the position of query ``j``
    and the keys after it are hidden (the causal block), the ones before it visible.
    """
    out, lse = _BlockAttention.apply(q, k, v, scale, diagonal)
    return Block(out, lse)


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: int | None, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal is not None:
        rows, cols = scores.shape[-2], scores.shape[-1]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(diagonal + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse), lse


class _BlockAttention(torch.autograd.Function):
    """Attention over one key block and its log-sum-exp in forward; backward recomputes the probabilities.

    Flash attention's trade: only q, k, v and the log-sum-exp are kept, never the [queries, keys]
    matrix, so ring attention's saved memory grows with the sequence, not with its square.
    """

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p, lse = _probabilities(q, k, scale, diagonal)
        return torch.matmul(p, v), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, ctx.scale, ctx.diagonal = inputs
        ctx.save_for_backward(q, k, v, output[1])

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, lse = ctx.saved_tensors
        p, _ = _probabilities(q, k, ctx.scale, ctx.diagonal, lse)
        d_p = torch.matmul(d_out, v.transpose(-1, -2))
        # out = p @ v and lse = logsumexp(s), with p = softmax(s): ds = p * (dp - <dp, p> + d_lse).
        d_scores = p * (d_p - (d_p * p).sum(dim=-1, keepdim=True) + d_lse) * ctx.scale
        d_q = torch.matmul(d_scores, k)
        d_k = torch.matmul(d_scores.transpose(-1, -2), q)
        return d_q, d_k, torch.matmul(p.transpose(-1, -2), d_out), None, None


def merge_blocks(a: Block | None, b: Block) -> Block:
    """The attention over the keys of both ``a`` and ``b`` (``a`` None: nothing merged yet)."""
    if a is None:
        return b
    lse = torch.logaddexp(a.lse, b.lse)
    return Block(a.out * torch.exp(a.lse - lse) + b.out * torch.exp(b.lse - lse), lse)
