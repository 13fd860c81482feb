"""Ring attention: keys and values travel around the ring of a mesh axis, an online softmax merges the blocks.

Each rank of the axis holds a slice of the sequence (see ``layout.py``). At step ``s`` rank ``i``
holds the keys and values of rank ``(i - s) % n``, attends its queries to them and passes them on
to rank ``i + 1`` with a ``ppermute``: every rank sends its key/value slice ``n - 1`` times, and
after ``n`` steps its queries have seen the whole sequence.

Under a causal mask a pair (query chunk ``a``, key chunk ``b``) is either wholly visible
(``a > b``), causal inside (``a == b``) or wholly hidden (``a < b``): hidden pairs are skipped.
With the balanced layout every step after the first costs every rank the same: half its queries
against all the received keys, or all its queries against half of them.

Each block is torch's tiled CPU flash attention kernel, which returns the block's log-sum-exp
(``online_softmax.py``): a visible pair is one call, a causal one a square call with ``is_causal``,
and a query chunk's blocks merge by their log-sum-exps as the key/value slices arrive. Under a
:class:`TokenMask` (padding, packed sequences) a block nothing in sees is skipped, one wholly seen
runs unmasked, and the others pass the kernel an additive mask built from the two chunks' tokens: a
[query chunk, keys] tensor of the working dtype, made in forward and again in backward, never kept.

The backward is torch's autograd through the same computation: the ``ppermute``s transpose to
``ppermute``s the other way round the ring (so the backward sends the same bytes again), and each
block's backward is the flash kernel's, which recomputes its probabilities tile by tile from the
log-sum-exp. Memory kept for backward: per step, the received key/value slice (in all, the whole
sequence's keys and values, as an all-gather of them would keep), the blocks' log-sum-exps and the
merged output; never a [queries, keys] matrix. Keeping only the local slice would need a backward
that sends the keys and values round the ring again (torch's CP does).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...collectives import Mesh, ppermute
from ...collectives.function import QuickApplyFunction
from ...engine.stack import in_layer
from .cut import check_cut, place
from .inputs import check_qkv, default_scale
from .layout import check_sequence_length, local_chunks, shard_order
from .masks import TokenMask, check_mask
from .online_softmax import BlockMask, OnlineSoftmax
from .predicted import predicted_attention
from .unsplit import attention_over_the_sequence


@attention_over_the_sequence
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    *,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
    mask: TokenMask | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose slices the ranks of ``axis`` hold.

    ``q`` is [batch, heads, seq_local, head_dim], ``k`` and ``v`` [batch, kv_heads, seq_local, head_dim]
    (grouped-query attention when kv_heads < heads), each rank's slice of the sequence as
    :func:`shard_sequence` cuts it with the same ``balanced``. Returns this rank's slice of the output,
    shaped like ``q``: equal to ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=causal)``
    on the whole sequence, sharded. Half precision computes in float32. ``mask``: padding and packed
    sequences (:class:`TokenMask`, the whole sequence's, in global order; see :func:`token_mask`): each
    block is masked from its chunks' tokens, a block nothing in sees is skipped, and a query that sees no
    key gets zeros (torch's sdpa with the equivalent boolean mask, sharded).

    Outside any mesh (no ``with mesh:``, no ``mesh=``: functionalize's example run, the step on one
    device) the axis has one index and this is plain attention over the whole sequence, so a module that
    calls it is a single-device model too; inside a mesh that lacks ``axis`` it is refused. A module of
    one's own that calls it is split by ``context_parallel`` as written (its ``axis`` and ``balanced``
    must be the transform's).

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
    if in_layer.predicting_now():  # a module's own call, in the Plan's run on fake tensors
        check_cut("ring_attention", axis, balanced)
        return predicted_attention(q, k, v, axis, "ring", "ring_attention", scale, balanced)
    # With no mesh at all (one device) the axis has one index: plain attention over the whole sequence.
    n, i, _ = place("ring_attention", axis, balanced, mesh)
    scale = default_scale(scale, shapes.head_dim)
    # Non-causal attention does not depend on where a key sits: the whole slice is one chunk.
    chunked = causal and n > 1
    if chunked:
        length = check_sequence_length("ring_attention", shapes.seq_local * n, n, balanced, axis)
    else:
        length = shapes.seq_local
    positions = None
    if mask is not None:
        check_mask("ring_attention", mask, shapes.batch, shapes.seq_local * n)
        if balanced and n > 1:
            check_sequence_length("ring_attention", shapes.seq_local * n, n, balanced, axis)
        # Global position of every token, rank by rank (shard order): its rows of the mask.
        positions = shard_order(shapes.seq_local * n, n, balanced).view(n, shapes.seq_local)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q_chunks = q.to(work).split(length, dim=2)
    softmaxes = [OnlineSoftmax(qc, scale) for qc in q_chunks]
    mine = local_chunks(i, n, balanced) if chunked else (0,)
    ring = [(r, (r + 1) % n) for r in range(n)]

    unused: list[torch.Tensor] = []
    kv = torch.stack([k, v])  # one message per step; sent in the input dtype
    for step in range(n):
        source = (i - step) % n
        keys, values = kv.to(work).unbind(0)
        theirs = local_chunks(source, n, balanced) if chunked else (0,)
        seen = False
        for a, softmax in enumerate(softmaxes):
            tokens = None
            if mask is not None and positions is not None:
                tokens = _Tokens(mask, positions[i].split(length)[a], positions[source])
            seen |= _add_visible(softmax, mine[a], theirs, keys, values, length, causal, tokens)
        if not seen:
            unused.append(kv)
        if step < n - 1:
            kv = ppermute(kv, axis, ring, mesh=mesh)
    if any(s.out is None for s in softmaxes):
        # A query chunk that saw no key (all padding) has a zero output that no block connects to q:
        # without its zero gradient the rank's q projection would issue no gradient collective.
        unused.append(q)
    out = torch.cat([s.result() for s in softmaxes], dim=2).to(q.dtype)
    return _KeepInGraph.apply(out, *unused) if unused and torch.is_grad_enabled() else out


class _KeepInGraph(QuickApplyFunction):
    """Identity on the output in forward; a zero gradient for each unused key/value slice (or query, when a
    query chunk saw no key) in backward.

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


