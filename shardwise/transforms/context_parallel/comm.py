"""The collectives a context-parallel step's layers issue, and their prediction on fake tensors.

* ``attend``: the rank's attention over the whole sequence, ring (``ppermute`` of the key/value
  slice, ``n - 1`` times forward and again backward) or Ulysses (four all-to-alls forward, four back).
* ``whole_sequence``: a per-token batch tensor (a padding mask, position ids) of the whole sequence
  in global order, from every rank's part: one all-gather, in the layer that reads the batch.
* Every parameter is replicated over the axis and used on this rank's part of the sequence, so its
  gradient is summed over the axis' parts in backward: the engine's ``in_layer.grad_summed``.

Predicting. Inside the engine's ``in_layer.predicting`` block nothing communicates: each operation
records what it would issue (op, axis, shape, dtype, phase, label) and returns a tensor of the shape the
run would (attention over the local slice alone), so a layer run forward and backward on fake tensors
lists every collective it issues, in the order the run's autograd issues them: what the Plan shows and
the contract test holds the ledger to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...collectives import all_gather
from ...engine.stack import in_layer
from .layout import shard_order
from .masks import TokenMask
from .ring import ring_attention
from .ulysses import ulysses_attention
from .unsplit import installed_attention


def whole_sequence(x: torch.Tensor, axis: str, balanced: bool, label: str) -> torch.Tensor:
    """``x`` [batch, seq_local] (this rank's part of a per-token tensor, not differentiated) made whole,
    in global order: every rank's part gathered over ``axis`` (one all-gather), then put in order."""
    n = in_layer.size(axis)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return all_gather(x.contiguous(), axis, dim=1, tiled=True)

    gathered = in_layer.collective(
        "all_gather", axis, x, label, run=run, predicted=lambda: x.new_empty((x.shape[0], x.shape[1] * n))
    )
    if in_layer.predicting_now():
        return gathered
    order = shard_order(gathered.shape[1], n, balanced).to(x.device)
    return gathered.index_select(1, torch.argsort(order))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, attention: str, balanced: bool, label: str,
    scale: float | None = None, mask: TokenMask | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: ``ring_attention`` or
    ``ulysses_attention`` (q [batch, heads, seq_local, head_dim]; k, v with kv_heads), under ``mask``
    (padding, packed sequences) if given."""
    with installed_attention():
        if in_layer.predicting_now():
            return _PredictedAttention.apply(q, k, v, axis, attention, label, scale, balanced)
        if attention == "ring":
            return ring_attention(q, k, v, axis, causal=True, balanced=balanced, scale=scale, mask=mask)
        return ulysses_attention(q, k, v, axis, causal=True, balanced=balanced, scale=scale, mask=mask)


class _PredictedAttention(torch.autograd.Function):
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
