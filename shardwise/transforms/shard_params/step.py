"""The data-parallel step with ZeRO-1/2/3 sharding over one mesh axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ...engine.data_parallel import DataParallel
from ...engine.devices import host_scalar
from ...engine.flat import UnitLayout
from ...engine.plan import Plan
from ...engine.state import Params, TrainState, map_params
from ...engine.step import Metrics, Step, check_params, split_batch, split_over, tree_nbytes
from .lowering import ShardingOptions, lower_rank, peak_gathered_units
from .runtime import ShardRuntime


@dataclass(frozen=True)
class ShardedLayout:
    """Static description of a sharded TrainState: the axis and every unit's flat layout."""

    axis: str
    stage: int
    units: dict[str, UnitLayout]
    layers: tuple[str, ...]  # the keys of the full params pytree, in order


@dataclass(frozen=True)
class ShardedStep(Step):
    """A Step made data parallel over ``axis`` with ZeRO ``stage`` sharding (see shard_params)."""

    axis: str = "dp"
    stage: int = 3
    reshard_after_forward: bool = True
    prefetch: int = 1
    accumulation: int = 1

    @property
    def data_parallel(self) -> DataParallel:
        return DataParallel(self.axis, self.stage)

    @property
    def options(self) -> ShardingOptions:
        return ShardingOptions(self.stage, self.reshard_after_forward, self.prefetch, self.accumulation)

    def units(self, params: Params) -> list[str]:
        """Layers that own parameters, in chain order: each is gathered and reduced as one buffer."""
        return [n for n in self.chain.names if params.get(n)]

    def layouts(self, params: Params, shards: int) -> dict[str, UnitLayout]:
        return {u: UnitLayout.of(u, params[u], shards) for u in self.units(params)}

    def _check_mesh(self, mesh: Mesh | None) -> Mesh:
        if mesh is None:
            raise ValueError(f"shard_params(axis={self.axis!r}) needs the mesh: call step.init(params, mesh)")
        if self.axis not in mesh.axis_names:
            raise ValueError(
                f"shard_params(axis={self.axis!r}): {mesh!r} has no axis {self.axis!r}; "
                f"use one of {mesh.axis_names} or build the mesh with that axis"
            )
        return mesh

    # -- state ------------------------------------------------------------------
    def init(self, params: Params, mesh: Mesh | None = None) -> TrainState:
        mesh = self._check_mesh(mesh)
        check_params(self.chain, params)
        n, index = mesh.axis_size(self.axis), mesh.axis_index(self.axis)
        params = self.master_params(params)
        layouts = self.layouts(params, n)
        shards = {u: lay.shard_of(lay.flatten(params[u]), index) for u, lay in layouts.items()}
        held = shards if self.stage == 3 else params
        return TrainState(
            params=held,
            opt_state=self.optimizer.init(shards),
            step=0,
            loss_scale=self.initial_loss_scale(),
            mesh=mesh,
            layout=ShardedLayout(self.axis, self.stage, layouts, tuple(params)),
        )

    def _layout(self, state: TrainState) -> ShardedLayout:
        layout = state.layout
        if not isinstance(layout, ShardedLayout) or layout.axis != self.axis or layout.stage != self.stage:
            raise ValueError(
                f"this TrainState was not made by this shard_params step (axis={self.axis!r}, "
                f"stage={self.stage}); build it with step.init(params, mesh)"
            )
        return layout

    def _my_shards(self, state: TrainState, layout: ShardedLayout, index: int) -> dict[str, torch.Tensor]:
        if self.stage == 3:
            return dict(state.params)
        return {u: lay.shard_of(lay.flatten(state.params[u]), index) for u, lay in layout.units.items()}

    def full_params(self, state: TrainState) -> Params:
        """Every rank gets the complete parameters (an all-gather per unit under stage 3)."""
        layout = self._layout(state)
        if self.stage != 3:
            return state.params
        from ...collectives.ops import all_gather

        full: Params = {}
        for unit, lay in layout.units.items():
            flat = all_gather(state.params[unit], self.axis, tiled=True, mesh=state.mesh)
            full[unit] = {k: v.clone() for k, v in lay.unflatten(flat).items()}
        return {layer: full.get(layer, {}) for layer in layout.layers}

    # -- running ----------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        layout = self._layout(state)
        mesh: Mesh = state.mesh
        n, index = mesh.axis_size(self.axis), mesh.axis_index(self.axis)
        local = split_over(split_batch(batch), n, index, f"shard_params over axis {self.axis!r} of size {n}")
        parts = self.accumulation
        micro = [
            split_over(local, parts, i, f"shard_params(accumulation={parts}) on the local batch")
            for i in range(parts)
        ]
        scale = self.loss_scale_value(state)
        prec = self.precision
        shards = self._my_shards(state, layout, index)
        runtime = ShardRuntime(
            chain=self.chain,
            loss_fn=self.loss_fn,
            mesh=mesh,
            axis=self.axis,
            layouts=layout.units,
            shards=shards,
            full_params=None if self.stage == 3 else self._compute_params(state.params),
            microbatches=[tuple(m) for m in micro],
            loss_scale=scale / (n * parts),
            grad_scale=scale,
            # Compute copies are cast once per step, before they travel: half the bytes in bf16.
            gather_from=None if prec is None or self.stage != 3 else {
                u: t.to(prec.for_layer(u).compute) for u, t in shards.items()
            },
            reduce_dtype=None if prec is None else prec.policy.reduce,
            exchange=self.metric_exchange(),
        )
        outcome: list[tuple[Any, Any, Any]] = []

        def update(_action: object) -> None:
            summed = runtime.summed
            outcome.append(self.finish(state, runtime.grad_shards, shards, summed.norm, summed.finite))
            runtime.new_shards = outcome[0][0]

        actions = lower_rank(self.chain, list(layout.units), self.options)
        runtime.run(actions, update)
        new_shards, opt_state, loss_scale = outcome[0]
        params: Any = new_shards if self.stage == 3 else self._merge(state.params, runtime.new_full_params)
        summed = runtime.summed
        metrics = self.report(summed.mean_loss(n * parts), summed.norm)
        metrics["peak_gathered_bytes"] = host_scalar(runtime.peak_gathered_bytes)
        if prec is not None:
            metrics["loss_scale"] = host_scalar(scale)
            metrics["skipped"] = host_scalar(not summed.finite)
        new_state = state._replace(params=params, opt_state=opt_state, step=state.step + 1, loss_scale=loss_scale)
        return new_state, metrics

    def _compute_params(self, params: Params) -> Params:
        return params if self.precision is None else self.precision.compute_params(params)

    @staticmethod
    def _merge(old: Params, new: Params) -> Params:
        return {layer: new.get(layer, tensors) for layer, tensors in old.items()}

    # -- inspection ------------------------------------------------------------------
    def plan(self, mesh: Mesh | None = None, params: Params | None = None, batch: Any = None) -> Plan:
        """Per-rank actions; with ``params``, the bytes each rank holds at rest and the gathered peak;
        with a ``batch`` too, the activation bytes kept for backward (one micro-batch of one rank's slice
        is alive at a time)."""
        mesh = self._check_mesh(mesh)
        n = mesh.axis_size(self.axis)
        if params is None:
            units = [layer.name for layer in self.chain.layers if self.chain.owned_param_names(layer.name)]
            memory: dict[str, tuple[int, ...]] = {}
            actions = lower_rank(self.chain, units, self.options)
            return Plan(mesh, (actions,) * mesh.size, memory)
        check_params(self.chain, params)
        meta = map_params(lambda t: torch.empty_like(t, device="meta"), params)
        layouts = self.layouts(meta, n)
        actions = lower_rank(self.chain, list(layouts), self.options)
        shard_meta = {u: torch.empty(lay.shard_numel, dtype=lay.dtype, device="meta") for u, lay in layouts.items()}
        per_rank = {
            "params": tree_nbytes(shard_meta) if self.stage == 3 else tree_nbytes(meta),
            "grads": tree_nbytes(shard_meta),
            "opt_state": tree_nbytes(self.optimizer.init(shard_meta)),
            "gathered_peak": peak_gathered_units(actions, {u: lay.padded_nbytes for u, lay in layouts.items()}),
        }
        if batch is not None:
            local = split_over(split_batch(batch), n, 0, f"shard_params over axis {self.axis!r} of size {n}")
            micro = split_over(local, self.accumulation, 0, f"shard_params(accumulation={self.accumulation})")
            per_rank["kept_for_backward"] = self.kept_for_backward(params, micro[0])
        memory = {k: (v,) * mesh.size for k, v in per_rank.items()}
        return Plan(mesh, (actions,) * mesh.size, memory)

