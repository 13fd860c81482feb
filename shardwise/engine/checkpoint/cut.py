"""Cutting a TrainState into the pieces each rank saves, and building one back from whole tensors.

A checkpoint stores every parameter-shaped tensor (a parameter, or an optimizer-state
leaf that mirrors it) under its global shape, as chunks: rectangular boxes of the
global tensor, as torch.distributed.checkpoint (DCP) stores a sharded tensor. A rank
saves the part it owns and nobody else does: under ZeRO the elements of its flat
shard (also at stages 1 and 2, where every rank holds the full parameters: the write
is spread as the optimizer state is); in a pipeline only the index that owns a layer
(not those holding a copy of a tied weight); and on every other mesh axis, where the
state is replicated, only coordinate 0. A flat shard starts and ends anywhere in a
parameter, so its range is cut into a few boxes (a partial row, whole rows, a
partial row, recursively): at most ``2 * ndim - 1`` per parameter and shard.

Loading reads of those chunks, whatever mesh wrote them, the parts that meet what a
rank keeps on the target mesh, straight into the tensors it keeps, laid out exactly as
``step.init`` lays them out (the target's :class:`StateLayout` and its flat units,
padding zero): see ``load_state``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ...collectives.mesh import Mesh
from ..layout.state_layout import StateLayout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``, in order;
    each is a contiguous run of the flattened tensor."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, c1)]
    out: list[Box] = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, c1)]
    return out


def flat_start(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The flat position of a box's first element."""
    position = 0
    for size, offset in zip(shape, offsets, strict=True):
        position = position * size + offset
    return position


@dataclass(frozen=True)
class Region:
    """Elements ``[start, stop)`` of one flattened parameter that this rank saves; under ZeRO
    they sit in ``unit``'s flat shard from ``shard_start``."""

    layer: str
    name: str
    start: int
    stop: int
    unit: str | None = None
    shard_start: int = 0

    def cut(self, tree: Mapping[str, Any]) -> torch.Tensor:
        """The region's elements from a tree like the params (or their flat shards under ZeRO)."""
        if self.unit is not None:
            return tree[self.unit][self.shard_start : self.shard_start + self.stop - self.start]
        return tree[self.layer][self.name].reshape(-1)[self.start : self.stop]


def my_regions(layout: StateLayout, mesh: Mesh | None) -> list[Region]:
    """What the calling rank saves of every parameter-shaped tree (see the module docstring)."""
    index = layout.index_of(mesh)
    sharding = layout.sharding
    splits = {s.split.axis for s in layout.leaves.values() if s.split is not None}
    coords: dict[str, int] = {}
    if mesh is not None:
        used = {layout.placement.axis, None if sharding is None else sharding.axis, *splits}
        if any(c != 0 for axis, c in mesh.coords.items() if axis not in used):
            return []
        coords = dict(mesh.coords)

    def mine(layer: str, name: str) -> bool:
        """This rank saves its copy: the owner's pipeline index, and on every axis that cuts parameters
        but not this one (it is whole over that axis) the first index only."""
        spec = layout.leaves[(layer, name)]
        own = None if spec.split is None else spec.split.axis
        return spec.copies[0].index == index and all(coords.get(a, 0) == 0 for a in splits if a != own)

    regions: list[Region] = []
    if sharding is None:
        for (layer, name), spec in layout.leaves.items():
            if mine(layer, name):
                regions.append(Region(layer, name, 0, math.prod(spec.local_shape)))
        return regions
    assert mesh is not None
    dp = mesh.axis_index(sharding.axis)
    for unit, lay in sharding.units.items():
        low, high = dp * lay.shard_numel, (dp + 1) * lay.shard_numel
        offset = 0
        for name, numel in zip(lay.names, lay.numels, strict=True):
            if mine(unit, name):
                a, b = max(low, offset), min(high, offset + numel)
                if a < b:
                    regions.append(Region(unit, name, a - offset, b - offset, unit, a - low))
                elif numel == 0 and dp == 0:  # no shard holds it; still saved (its shape and dtype) once
                    regions.append(Region(unit, name, 0, 0, unit, 0))
            offset += numel
    return regions


def update_tree(layout: StateLayout, mesh: Mesh | None, params: Any) -> Any:
    """The tree the optimizer updates (and its state mirrors): the params, or the flat shards."""
    sharding = layout.sharding
    if sharding is None:
        return params
    assert mesh is not None
    return sharding.my_shards(params, mesh.axis_index(sharding.axis))


# -- optimizer state: the subtrees that mirror the update tree, and the rest --------------------
def _children(node: Any) -> list[tuple[str, Any]] | None:
    """A container's children with the names a path uses; None for a leaf."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node, strict=True))
    if isinstance(node, Mapping):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    return None


def is_mirror(node: Any, like: Any) -> bool:
    """Whether ``node`` is shaped like the update tree ``like``: a per-parameter subtree (a momentum)."""
    tree: Any = node  # optree's stubs take no Mapping
    if not isinstance(node, Mapping) or optree.tree_structure(tree) != optree.tree_structure(like):
        return False
    pairs: list[tuple[Any, Any]] = list(zip(optree.tree_leaves(tree), optree.tree_leaves(like), strict=True))
    return all(isinstance(a, torch.Tensor) and a.shape == b.shape for a, b in pairs)


def split_opt_state(opt_state: Any, like: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(mirrors, scalars)``: the subtrees shaped like the update tree ``like`` (momentum,
    moments) and every other tensor (step counts), each by its path (``"momentum"``, ``"step"``)."""
    mirrors: dict[str, Any] = {}
    scalars: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if node is None:
            return
        if path and is_mirror(node, like):
            mirrors[path] = node
            return
        children = _children(node)
        if children is None:
            if not isinstance(node, torch.Tensor):
                raise TypeError(
                    f"optimizer state {path or '<root>'} is a {type(node).__name__}; a checkpoint saves "
                    "tensors and containers of them (keep numbers in 0-d tensors)"
                )
            scalars[path] = node
            return
        for name, child in children:
            walk(child, f"{path}.{name}" if path else name)

    walk(opt_state, "")
    return mirrors, scalars


def rebuild_opt_state(
    template: Any, like: Any, mirror: Callable[[str, Any], Any], scalar: Callable[[str, torch.Tensor], torch.Tensor]
) -> Any:
    """``template`` (a fresh ``optimizer.init(like)``, real or meta) with each mirror subtree from
    ``mirror(path, template_subtree)`` and each other tensor from ``scalar(path, template_leaf)``."""

    def walk(node: Any, path: str) -> Any:
        if node is None:
            return None
        if path and is_mirror(node, like):
            return mirror(path, node)
        children = _children(node)
        if children is None:
            return scalar(path, node)
        values = [walk(child, f"{path}.{name}" if path else name) for name, child in children]
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*values)
        if isinstance(node, Mapping):
            return dict(zip(node.keys(), values, strict=True))
        return type(node)(values)

    return walk(template, "")


def local_keys(layout: StateLayout, index: int, names: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """The (layer -> names) pipeline index ``index`` holds: its layers' and its tied copies
    (``step.init``'s local params), from every layer's parameter names."""
    placement = layout.placement
    local = {layer: list(names.get(layer, [])) for layer in placement.layers_of(index) if layer in names}
    for owner, name in placement.replicas_of(index):
        local.setdefault(owner, []).append(name)
    return local
