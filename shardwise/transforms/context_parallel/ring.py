"""Ring attention: keys and values travel around the ring of a mesh axis, an online softmax merges the blocks.

Each rank of the axis holds a slice of the sequence (see ``layout.py``). At step ``s`` rank ``i``
holds the keys and values of rank ``(i - s) % n``, attends its queries to them and passes them on
to rank ``i + 1`` with a ``ppermute``: every rank sends its key/value slice ``n - 1`` times, and
after ``n`` steps its queries have seen the whole sequence.

Under a causal mask a pair (query chunk ``a``, key chunk ``b``) is either wholly visible
(``a > b``), causal inside (``a == b``) or wholly hidden (``a < b``): hidden pairs are skipped.
With the balanced layout every step after the first costs every rank the same: half its queries
against all the received keys, or all its queries against half of them.

The backward is torch's autograd through the same computation: the ``ppermute``s transpose to
``ppermute``s the other way round the ring (so the backward sends the same bytes again), and each
block's attention is a small autograd.Function that recomputes its probabilities in backward instead
of keeping them (``online_softmax.py``). Memory kept for backward: per step, the received key/value
slice (in all, the whole sequence's keys and values, as an all-gather of them would keep) and the
blocks' outputs and log-sum-exps; never a [queries, keys] matrix. Measured (B=1, H=8, S=1024, D=64,
float32): 6-8 MiB per rank at cp 2 and 4, against 38 MiB for single-device math sdpa. Keeping only
the local slice would need a backward that sends the keys and values round the ring again.
"""

from __future__ import annotations

from typing import Any

import torch

from ...collectives import Mesh, axis_index, axis_size, ppermute
from .inputs import check_qkv, default_scale
from .layout import check_sequence_length, local_chunks
from .online_softmax import Block, attend_block, merge_blocks


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose slices the ranks of ``axis`` hold.

    ``q`` is [batch, heads, seq_local, head_dim], ``k`` and ``v`` [batch, kv_heads, seq_local, head_dim]
    (grouped-query attention when kv_heads < heads), each rank's slice of the sequence as
    :func:`shard_sequence` cuts it with the same ``balanced``. Returns this rank's slice of the output,
    shaped like ``q``: equal to ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=causal)``
    on the whole sequence, sharded. Half precision computes in float32.

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.context_parallel import ring_attention, shard_sequence, unshard_sequence
    >>> q, k, v = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64).unbind(0)
    >>> def main():
    ...     with sw.Mesh(cp=2):
    ...         local = [shard_sequence(t, "cp", dim=2) for t in (q, k, v)]
    ...         return unshard_sequence(ring_attention(*local, "cp"), "cp", dim=2)
    >>> out = sw.launch(main, world=2, timeout=60)
    >>> torch.allclose(out[0], torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
    """
    shapes = check_qkv("ring_attention", q, k, v)
    n, i = axis_size(axis, mesh=mesh), axis_index(axis, mesh=mesh)
    scale = default_scale(scale, shapes.head_dim)
    # Non-causal attention does not depend on where a key sits: the whole slice is one chunk.
    chunked = causal and n > 1
    if chunked:
        length = check_sequence_length("ring_attention", shapes.seq_local * n, n, balanced, axis)
    else:
        length = shapes.seq_local
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q_chunks = q.to(work).split(length, dim=2)
    mine = local_chunks(i, n, balanced) if chunked else (0,)
    group = shapes.heads // shapes.kv_heads
    ring = [(r, (r + 1) % n) for r in range(n)]

    merged: list[Block | None] = [None] * len(q_chunks)
    unused: list[torch.Tensor] = []
    kv = torch.stack([k, v])  # one message per step; sent in the input dtype
    for step in range(n):
        source = (i - step) % n
        keys, values = (_expand(kv[j].to(work), group) for j in (0, 1))
        theirs = local_chunks(source, n, balanced) if chunked else (0,)
        seen = False
        for a, qc in enumerate(q_chunks):
            block = _visible_block(qc, mine[a], theirs, keys, values, length, scale, causal)
            if block is not None:
                merged[a] = merge_blocks(merged[a], block)
                seen = True
        if not seen:
            unused.append(kv)
        if step < n - 1:
            kv = ppermute(kv, axis, ring, mesh=mesh)
    outs = [b.out for b in merged if b is not None]
    assert len(outs) == len(q_chunks), "every query chunk sees at least its own keys"
    out = torch.cat(outs, dim=2).to(q.dtype)
    return _KeepInGraph.apply(out, *unused) if unused and torch.is_grad_enabled() else out


class _KeepInGraph(torch.autograd.Function):
    """Identity on the output in forward; a zero gradient for each unused key/value slice in backward.

    Unbalanced causal rank ``i`` never attends to the slices of ranks after it, so without this no
    gradient would reach the ``ppermute`` that brought them, its transpose would not run on that rank,
    and the ranks still passing gradients round the ring would wait for it forever.
    """

    @staticmethod
    def forward(out: torch.Tensor, *unused: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.unused = [(t.shape, t.dtype, t.device) for t in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (g, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.unused))


def _expand(kv: torch.Tensor, group: int) -> torch.Tensor:
    """Key/value heads repeated for their query-head group (grouped-query attention); heads are dim 1."""
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _visible_block(
    qc: torch.Tensor,
    q_chunk: int,
    key_chunk_ids: tuple[int, ...],
    keys: torch.Tensor,
    values: torch.Tensor,
    length: int,
    scale: float,
    causal: bool,
) -> Block | None:
    """Attention of one query chunk over the received key chunks it may see, or None when it sees none.

    A slice holds its chunks in increasing order, so the visible ones (those not after ``q_chunk``)
    are a prefix of it: a view, never a copy.
    """
    visible = sum(1 for b in key_chunk_ids if not causal or b <= q_chunk)
    if not visible:
        return None
    diagonal = key_chunk_ids.index(q_chunk) * length if causal and q_chunk in key_chunk_ids else None
    width = visible * length
    return attend_block(qc, keys.narrow(2, 0, width), values.narrow(2, 0, width), scale, diagonal)
