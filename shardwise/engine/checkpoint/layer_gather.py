"""One layer's whole parameters, gathered from wherever the state keeps them: what ``full_params`` does
for the whole model, a layer at a time, so that an export or a state_dict for one rank never holds
more than one layer gathered beside the state.

Under ZeRO-3 the layer's unit is all-gathered over the data-parallel axis; under a pipeline each of its
parameters is broadcast from the pipeline index that owns it; under tensor parallelism each split
parameter's slices are gathered and joined. Collectives: every rank calls it for every layer, in the
same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ...collectives.ops import all_gather, broadcast
from ..layout.devices import device_of
from ..layout.state_layout import LeafSpec, StateLayout


def gathered_layer(layout: StateLayout, held: Any, mesh: Mesh | None, layer: str) -> dict[str, torch.Tensor]:
    """``layer``'s whole parameters on the ranks that receive them (collectives: every rank calls this
    for every layer, in order). ``full_params``, for one layer, keeping views, not copies."""
    sharding = layout.sharding
    local: Mapping[str, torch.Tensor]
    if sharding is not None and sharding.holds_shards:
        lay = sharding.units.get(layer)
        local = {} if lay is None else lay.unflatten(all_gather(held[layer], sharding.axis, tiled=True, mesh=mesh))
    else:
        local = held.get(layer, {})
    leaves = [spec for (owner, _), spec in layout.leaves.items() if owner == layer]
    out: dict[str, torch.Tensor] = {}
    for spec in leaves:
        out[spec.name] = _whole_leaf(layout, spec, local.get(spec.name), held, mesh)
    return out


def _whole_leaf(layout: StateLayout, spec: LeafSpec, mine: torch.Tensor | None, held: Any, mesh: Mesh | None
                ) -> torch.Tensor:
    """One parameter whole: broadcast from the pipeline index that owns it, its tensor-parallel slices joined."""
    placement = layout.placement
    if placement.axis is not None:
        assert mesh is not None
        # a rank that does not hold the leaf sends nothing (root is the owner) but passes a tensor of its shape
        x = mine if mine is not None else torch.zeros(spec.local_shape, dtype=spec.dtype, device=device_of(held))
        mine = broadcast(x, placement.axis, root=spec.copies[0].index, mesh=mesh)
    assert mine is not None
    split = spec.split
    if split is not None:  # tensor parallel: every index's slice, joined
        assert mesh is not None
        pieces = all_gather(mine.contiguous(), split.axis, mesh=mesh)
        mine = split.join(list(pieces.unbind(0)))
    return mine
