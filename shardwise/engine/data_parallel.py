"""Data-parallel ZeRO sharding of a subset of layers, for steps that compose with it.

``shard_params`` on its own runs a fine-grained plan (per-layer gathers with
prefetch, reduce-scatters right after each backward). When another transform
drives the computation, such as a pipeline whose schedule decides when each
stage runs, it holds its layers' parameters through this store instead:

* ``init``: every rank keeps its ``1/N`` flat shard of each unit (stage 3), or
  the full parameters plus the shard the optimizer updates (stages 1, 2);
* ``gather``: all-gather the units once per step before the first compute;
* ``reduce``: reduce-scatter each unit's accumulated gradient after the last
  backward;
* ``rebuild``: after the optimizer updated the shards, (stages 1, 2) an
  all-gather rebuilds the full parameters.

Living in the engine, it lets transforms compose without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives.mesh import Mesh
from ..collectives.ops import all_gather, psum_scatter
from .devices import device_of
from .flat import UnitLayout
from .state import Params


@dataclass(frozen=True)
class DataParallel:
    """Shard over mesh ``axis`` at ZeRO ``stage`` (1: optimizer state, 2: + gradients, 3: + parameters)."""

    axis: str
    stage: int

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"DataParallel(stage={self.stage!r}): ZeRO stages are 1, 2 or 3")


@dataclass(frozen=True)
class ShardedParamsLayout:
    """Static part of a sharded parameter set: the spec and every unit's flat layout."""

    spec: DataParallel
    units: dict[str, UnitLayout]


def shard_layouts(params: Params, spec: DataParallel, shards: int) -> dict[str, UnitLayout]:
    """One flat layout per layer that owns parameters."""
    return {u: UnitLayout.of(u, tensors, shards) for u, tensors in params.items() if tensors}


def init_shards(params: Params, layout: ShardedParamsLayout, index: int) -> tuple[Params | dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what the TrainState holds, the shards the optimizer updates) for axis position ``index``."""
    shards = {u: lay.shard_of(lay.flatten(params[u]), index) for u, lay in layout.units.items()}
    held: Any = shards if layout.spec.stage == 3 else {k: dict(v) for k, v in params.items()}
    return held, shards


class ShardedParams:
    """One rank's view of sharded parameters during one step (see the module docstring)."""

    def __init__(self, layout: ShardedParamsLayout, held: Mapping[str, Any], mesh: Mesh) -> None:
        self.layout, self.held, self.mesh = layout, held, mesh
        self.axis = layout.spec.axis
        self.index = mesh.axis_index(self.axis)
        self.size = mesh.axis_size(self.axis)

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every unit (cut from the full parameters under stages 1 and 2)."""
        if self.layout.spec.stage == 3:
            return dict(self.held)
        return {u: lay.shard_of(lay.flatten(self.held[u]), self.index) for u, lay in self.layout.units.items()}

    def gather(self, compute: Callable[[str], torch.dtype] | None = None) -> Params:
        """The full parameters of every unit (an all-gather each under stage 3).

        With ``compute`` (layer -> dtype), shards are cast before they travel,
        so a bf16 compute copy moves half the bytes of the fp32 master.
        """
        def cast(unit: str, t: torch.Tensor) -> torch.Tensor:
            return t if compute is None else t.to(compute(unit))

        if self.layout.spec.stage != 3:
            return {k: {n: cast(k, t) for n, t in v.items()} for k, v in self.held.items()}
        return {
            u: lay.unflatten(all_gather(cast(u, self.held[u]), self.axis, tiled=True, mesh=self.mesh))
            for u, lay in self.layout.units.items()
        }

    def reduce(
        self, grads: Mapping[str, Mapping[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Reduce-scatter every unit's local gradient (missing entries count as zero) into shards,
        travelling in ``dtype`` when given."""
        out: dict[str, torch.Tensor] = {}
        for u, lay in self.layout.units.items():
            local = grads.get(u, {})
            flat = lay.flatten_grads(local, device_of(local, self.held[u]))
            out[u] = psum_scatter(flat if dtype is None else flat.to(dtype), self.axis, tiled=True, mesh=self.mesh)
        return out

    def rebuild(self, shards: Mapping[str, torch.Tensor]) -> Any:
        """What the TrainState holds after an update of the shards: the shards themselves (stage 3),
        or the full parameters all-gathered from them (stages 1, 2)."""
        if self.layout.spec.stage == 3:
            return dict(shards)
        full = {k: dict(v) for k, v in self.held.items()}
        for u, lay in self.layout.units.items():
            flat = all_gather(shards[u], self.axis, tiled=True, mesh=self.mesh)
            full[u] = {k: v.clone() for k, v in lay.unflatten(flat).items()}
        return full
