"""Ulysses attention (DeepSpeed): all-to-all from sequence-split to head-split, whole-sequence attention
on the local heads, all-to-all back.

Rank ``r`` of ``n`` trades its slice of the sequence of every head for the whole sequence of heads
``r*H/n .. (r+1)*H/n - 1`` (and key/value heads ``r*Hkv/n ..``: with ``Hkv/n`` whole key/value heads
per rank, each local query head's key/value head is local too). The all-to-alls are shardwise's
differentiable ones; their transposes are all-to-alls the other way, so the backward sends the same
bytes again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...collectives import Mesh, all_to_all
from ...engine.stack import in_layer
from .cut import check_cut, place
from .inputs import check_qkv, default_scale
from .layout import check_sequence_length, shard_order
from .masks import TokenMask, check_mask
from .predicted import predicted_attention
from .unsplit import attention_over_the_sequence
from .volumes import ulysses_kv_heads

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@attention_over_the_sequence
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    attn: Attention | None = None,
    causal: bool | None = None,
    scale: float | None = None,
    balanced: bool = True,
    mask: TokenMask | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Attention of this rank's slice of the sequence, computed head by head on the rank that owns the head.

    ``q`` is [batch, heads, seq_local, head_dim], ``k`` and ``v`` [batch, kv_heads, seq_local, head_dim],
    sharded as :func:`shard_sequence` cuts them with the same ``balanced``; the axis size must divide
    ``heads`` and ``kv_heads``. ``attn(q, k, v)`` computes attention over the *whole* sequence in global
    order for the local heads (q [batch, heads/n, seq, head_dim], k/v [batch, kv_heads/n, seq, head_dim]);
    by default torch's ``scaled_dot_product_attention`` with ``is_causal=causal`` (default True) and
    ``scale``, which a custom ``attn`` does itself (passing them with it is refused). ``mask``: padding
    and packed sequences (:class:`TokenMask`, the whole sequence's in global order; see
    :func:`token_mask`), applied by the default attention as sdpa's boolean mask (a query that sees no
    key gets zeros). Returns this rank's slice of the output, shaped like ``q``.

    Outside any mesh (no ``with mesh:``, no ``mesh=``: functionalize's example run, the step on one
    device) the axis has one index and this is the attention over the whole sequence, so a module that
    calls it is a single-device model too; inside a mesh that lacks ``axis`` it is refused. A module of
    one's own that calls it is split by ``context_parallel`` as written (its ``axis`` and ``balanced``
    must be the transform's).

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.context_parallel import ulysses_attention, shard_sequence, unshard_sequence
    >>> q, k, v = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64).unbind(0)
    >>> def main():
    ...     with sw.Mesh(cp=2):
    ...         local = [shard_sequence(t, "cp", dim=2) for t in (q, k, v)]
    ...         return unshard_sequence(ulysses_attention(*local, "cp"), "cp", dim=2)
    >>> out = sw.launch(main, world=2, timeout=60)
    >>> torch.allclose(out[0], torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
    """
    shapes = check_qkv("ulysses_attention", q, k, v)
    if in_layer.predicting_now():  # a module's own call, in the Plan's run on fake tensors
        check_cut("ulysses_attention", axis, balanced)
        k, v = _repeated(k, v, shapes.kv_heads, ulysses_kv_heads(shapes.heads, shapes.kv_heads, in_layer.size(axis)))
        return predicted_attention(q, k, v, axis, "ulysses", "ulysses_attention", scale, balanced)
    # With no mesh at all (one device) the axis has one index: the attention over the whole sequence.
    n, _, one_device = place("ulysses_attention", axis, balanced, mesh)
    if shapes.heads % n:
        raise ValueError(
            f"ulysses_attention: q has {shapes.heads} head{'s' if shapes.heads != 1 else ''}, which the size {n} "
            f"of axis {axis!r} does not divide (each rank takes whole heads); use ring_attention, or an axis size "
            f"that divides {shapes.heads}"
        )
    k, v = _repeated(k, v, shapes.kv_heads, ulysses_kv_heads(shapes.heads, shapes.kv_heads, n))
    if attn is not None and (causal is not None or scale is not None or mask is not None):
        raise ValueError(
            "ulysses_attention: attn= replaces the default attention, which is what causal=, scale= and mask= "
            "configure; pass either attn or causal/scale/mask, and apply the mask and scale inside attn"
        )
    seq = shapes.seq_local * n
    if attn is None:
        causal = True if causal is None else causal
        visible = None
        if mask is not None:
            check_mask("ulysses_attention", mask, shapes.batch, seq)
            whole = torch.arange(seq, device=q.device)
            visible = mask.visible(whole, whole, causal)
        attn = _sdpa(causal, default_scale(scale, shapes.head_dim), visible)
    order = None
    if balanced and n > 1:
        check_sequence_length("ulysses_attention", seq, n, balanced, axis)
        order = shard_order(seq, n, balanced).to(q.device)

    if one_device:
        return attn(q, k, v)

    def heads_split(t: torch.Tensor) -> torch.Tensor:
        whole = all_to_all(t, axis, split_dim=1, concat_dim=2, tiled=True, mesh=mesh)  # in shard order
        return whole if order is None else whole.index_select(2, torch.argsort(order))

    out = attn(heads_split(q), heads_split(k), heads_split(v))
    if order is not None:
        out = out.index_select(2, order)
    return all_to_all(out, axis, split_dim=2, concat_dim=1, tiled=True, mesh=mesh)


def _repeated(k: torch.Tensor, v: torch.Tensor, kv_heads: int, to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` with each head repeated up to ``to`` heads (in place of its group: query head h
    still meets key/value head h // (heads / to)); their gradients summed back by autograd."""
    if to == kv_heads:
        return k, v
    return k.repeat_interleave(to // kv_heads, dim=1), v.repeat_interleave(to // kv_heads, dim=1)


def _sdpa(causal: bool, scale: float, visible: torch.Tensor | None = None) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, is_causal=causal and visible is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    return attention
