"""Which part of the sequence each rank of a context-parallel axis holds.

The sequence is cut into equal chunks. Unbalanced, rank ``i`` of ``n`` holds chunk ``i`` of ``n``.
Balanced (load-balanced causal attention), it is cut into ``2n`` chunks and rank ``i`` holds chunks
``i`` and ``2n - 1 - i``, in that order: under a causal mask an early chunk attends to few keys and a
late one to many, so pairing them gives every rank the same work.

Everything that is indexed by sequence position (inputs, positions for rotary embeddings, labels)
must be sharded by the same rule; shift labels for next-token prediction on the whole sequence
*before* sharding it, since the shifted-in token of a chunk's last position lives on another rank.

>>> import torch
>>> shard_order(8, 2, balanced=True).tolist()     # rank 0 holds 0,1 and 6,7; rank 1 holds 2..5
[0, 1, 6, 7, 2, 3, 4, 5]
>>> local_chunks(0, 2, balanced=True), chunk_count(2, balanced=True)
((0, 3), 4)
"""

from __future__ import annotations

import torch

from ...collectives import Mesh, all_gather, axis_index, axis_size


def chunk_count(size: int, balanced: bool) -> int:
    """How many equal chunks the sequence is cut into over an axis of ``size`` ranks."""
    return 2 * size if balanced else size


def local_chunks(index: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The global chunk numbers rank ``index`` of ``size`` holds, in the order it holds them."""
    if not 0 <= index < size:
        raise ValueError(f"local_chunks: index={index} is outside an axis of size {size}")
    return (index, 2 * size - 1 - index) if balanced else (index,)


def check_sequence_length(op: str, seq_len: int, size: int, balanced: bool, axis: str) -> int:
    """The length of one chunk; a clear error when ``seq_len`` does not cut into equal chunks."""
    count = chunk_count(size, balanced)
    if seq_len % count:
        how = f"2 x {size} chunks (balanced)" if balanced else f"{size} chunks"
        raise ValueError(
            f"{op}: the sequence of length {seq_len} does not cut into {how} over axis {axis!r} of size {size}; "
            f"pad it to a multiple of {count}" + (" or pass balanced=False" if balanced else "")
        )
    return seq_len // count


def shard_order(seq_len: int, size: int, balanced: bool) -> torch.Tensor:
    """Global positions in the order the ranks hold them: rank 0's tokens, then rank 1's, ...

    ``x.index_select(dim, shard_order(...))`` puts a whole sequence in shard order; its inverse
    permutation (``argsort``) puts it back.
    """
    count = chunk_count(size, balanced)
    if seq_len % count:
        raise ValueError(f"shard_order: seq_len={seq_len} is not a multiple of the {count} chunks")
    length = seq_len // count
    starts = [c * length for r in range(size) for c in local_chunks(r, size, balanced)]
    return torch.cat([torch.arange(s, s + length) for s in starts])


def shard_sequence(
    x: torch.Tensor, axis: str, *, dim: int = 1, balanced: bool = True, mesh: Mesh | None = None
) -> torch.Tensor:
    """This rank's part of the whole sequence ``x`` (sequence along ``dim``) over mesh ``axis``.

    Every rank passes the same whole ``x``; it keeps its chunks (see the module docstring). Use it for
    token ids, positions (``torch.arange(seq_len)``: rotary embeddings need the *global* position)
    and labels alike. No communication.

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.context_parallel import shard_sequence
    >>> def main():
    ...     return shard_sequence(torch.arange(8).view(1, 8), "cp", mesh=sw.Mesh(cp=2)).tolist()
    >>> sw.launch(main, world=2, timeout=60)
    [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    """
    dim = _sequence_dim("shard_sequence", x, dim)
    size, index = axis_size(axis, mesh=mesh), axis_index(axis, mesh=mesh)
    length = check_sequence_length("shard_sequence", x.shape[dim], size, balanced, axis)
    return torch.cat([x.narrow(dim, c * length, length) for c in local_chunks(index, size, balanced)], dim)


def unshard_sequence(
    x: torch.Tensor, axis: str, *, dim: int = 1, balanced: bool = True, mesh: Mesh | None = None
) -> torch.Tensor:
    """The whole sequence, on every rank, from each rank's part ``x``: the inverse of :func:`shard_sequence`.

    An all-gather over ``axis`` (differentiable: its gradient is a reduce-scatter), then the inverse
    of the shard order.

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.context_parallel import shard_sequence, unshard_sequence
    >>> def main():
    ...     mesh = sw.Mesh(cp=2)
    ...     local = shard_sequence(torch.arange(8.0).view(1, 8), "cp", mesh=mesh)
    ...     return unshard_sequence(local, "cp", mesh=mesh).tolist()
    >>> sw.launch(main, world=2, timeout=60)[1]
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    dim = _sequence_dim("unshard_sequence", x, dim)
    size = axis_size(axis, mesh=mesh)
    whole = all_gather(x, axis, dim, tiled=True, mesh=mesh)
    order = shard_order(whole.shape[dim], size, balanced)
    return whole.index_select(dim, torch.argsort(order).to(x.device))


def _sequence_dim(op: str, x: object, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{op}: dim={dim} is out of range for the tensor of shape {tuple(x.shape)}")
    return dim % x.ndim
