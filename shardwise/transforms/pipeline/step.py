"""The pipelined step: the chain cut into stages over a mesh axis, run by a schedule."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ...collectives.mesh import Mesh
from ...collectives.ops import broadcast
from ...engine._storage import fake_tensors
from ...engine.accounting import predict_kept_for_backward
from ...engine.data_parallel import (
    DataParallel,
    ShardedParams,
    ShardedParamsLayout,
    init_shards,
    shard_layouts,
)
from ...engine.devices import device_of, host_scalar
from ...engine.plan import Action, Plan
from ...engine.state import Params, TrainState, map_params
from ...engine.step import (
    Metrics,
    Step,
    check_params,
    split_batch,
    split_over,
    tree_nbytes,
    unscale_like,
)
from .builtins import get_schedule
from .lowering import lower_rank
from .partition import balanced_partition, check_partition, param_counts, stage_layers
from .runtime import Layout, PipelineRuntime
from .schedule import Schedule
from .simulate import simulate
from .validate import validate


@dataclass(frozen=True)
class PipelineLayout:
    """Static description of a pipelined TrainState: stages, placement, schedule, parameter shapes."""

    axis: str
    stages: tuple[tuple[str, ...], ...]
    schedule: Schedule
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]]
    sharded: ShardedParamsLayout | None = None  # this rank's layers, when sharded over a dp axis
    # Weights tied across pipeline ranks: (owner layer, name, the axis indices that use it). Each of
    # those ranks holds a copy; their gradient contributions are exchanged and summed in axis order,
    # so every copy takes the same update (Megatron keeps its tied embeddings this way).
    tied: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    # Memo of the tensors each stage boundary carries, by micro-batch input layout (see
    # PipelineStep.boundary_layouts): derived data, computed once per input shape.
    boundary_cache: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # Memo of each pipeline index's actions (lower_rank of the schedule): the same every step.
    actions_cache: dict[int, tuple[Action, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def actions_of(self, index: int) -> tuple[Action, ...]:
        """Pipeline index ``index``'s actions: its schedule ops with the sends and receives around them."""
        if index not in self.actions_cache:
            self.actions_cache[index] = lower_rank(self.schedule, index)
        return self.actions_cache[index]

    def replicas_of(self, index: int) -> list[tuple[str, str]]:
        """Tied weights rank ``index`` holds a copy of without owning their layer."""
        mine = set(self.layers_of(index))
        return [(owner, name) for owner, name, users in self.tied if index in users and owner not in mine]

    def layers_of(self, index: int) -> tuple[str, ...]:
        """The layers held by pipeline rank ``index`` (its stages, in order)."""
        return tuple(n for s, layers in enumerate(self.stages) if self.schedule.placement[s] == index for n in layers)


def split_microbatches(batch: Any, parts: int) -> list[tuple[Any, Any]]:
    """``parts`` equal slices of (inputs, targets) along dim 0, with a clear error when they do not divide."""
    pair = split_batch(batch)
    return [split_over(pair, parts, i, f"pipeline(microbatches={parts})") for i in range(parts)]


