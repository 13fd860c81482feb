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

import torch

from ...collectives import all_gather
from ...engine.stack import in_layer
from .layout import shard_order
from .masks import TokenMask
from .predicted import predicted_attention
from .ring import ring_attention
from .ulysses import ulysses_attention
from .unsplit import attention_over_the_sequence, installed_attention


def whole_sequence(x: torch.Tensor, axis: str, balanced: bool, label: str) -> torch.Tensor:
    """``x`` [batch, seq_local] (this rank's part of a per-token tensor, not differentiated) made whole,
    in global order: every rank's part gathered over ``axis`` (one all-gather), then put in order."""
    with installed_attention():  # shardwise's own exchange: its output, the whole sequence, is not followed
        return _whole_sequence(x, axis, balanced, label)


def _whole_sequence(x: torch.Tensor, axis: str, balanced: bool, label: str) -> torch.Tensor:
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


@attention_over_the_sequence
def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, attention: str, balanced: bool, label: str,
    scale: float | None = None, mask: TokenMask | None = None, causal: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence (``causal`` or not): ``ring_attention`` or
    ``ulysses_attention`` (q [batch, heads, seq_local, head_dim]; k, v with kv_heads), under ``mask``
    (padding, packed sequences) if given."""
    if in_layer.predicting_now():
        return predicted_attention(q, k, v, axis, attention, label, scale, balanced)
    if attention == "ring":
        return ring_attention(q, k, v, axis, causal=causal, balanced=balanced, scale=scale, mask=mask)
    return ulysses_attention(q, k, v, axis, causal=causal, balanced=balanced, scale=scale, mask=mask)
