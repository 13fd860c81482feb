"""Bytes each rank sends for one attention call, by formula (independent of any run; tests hold them to the ledger).

Both attentions send the same bytes again in backward (the transposes of their collectives), so each
function gives one pass; a training step sends twice that.

>>> ring_attention_bytes(batch=1, kv_heads=2, seq_local=8, head_dim=4, itemsize=8, size=4)
3072
>>> ulysses_attention_bytes(batch=1, heads=4, kv_heads=2, seq_local=8, head_dim=4, itemsize=8, size=4)
2304
"""

from __future__ import annotations


def ring_attention_bytes(*, batch: int, kv_heads: int, seq_local: int, head_dim: int, itemsize: int, size: int) -> int:
    """Bytes one rank sends in the forward of :func:`ring_attention`: its key and value slice, ``size - 1`` times."""
    kv_slice = 2 * batch * kv_heads * seq_local * head_dim * itemsize
    return (size - 1) * kv_slice


def ulysses_attention_bytes(
    *, batch: int, heads: int, kv_heads: int, seq_local: int, head_dim: int, itemsize: int, size: int
) -> int:
    """Bytes one rank sends in the forward of :func:`ulysses_attention`: four all-to-alls (q, k, v in, the
    output back), each keeping ``1/size`` of its input and sending the rest."""
    per_head = batch * seq_local * head_dim * itemsize
    tensors = (heads, kv_heads, kv_heads, heads)  # q, k, v in; the output back
    return sum(h * per_head * (size - 1) // size for h in tensors)
