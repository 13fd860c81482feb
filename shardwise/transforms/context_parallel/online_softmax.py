"""Attention over one block of keys, and the log-sum-exp merge that joins blocks into one softmax.

A block's result is its normalised output and the log-sum-exp of its scores, row by row. Two blocks
over disjoint keys merge exactly: with ``lse = logaddexp(lse1, lse2)``,
``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)`` is the softmax attention over the keys of
both (the online softmax of flash attention and ring attention). Every row must see at least one key
in every block it is given: a row with none would have ``lse = -inf`` and make the merge NaN, so the
callers only pass blocks where each row sees a key.

>>> import torch
>>> q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
>>> whole = attend_block(q, k, v, scale=0.5)
>>> halves = merge_blocks(attend_block(q, k[..., :2, :], v[..., :2, :], 0.5),
...                       attend_block(q, k[..., 2:, :], v[..., 2:, :], 0.5))
>>> torch.allclose(whole.out, halves.out) and torch.allclose(whole.lse, halves.lse)
True
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Block(NamedTuple):
    """Attention of some queries over one block of keys: the normalised output and each row's log-sum-exp."""

    out: torch.Tensor  # [..., q_len, v_dim]
    lse: torch.Tensor  # [..., q_len, 1]


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> Block:
    """Softmax attention of ``q`` over ``k``/``v`` (same heads), keeping the log-sum-exp; ``mask``: True = visible."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return Block(torch.matmul(torch.exp(scores - lse), v), lse)


def merge_blocks(a: Block | None, b: Block) -> Block:
    """The attention over the keys of both ``a`` and ``b`` (``a`` None: nothing merged yet)."""
    if a is None:
        return b
    lse = torch.logaddexp(a.lse, b.lse)
    return Block(a.out * torch.exp(a.lse - lse) + b.out * torch.exp(b.lse - lse), lse)