class _Tokens(NamedTuple):
    """The mask's view of one query chunk against one received slice: their global positions."""

    mask: TokenMask
    queries: torch.Tensor  # the query chunk's global positions
    keys: torch.Tensor  # the received slice's, in the order it holds them

    def block(self, start: int, width: int, causal: bool) -> BlockMask:
        return BlockMask(self.mask, self.queries, self.keys[start : start + width], causal)


def _add_visible(
    softmax: OnlineSoftmax,
    q_chunk: int,
    key_chunk_ids: tuple[int, ...],
    keys: torch.Tensor,
    values: torch.Tensor,
    length: int,
    causal: bool,
    tokens: _Tokens | None = None,
) -> bool:
    """Add the received key chunks query chunk ``q_chunk`` may see to its softmax; False when it sees none.

    A slice holds its chunks in increasing order, so the visible ones (those not after ``q_chunk``)
    are a prefix of it, a view; the query chunk's own chunk, if there, ends it: the keys before it
    are one block, wholly visible, and it is a causal square block. With ``tokens`` each block is
    masked (a block nothing in sees is skipped).
    """
    visible = sum(1 for b in key_chunk_ids if not causal or b <= q_chunk)
    if not visible:
        return False
    diagonal = causal and q_chunk in key_chunk_ids
    before = (visible - 1 if diagonal else visible) * length
    added = False
    if before:
        block = None if tokens is None else tokens.block(0, before, causal=False)
        added |= softmax.add(keys.narrow(2, 0, before), values.narrow(2, 0, before), causal=False, mask=block)
    if diagonal:
        block = None if tokens is None else tokens.block(before, length, causal=True)
        added |= softmax.add(keys.narrow(2, before, length), values.narrow(2, before, length), causal=True, mask=block)
    return added
