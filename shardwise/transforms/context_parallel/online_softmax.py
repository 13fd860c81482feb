"""Attention over blocks of keys, merged by their log-sum-exps into one softmax (flash attention's online
softmax, which ring attention spreads over the ring).

A block's result is its normalised output and the log-sum-exp of its scores, row by row. Blocks over
disjoint keys merge exactly: with ``lse = logaddexp(lse1, lse2)``,
``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)`` is the softmax attention over the keys of
both. :class:`OnlineSoftmax` adds blocks to one query chunk's result as they come.

The block kernel is torch's tiled CPU flash attention (``engine.torch_api.flash_attention_cpu``),
which returns the log-sum-exp and never holds a [queries, keys] matrix; elsewhere (another device,
meta tensors, a torch without the kernel) a math kernel that does hold it (``_math_block``), equal to
rounding.

The backward. The weights ``exp(lse_b - lse)`` are taken as constants (each block's log-sum-exp is
not differentiable), and each block's backward uses the *merged* output in place of its own: flash
attention's backward forms ``dS = P * (dP - rowsum(dO * O))``, and with the block's gradient
``dO_b = w_b dO`` and the merged ``O`` this is exactly the gradient through the whole softmax,
including the path through the log-sum-exps the weights dropped (``w_b P_b`` is the whole softmax's
probability on the block's keys). So every block keeps only q, k, v and its log-sum-exp, and the
result its output once.

>>> import torch
>>> g = torch.Generator().manual_seed(0)  # its own stream: thread ranks in other doctests share the global one
>>> q, k, v = (torch.randn(1, 1, n, 4, generator=g, dtype=torch.float64) for n in (3, 6, 6))
>>> halves = OnlineSoftmax(q, scale=0.5)
>>> halves.add(k[..., :2, :], v[..., :2, :], causal=False) and halves.add(k[..., 2:, :], v[..., 2:, :], causal=False)
True
>>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
>>> torch.allclose(halves.result(), whole)
True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...collectives.function import QuickApplyFunction
from ...engine.torch_api import flash_attention_cpu, flash_attention_cpu_backward, has_flash_attention_cpu


class Block(NamedTuple):
    """Attention of some queries over one block of keys: the normalised output and each row's log-sum-exp."""

    out: torch.Tensor  # [..., q_len, v_dim]
    lse: torch.Tensor  # [..., q_len, 1], not differentiable


class BlockMask(NamedTuple):
    """Which keys of a block each query sees: the :class:`TokenMask` rows of the block's queries and keys
    (global positions). Built in forward and again in backward, never kept: it is [q_len, k_len]."""

    mask: Any  # a masks.TokenMask
    queries: torch.Tensor
    keys: torch.Tensor
    causal: bool

    def build(self) -> torch.Tensor:
        visible: torch.Tensor = self.mask.visible(self.queries, self.keys, self.causal)
        return visible