@dataclass(frozen=True)
class PipelineStep(Step):
    """A Step pipelined over ``axis`` (see :func:`pipeline`)."""

    axis: str = "pp"
    schedule: Any = "1f1b"
    microbatches: int = 1
    stages: int | None = None
    partition: tuple[int, ...] | None = None
    poison: bool = False
    trace: bool = False
    dp: DataParallel | None = None  # ZeRO sharding of each rank's layers over a data-parallel axis

    @property
    def data_parallel(self) -> DataParallel | None:
        return self.dp

    def with_data_parallel(self, spec: DataParallel) -> PipelineStep:
        if self.dp is not None:
            raise ValueError(f"shard_params was applied twice (already sharded over axis {self.dp.axis!r})")
        if spec.axis == self.axis:
            raise ValueError(f"shard_params and pipeline both use axis {spec.axis!r}; give them different axes")
        return dataclasses.replace(self, dp=spec)

    # -- layout ------------------------------------------------------------------------
    def _check_mesh(self, mesh: Mesh | None) -> Mesh:
        if mesh is None:
            raise ValueError(f"pipeline(axis={self.axis!r}) needs the mesh: call step.init(params, mesh)")
        for axis, who in ((self.axis, "pipeline"), (self.dp.axis if self.dp else None, "shard_params")):
            if axis is not None and axis not in mesh.axis_names:
                raise ValueError(f"{who}(axis={axis!r}): {mesh!r} has no axis {axis!r}; use one of {mesh.axis_names}")
        return mesh

    def num_stages(self, ranks: int) -> int:
        if self.stages is not None:
            return self.stages
        if isinstance(self.schedule, Schedule):
            return self.schedule.num_stages
        return 2 * ranks if self.schedule == "zb_v" else ranks

    def layout(self, mesh: Mesh, params: Params | None) -> PipelineLayout:
        """Stages, schedule and shapes for ``mesh``; refuses anything that cannot run."""
        mesh = self._check_mesh(mesh)
        ranks = mesh.axis_size(self.axis)
        count = self.num_stages(ranks)
        names = list(self.chain.names)
        if self.partition is not None:
            counts = check_partition(self.partition, len(names), count)
        elif params is not None:
            counts = balanced_partition(param_counts(names, params), count)
        else:
            raise ValueError(
                "pipeline balances stages by parameter count: pass the params (step.plan(mesh, params)) "
                "or give the layer counts with pipeline(..., partition=[...])"
            )
        stages = stage_layers(names, counts)
        schedule = get_schedule(self.schedule, ranks, count, self.microbatches)
        validate(schedule)
        shapes = {} if params is None else {
            layer: {k: (t.shape, t.dtype) for k, t in tensors.items()} for layer, tensors in params.items()
        }
        return PipelineLayout(self.axis, stages, schedule, shapes, tied=self._tied_across_ranks(stages, schedule))

    def _tied_across_ranks(
        self, stages: tuple[tuple[str, ...], ...], schedule: Schedule
    ) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """Every tied weight whose users sit on more than one pipeline rank, with those ranks."""
        rank_of_layer = {n: schedule.placement[s] for s, layers in enumerate(stages) for n in layers}
        users: dict[tuple[str, str], set[int]] = {}
        for layer in self.chain.layers:
            for owner, name in layer.ties.values():
                users.setdefault((owner, name), {rank_of_layer[owner]}).add(rank_of_layer[layer.name])
        return tuple(
            (owner, name, tuple(sorted(ranks))) for (owner, name), ranks in sorted(users.items()) if len(ranks) > 1
        )

    # -- state ---------------------------------------------------------------------------------
    def init(self, params: Params, mesh: Mesh | None = None) -> TrainState:
        mesh = self._check_mesh(mesh)
        check_params(self.chain, params)
        layout = self.layout(mesh, params)
        index = mesh.axis_index(self.axis)
        mine = set(layout.layers_of(index))
        wanted = {k: dict(v) for k, v in params.items() if k in mine}
        for owner, name in layout.replicas_of(index):
            wanted.setdefault(owner, {})[name] = params[owner][name]
        local = self.master_params(wanted)
        scale = self.initial_loss_scale()
        if self.dp is None:
            return TrainState(local, self.optimizer.init(local), 0, scale, mesh=mesh, layout=layout)
        sharded = ShardedParamsLayout(self.dp, shard_layouts(local, self.dp, mesh.axis_size(self.dp.axis)))
        held, shards = init_shards(local, sharded, mesh.axis_index(self.dp.axis))
        layout = dataclasses.replace(layout, sharded=sharded)
        return TrainState(held, self.optimizer.init(shards), 0, scale, mesh=mesh, layout=layout)

    def _layout_of(self, state: TrainState) -> PipelineLayout:
        if not isinstance(state.layout, PipelineLayout) or state.layout.axis != self.axis:
            raise ValueError(f"this TrainState was not made by this pipeline step (axis={self.axis!r}); use step.init")
        return state.layout

    def full_params(self, state: TrainState) -> Params:
        """Every rank gets every stage's parameters (a broadcast from each stage's rank)."""
        layout = self._layout_of(state)
        mesh: Mesh = state.mesh
        local = state.params if layout.sharded is None else ShardedParams(layout.sharded, state.params, mesh).gather()
        full: Params = {}
        device = device_of(local)  # a rank holding no parameter at all receives on the CPU
        for s, layers in enumerate(layout.stages):
            root = layout.schedule.placement[s]
            for layer in layers:
                full[layer] = {}
                for name, (shape, dtype) in layout.shapes.get(layer, {}).items():
                    mine = local.get(layer, {}).get(name)
                    x = mine if mine is not None else torch.zeros(shape, dtype=dtype, device=device)
                    full[layer][name] = broadcast(x, self.axis, root=root, mesh=mesh)
        return {layer: full.get(layer, {}) for layer in layout.shapes}

    # -- running -----------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        layout = self._layout_of(state)
        mesh: Mesh = state.mesh
        index = mesh.axis_index(self.axis)
        store = None if layout.sharded is None else ShardedParams(layout.sharded, state.params, mesh)
        replicas = 1 if store is None else store.size
        if store is not None:
            batch = split_over(
                split_batch(batch), store.size, store.index, f"shard_params over axis {store.axis!r} of size {store.size}"
            )
        scale = self.loss_scale_value(state)
        prec = self.precision
        compute = None if prec is None else (lambda layer: prec.for_layer(layer).compute)
        if store is None:
            params_for_compute = state.params if prec is None else prec.compute_params(state.params)
        else:
            params_for_compute = store.gather(compute)
        master = state.params if store is None else store.shards()

        def finalize(grads: Any) -> Any:
            if store is None:
                # A weight no forward of this rank reached gets zeros (made only for those).
                full = {
                    layer: {k: _grad_or_zeros(grads.get(layer, {}), k, t) for k, t in tensors.items()}
                    for layer, tensors in state.params.items()
                }
                # Without a precision policy the gradients are already in the master dtype, unscaled.
                return full if prec is None and scale == 1.0 else unscale_like(full, master, scale)
            return unscale_like(store.reduce(grads, None if prec is None else prec.policy.reduce), master, scale)

        micro = split_microbatches(batch, self.microbatches)
        runtime = PipelineRuntime(
            chain=self.chain,
            loss_fn=self.loss_fn,
            mesh=mesh,
            axis=self.axis,
            stages=layout.stages,
            placement=layout.schedule.placement,
            params=params_for_compute,
            microbatches=micro,
            poison=self.poison,
            record=self.trace,
            loss_scale=scale / replicas,
            finalize_grads=finalize,
            metric_axes=(self.axis,) if store is None else (self.axis, store.axis),
            exchange=self.metric_exchange(),
            tied=layout.tied,
            replica_layers=frozenset(o for o, _ in layout.replicas_of(index)),
            layouts=self.boundary_layouts(layout, micro[0][0]),
        )
        result: list[tuple[Any, Any, Any]] = []

        def update(_action: object) -> None:
            # Otherwise the metrics' all-reduce completes while this rank updates.
            if self.update_needs_sums:
                runtime.wait_metrics()
            summed = runtime.summed
            new_master, opt_state, loss_scale = self.finish(state, runtime.final_grads, master, summed.norm, summed.finite)
            held = new_master if store is None else store.rebuild(new_master)
            result.append((held, opt_state, loss_scale))

        runtime.run(layout.actions_of(index), update)
        runtime.wait_metrics()
        params, opt_state, loss_scale = result[0]
        summed = runtime.summed
        metrics = self.report(summed.mean_loss(self.microbatches * replicas), summed.norm)
        if prec is not None:
            metrics["loss_scale"] = host_scalar(scale)
            metrics["skipped"] = host_scalar(not summed.finite)
        if self.trace:
            metrics["trace"] = runtime.events  # type: ignore[assignment]
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, loss_scale=loss_scale), metrics

    def boundary_layouts(self, layout: PipelineLayout, inputs: Any) -> tuple[tuple[Layout, ...], ...] | None:
        """The (shape, dtype) of every tensor each stage passes on, for micro-batch ``inputs``.

        Predicted once per input layout by running the chain on fake tensors (no data, no
        arithmetic), so every rank knows what it will receive and transfers go without counts
        or headers. Every rank predicts the same; if the chain cannot run on fake tensors, all
        fall back to announced transfers together.
        """
        key = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in optree.tree_leaves(inputs))
        if key not in layout.boundary_cache:
            layout.boundary_cache[key] = self._predict_boundaries(layout, inputs)
        cached: tuple[tuple[Layout, ...], ...] | None = layout.boundary_cache[key]
        return cached

    def _predict_boundaries(self, layout: PipelineLayout, inputs: Any) -> tuple[tuple[Layout, ...], ...] | None:
        prec = self.precision

        def compute_dtype(layer: str, dtype: torch.dtype) -> torch.dtype:
            return dtype if prec is None else prec.for_layer(layer).compute

        try:
            with fake_tensors() as fake:
                params = {
                    layer: {k: torch.empty(shape, dtype=compute_dtype(layer, dtype)) for k, (shape, dtype) in t.items()}
                    for layer, t in layout.shapes.items()
                }
                x = optree.tree_map(fake, inputs)
                found = []
                for layers in layout.stages[:-1]:
                    for name in layers:
                        x = self.chain[name](self.chain.layer_params(params, name), x)
                    found.append(tuple((t.shape, t.dtype) for t in optree.tree_leaves(x)))
                return tuple(found)
        except Exception:  # data-dependent code cannot run on fake tensors: announce instead
            return None

    # -- inspection ----------------------------------------------------------------------------------
    def plan(self, mesh: Mesh | None = None, params: Params | None = None, batch: Any = None) -> Plan:
        """Per-rank actions: the schedule's computes with the sends and receives placement implies.

        Ranks along other mesh axes repeat the plan of their pipeline position.
        """
        mesh = self._check_mesh(mesh)
        layout = self.layout(mesh, params)
        per_rank = tuple(layout.actions_of(mesh.coords_of(r)[self.axis]) for r in range(mesh.size))
        memory: dict[str, tuple[int, ...]] = {}
        if params is not None:
            meta = map_params(lambda t: torch.empty_like(t, device="meta"), params)
            held = [
                {k: v for k, v in meta.items() if k in set(layout.layers_of(mesh.coords_of(r)[self.axis]))}
                for r in range(mesh.size)
            ]
            memory = {
                "params": tuple(tree_nbytes(h) for h in held),
                "opt_state": tuple(tree_nbytes(self.optimizer.init(h)) for h in held),
            }
            if batch is not None:
                memory["kept_for_backward"] = self._kept_per_rank(mesh, layout, params, batch)
        return Plan(mesh, per_rank, memory)

    def _kept_per_rank(self, mesh: Mesh, layout: PipelineLayout, params: Params, batch: Any) -> tuple[int, ...]:
        """Activation bytes kept for backward per rank: the schedule's peak number of micro-batch
        activations on the rank (from the simulator) times the largest per-micro-batch figure of
        its stages (predicted on fake tensors). Exact with one stage per rank, an upper bound with more."""
        pair = split_batch(batch)
        if self.dp is not None:
            n = mesh.axis_size(self.dp.axis)
            pair = split_over(pair, n, 0, f"shard_params over axis {self.dp.axis!r} of size {n}")
        micro = split_microbatches(pair, self.microbatches)[0]
        per_layer = predict_kept_for_backward(self.chain, self.compute_view(params), micro[0])
        per_stage = [sum(per_layer[n] for n in layers) for layers in layout.stages]
        peaks = simulate(layout.schedule).peak_activations
        out = []
        for r in range(mesh.size):
            index = mesh.coords_of(r)[self.axis]
            mine = [per_stage[s] for s, place in enumerate(layout.schedule.placement) if place == index]
            out.append(peaks[index] * max(mine, default=0))
        return tuple(out)


def _grad_or_zeros(grads: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    found = grads.get(name)
    return torch.zeros_like(like) if found is None else found
