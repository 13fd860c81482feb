"""What each rank's pipeline transfers carry, per micro-batch, for the Plan.

A stage boundary carries what that micro-batch's stage output holds, and a model may leave a value out
of some micro-batches (a Hugging Face attention mask, None for one without a padded row): the run
predicts each of its own micro-batches (``layouts.stage_boundaries``), so the Plan does too. Ranks of
one class (engine/step/planning.py: ``rank_class``) that hold differently padded shares of the batch
then send other bytes, and are told apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...collectives.mesh import Mesh
from ..layout.state_layout import StateLayout
from ..plan.batches import split_over
from ..plan.lower import microbatch_count
from .batch_cut import batch_multiple, batch_shares, rank_share

if TYPE_CHECKING:
    from .step import Step


def rank_microbatches(step: Step, mesh: Mesh, batch: Any, rank: int) -> list[tuple[Any, Any]]:
    """``rank``'s micro-batches of the global ``batch``, cut as the run cuts them."""
    pair, _ = rank_share(step, mesh, batch, rank)
    k = microbatch_count(step)
    if k == 1:
        return [pair]
    return [split_over(pair, k, j, f"{k} micro-batches", batch_multiple(step, mesh)) for j in range(k)]


def classes_by_boundaries(
    step: Step, mesh: Mesh, batch: Any, layouts: Mapping[Any, StateLayout], class_of: Sequence[Any]
) -> tuple[list[Any], dict[Any, Any]]:
    """Each rank's class, told apart by what its own micro-batches pass on between stages, and each such
    class's boundaries per micro-batch (None: not predicted, transfers announced). Ranks of equal local
    shapes that hold the same share of the batch pass on the same: each share is predicted once per such
    set of shapes."""
    axes = batch_shares(step, mesh).axes
    found: dict[Any, Any] = {}
    numbered: dict[Any, int] = {}  # each distinct structure's number (the boundaries themselves are large keys)
    classes: list[Any] = []
    boundaries: dict[Any, Any] = {}
    shapes_of: dict[Any, Any] = {}
    for r, c in enumerate(class_of):
        if c not in shapes_of:  # classes of equal local shapes predict alike (pipeline indices, mostly)
            leaves = layouts[c].leaves.items()
            shapes_of[c] = tuple((key, spec.local_shape, spec.dtype) for key, spec in leaves)
        coords = mesh.coords_of(r)
        share = (shapes_of[c], tuple(coords[a] for a in axes))
        if share not in found:
            per_microbatch = [step.boundaries(layouts[c], x, mesh) for x, _ in rank_microbatches(step, mesh, batch, r)]
            found[share] = None if any(b is None for b in per_microbatch) else tuple(per_microbatch)
        key = (c, numbered.setdefault(found[share], len(numbered)))
        classes.append(key)
        boundaries[key] = found[share]
    return classes, boundaries
