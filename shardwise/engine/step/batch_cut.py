"""How a step cuts the global batch into a rank's share, asked once for the run and for the Plan.

The global batch is cut over shard_params' axis, then by the split (``SplitRole.batch_cut``): over its
batch axes, then into parts of every sequence. Each share (and each part of a sequence) is a replica
of the mean: the loss is seeded by 1 / (their number). ``run_inputs.py`` takes the calling rank's
share, ``planning.py`` rank 0's (every rank's share has the same shapes): both through
:func:`rank_share`, so the Plan is made from what the run computes on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...collectives.mesh import Mesh
from ..plan.batches import split_batch, split_over
from ..plan.lower import microbatch_count
from ..stack.in_layer import BatchShares

if TYPE_CHECKING:
    from .step import Step


def batch_cuts(step: Step, mesh: Mesh | None) -> list[tuple[str, int, str]]:
    """The axes the global batch is cut over, with their sizes and the words naming the cut:
    shard_params' (under HSDP its replicas' axis, then its shards'), then each split's batch axes (in the
    stack's order), each rank taking its share."""
    if mesh is None:
        return []
    zero = step.sharding_spec
    named = [] if zero is None else [(zero.axis, "shard_params")]
    if zero is not None and zero.replicate is not None:
        named.insert(0, (zero.replicate, "shard_params(replicate=...)"))
    named += [(a, part.name) for part in step.split.parts for a in part.batch_cut(mesh).axes]
    return [(a, mesh.axis_size(a), f"{who} over axis {a!r} of size {mesh.axis_size(a)}") for a, who in named]


def batch_multiple(step: Step, mesh: Mesh | None) -> tuple[int, str]:
    """What the global batch size must be a multiple of: it is cut per data-parallel rank (and per
    rank of a split that cuts the batch), then per micro-batch; and the words that say so."""
    k = microbatch_count(step)
    cuts = batch_cuts(step, mesh)
    ranks = math.prod(n for _, n, _ in cuts)
    if not cuts or (k == 1 and len(cuts) == 1):
        return ranks * k, ""
    words = " x ".join(f"{n} ranks of axis {a!r}" for a, n, _ in cuts)
    return ranks * k, f" ({words}{f' x {k} micro-batches' if k > 1 else ''})"


def rank_share(step: Step, mesh: Mesh | None, batch: Any, rank: int | None) -> tuple[tuple[Any, Any], int]:
    """(``rank``'s share of the global ``batch`` as an (inputs, targets) pair, the replicas of the mean
    it was cut into: 0 when not cut); ``rank`` None: the calling rank. Not yet cut into micro-batches."""
    pair = split_batch(batch)
    whole = batch_multiple(step, mesh)
    cuts = batch_cuts(step, mesh)
    for axis, n, what in cuts:
        assert mesh is not None
        index = mesh.axis_index(axis) if rank is None else mesh.coords_of(rank)[axis]
        pair = split_over(pair, n, index, what, whole)
    cut = step.split.batch_cut(mesh)
    pair = cut.sequence(pair, rank)
    replicas = math.prod(n for _, n, _ in cuts) * cut.sequence_parts if cuts or cut.sequence_parts > 1 else 0
    return pair, replicas


def batch_shares(step: Step, mesh: Mesh | None) -> BatchShares:
    """The axes whose indices hold different shares of the batch (the cuts above, then a split's
    sequence axis), and how many shares each micro-batch is cut into over them (the run seeds each
    micro-batch's loss by 1 / (that x the micro-batches))."""
    axes = [a for a, _, _ in batch_cuts(step, mesh)]
    if mesh is not None:
        axes += [p.axis for p in step.split.parts if p.batch_cut(mesh).sequence_parts > 1]
    shares = math.prod(mesh.axis_size(a) for a in axes) if mesh is not None and axes else 1
    return BatchShares(tuple(axes), shares)