class Merged:
    """The merged output of a query chunk, once every block is in: what each block's backward needs."""

    out: torch.Tensor | None = None


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, merged: Merged,
    mask: BlockMask | None = None, visible: torch.Tensor | None = None,
) -> Block:
    """Softmax attention of ``q`` [batch, heads, q_len, d] over ``k``, ``v`` [batch, kv_heads, k_len, d]
    (grouped-query when kv_heads < heads), keeping each row's log-sum-exp. ``causal``: a square block
    whose key ``j`` is query ``j``'s position (keys after it hidden). ``mask``: which keys each query
    sees (its causality included; ``visible``, its :meth:`BlockMask.build` if already built); a row
    that sees none gets a zero output and lse = -inf. ``merged`` is filled with the query chunk's merged
    output before backward (module docstring)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"attend_block: a causal block is square, got {q.shape[2]} queries and {k.shape[2]} keys")
    if mask is not None and visible is None:
        visible = mask.build()
    out, lse = _BlockAttention.apply(q, k, v, scale, causal, merged, mask, visible)
    lse = lse.unsqueeze(-1)
    if visible is not None:
        # The kernels give a row that sees no key lse = 0 (and a zero output): -inf weighs it out of the merge.
        lse = lse.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
    return Block(out, lse)


class OnlineSoftmax:
    """One query chunk's attention, built block by block: :meth:`add` each block of keys (disjoint,
    each row seeing at least one key of each: a row with none would have lse = -inf and make the
    merge NaN), then :meth:`result`."""

    def __init__(self, q: torch.Tensor, scale: float) -> None:
        self.q, self.scale = q, scale
        self.merged = Merged()
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: BlockMask | None = None) -> bool:
        """Merge the block of keys ``k``, ``v``; False when ``mask`` lets no query see any of them (skipped)."""
        visible = None
        if mask is not None:
            visible = mask.build()
            if not bool(visible.any()):
                return False
            if bool(visible.all()) if not causal else bool(torch.equal(visible, _causal_like(visible))):
                mask = visible = None  # every key visible (or exactly causal): the kernel's unmasked path
        block = attend_block(self.q, k, v, self.scale, causal, self.merged, mask, visible)
        if self.out is None or self.lse is None:
            self.out, self.lse = block.out, block.lse
            return True
        lse = torch.logaddexp(self.lse, block.lse)
        self.out = self.out * _weight(self.lse, lse) + block.out * _weight(block.lse, lse)
        self.lse = lse
        return True

    def result(self) -> torch.Tensor:
        """The merged attention; zeros where no key was visible (no block added: a masked-out query chunk)."""
        out = self.out if self.out is not None else self.q.new_zeros(self.q.shape)
        self.merged.out = out.detach()
        return out


def _weight(lse: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """exp(lse - merged), 0 where both are -inf (a row no block so far lets see a key)."""
    return torch.exp(lse - merged).nan_to_num(nan=0.0)


def _causal_like(visible: torch.Tensor) -> torch.Tensor:
    return torch.ones(visible.shape[-2:], dtype=torch.bool, device=visible.device).tril().expand_as(visible)


def _math_block(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, visible: torch.Tensor | None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities and the log-sum-exp [..., q_len] by matmul (the kernel off the CPU flash path);
    a row that sees no key has lse = 0 and no probability, as the flash kernel gives it."""
    group = q.shape[1] // k.shape[1]
    keys = k if group == 1 else k.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flash kernel's form of a boolean mask: 0 where seen, -inf where hidden, in the query's dtype."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _grouped(t: torch.Tensor, group: int) -> torch.Tensor:
    """A gradient over the query heads summed to their key/value head (the transpose of repeat_interleave)."""
    return t if group == 1 else t.unflatten(1, (-1, group)).sum(2)


class _BlockAttention(QuickApplyFunction):
    """Attention over one key block and its log-sum-exp in forward; backward recomputes the probabilities
    from the log-sum-exp (and the mask from its tokens) and uses the query chunk's merged output
    (module docstring)."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, merged: Merged,
        mask: BlockMask | None, visible: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if has_flash_attention_cpu(q, k, v):
            if visible is None:
                return flash_attention_cpu(q, k, v, causal=causal, scale=scale)
            return flash_attention_cpu(q, k, v, causal=False, scale=scale, mask=_additive(visible, q.dtype))
        p, lse = _math_block(q, k, scale, causal, visible)
        group = q.shape[1] // k.shape[1]
        return torch.matmul(p, v if group == 1 else v.repeat_interleave(group, dim=1)), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, ctx.scale, ctx.causal, ctx.merged, ctx.mask, _ = inputs  # the mask is built again, not kept
        ctx.save_for_backward(q, k, v, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, lse = ctx.saved_tensors
        out = ctx.merged.out
        assert out is not None, "a block's backward runs after its query chunk's result() (ring_attention's order)"
        visible = None if ctx.mask is None else ctx.mask.build()
        none = (None, None, None, None, None)
        if has_flash_attention_cpu(q, k, v):
            d_q, d_k, d_v = flash_attention_cpu_backward(
                d_out.contiguous(), q, k, v, out, lse, causal=ctx.causal and visible is None, scale=ctx.scale,
                mask=None if visible is None else _additive(visible, q.dtype),
            )
            return d_q, d_k, d_v, *none
        group = q.shape[1] // k.shape[1]
        p, _ = _math_block(q, k, ctx.scale, ctx.causal, visible, lse)
        values = v if group == 1 else v.repeat_interleave(group, dim=1)
        d_p = torch.matmul(d_out, values.transpose(-1, -2))
        d_scores = p * (d_p - (d_out * out).sum(dim=-1, keepdim=True)) * ctx.scale
        d_q = torch.matmul(d_scores, k if group == 1 else k.repeat_interleave(group, dim=1))
        d_k = _grouped(torch.matmul(d_scores.transpose(-1, -2), q), group)
        d_v = _grouped(torch.matmul(p.transpose(-1, -2), d_out), group)
        return d_q, d_k, d_v, *none
