"""Bytes each rank sends for one attention call, by formula (independent of any run; tests hold them to the ledger).

Both attentions send the same bytes again in backward (the transposes of their collectives), so each
function gives one pass; a training step sends twice that.

>>> ring_attention_bytes(batch=1, kv_heads=2, seq_local=8, head_dim=4, itemsize=8, size=4)
3072
>>> ulysses_attention_bytes(batch=1, heads=4, kv_heads=2, seq_local=8, head_dim=4, itemsize=8, size=2)
1536
>>> ulysses_attention_bytes(batch=1, heads=4, kv_heads=2, seq_local=8, head_dim=4, itemsize=8, size=4)
3072

(at size 4 the two key/value heads go as four: :func:`ulysses_kv_heads`)
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
    kv = ulysses_kv_heads(heads, kv_heads, size)
    tensors = (heads, kv, kv, heads)  # q, k, v in; the output back
    return sum(h * per_head * (size - 1) // size for h in tensors)


def ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """How many key/value heads the all-to-all splits over ``n`` ranks: their own count where ``n``
    divides it, else the fewest copies of each that ``n`` divides within grouped-query attention's
    groups (``heads`` query heads over ``kv_heads``), as DeepSpeed-Ulysses repeats them: Llama's 4
    query and 2 key/value heads at cp=4 split 4, each key/value head twice. Where ``n`` divides the
    query heads, the whole group (one key/value head per query head) always fits."""
    if kv_heads % n == 0:
        return kv_heads
    group = heads // kv_heads
    return next((kv_heads * r for r in range(2, group + 1) if group % r == 0 and kv_heads * r % n == 0), kv_heads)
