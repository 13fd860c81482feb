"""Ring and Ulysses attention while predicting: no collective moves; each records what the run's attention
issues (over ``in_layer``) and returns local attention of the run's shapes, keeping stand-ins of what the
run keeps for backward. Both the attention context_parallel installs and a user's module calling
ring_attention / ulysses_attention itself predict through here."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...collectives.function import QuickApplyFunction
from ...engine.stack import in_layer


def predicted_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, attention: str, label: str,
    scale: float | None, balanced: bool,
) -> torch.Tensor:
    """The run's attention (``"ring"`` or ``"ulysses"``) over ``axis``, predicted on fake tensors."""
    out: torch.Tensor = _PredictedAttention.apply(q, k, v, axis, attention, label, scale, balanced)
    return out


class _PredictedAttention(QuickApplyFunction):
    """While predicting: local causal attention (the run's shapes), recording the collectives the run's
    attention issues forward and, in the order its autograd issues them, backward."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, attention: str, label: str,
        scale: float | None, balanced: bool,
    ) -> torch.Tensor:
        if attention == "ring":
            for _ in range(in_layer.size(axis) - 1):
                in_layer.record("ppermute", axis, (2, *k.shape), k.dtype, label)
        else:
            for t in (q, k, v, q):  # q, k, v to heads, the output (shaped as q) back
                in_layer.record("all_to_all", axis, tuple(t.shape), t.dtype, label)
        group = q.shape[1] // k.shape[1]
        keys, values = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, ctx.axis, ctx.attention, ctx.label, _, balanced = inputs
        ctx.shapes = [(tuple(t.shape), t.dtype) for t in (q, k, v)]
        ctx.save_for_backward(*_kept_by_the_run(q, k, v, ctx.attention, in_layer.size(ctx.axis), balanced))
        in_layer.remember_context(ctx)  # the prediction it records into, on whichever thread it runs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        in_layer.in_forward_context(ctx, lambda: _PredictedAttention._record_backward(ctx, g))
        (q, qd), (k, kd), (v, vd) = ctx.shapes
        return (
            torch.zeros(q, dtype=qd), torch.zeros(k, dtype=kd), torch.zeros(v, dtype=vd), None, None, None, None,
            None,
        )

    @staticmethod
    def _record_backward(ctx: Any, g: torch.Tensor) -> None:
        (q, qd), (k, kd), (v, vd) = ctx.shapes
        if ctx.attention == "ring":
            for _ in range(in_layer.size(ctx.axis) - 1):
                in_layer.record("ppermute", ctx.axis, (2, *k), kd, ctx.label, "backward")
        else:
            # The output's transpose first, then the inputs' in reverse creation order (autograd runs
            # the latest-made ready node first): v, k, q.
            for shape, dtype in ((tuple(g.shape), g.dtype), (v, vd), (k, kd), (q, qd)):
                in_layer.record("all_to_all", ctx.axis, shape, dtype, ctx.label, "backward")


def _kept_by_the_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: str, n: int, balanced: bool
) -> list[torch.Tensor]:
    """Stand-ins (fake while predicting: no memory) of what the run's attention keeps for backward, so the
    Plan's kept_for_backward counts it, on the rank that keeps the most (the Plan's figures are upper
    bounds). Ring: q (its chunks are views of it), the n key/value slices it held (each
    [2, *k.shape]), the merged output, and [batch, heads] rows of log-sum-exps and merge weights: on the
    last index, balanced, 2n + 1 blocks of half its queries and 2n - 1 merges of two weights each;
    unbalanced, n blocks and n - 1 merges of all of them. Ulysses: sdpa's whole-sequence q, k, v of the
    rank's heads, its output and log-sum-exp (each the bytes of the local tensor of the same width), and
    balanced, the four position vectors that reorder them."""
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    b, h, t, _ = q.shape
    if attention == "ring":
        rows = (t // 2) * (6 * n - 1) if balanced and n > 1 else t * (3 * n - 2)
        kept = [q if work == q.dtype else q.new_empty(q.shape, dtype=work)]
        kept += [k.new_empty((2, *k.shape), dtype=work) for _ in range(n)]
        return [*kept, q.new_empty(q.shape, dtype=work), q.new_empty((b, h, rows), dtype=work)]
    order = [q.new_empty(t * n, dtype=torch.int64) for _ in range(4 if balanced and n > 1 else 0)]
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(q),
            q.new_empty((b, h, t), dtype=work), *order]
