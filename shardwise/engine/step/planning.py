"""A step's Plan: the lowering of its stack for every rank, what each action moves, and memory.

``Step.plan`` calls :func:`plan_of`. The actions come from ``engine/plan/lower.py``
(the same ones the step runs); with the parameters each communicating action
also gets its wire (dtype and bytes per tensor), and the Plan counts the bytes
each rank holds, from the same layouts ``Step.init`` builds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...collectives.mesh import Mesh
from ..layout.devices import device_of
from ..layout.precision import compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state import Params, check_params, tree_nbytes
from ..layout.state_layout import Placement, StateLayout, local_params, meta_shards, unit_names
from ..plan.accounting import predict_kept_parts
from ..plan.actions import FREE, GATHER, GRAD_COMPUTES, REDUCE_SCATTER, WAIT_REDUCE, Action, Plan
from ..plan.batches import split_batch, split_over
from ..plan.lower import (
    Inside,
    annotate,
    insert_inside,
    microbatch_count,
    placement_of,
    rank_actions,
    reduce_sizes,
    wire_of,
)

if TYPE_CHECKING:
    from .step import Step


def plan_of(step: Step, mesh: Mesh, params: Params | None, batch: Any) -> Plan:
    """Per-rank actions of one step: the lowering of the whole transform stack.

    With ``params`` (real or ``device="meta"`` tensors), every communicating action
    also says what it moves (dtype and bytes per tensor), and the plan counts the
    bytes each rank holds; with a ``batch`` too, the pipeline's transfers are sized
    and the activation bytes kept for backward are predicted (on fake tensors: the
    figures ``sw.saved_bytes`` measures).
    """
    mesh = step._check_mesh(mesh) or Mesh(world=1)
    if params is not None:
        check_params(step.chain, params)
    placement, schedule = placement_of(step, mesh, params)
    layouts = {r: step.layout(mesh, params, rank=r) for r in range(mesh.size)} if params is not None else {}
    per_rank: list[tuple[Action, ...]] = []
    inside = _inside_computes(step, mesh, params, batch, placement, layouts)
    device = planned_device(params, batch)
    for r in range(mesh.size):
        index = placement.index_of(mesh, r)
        if params is None:
            actions = rank_actions(
                step, placement, schedule, index, _units_without_params(step, placement, index), device
            )
        else:
            layout = layouts[r]
            actions = rank_actions(
                step, placement, schedule, index, unit_names(layout.sharding), device,
                reduce_sizes(step, layout.sharding),
            )
            boundaries = None
            if batch is not None and step.pipeline_spec is not None:
                boundaries = step.boundaries(layout, one_microbatch(step, mesh, batch)[0], mesh)
            master = step._master_meta(local_params(step.tp_view(params, mesh, r), placement, index))
            update_tree = master if layout.sharding is None else meta_shards(layout.sharding)
            actions = annotate(
                actions, step, placement, layout.sharding, update_tree, boundaries,
                layout.metric_dtype,
            )
            if inside is not None:
                actions = insert_inside(actions, inside, step.split_spec.axis)
        per_rank.append(actions)
    memory = {} if params is None else _memory(step, mesh, params, batch, placement, layouts, per_rank)
    notes: dict[str, tuple[str, ...]] = {}
    # In the order the rewrites apply (engine/stack/compose.py), whatever order they were applied in.
    for spec in sorted(step.transforms, key=lambda spec: getattr(spec, "rewrite_order", -1)):
        for layer, note in getattr(spec, "layer_notes", lambda chain: {})(step.base_chain).items():
            notes[layer] = (*notes.get(layer, ()), note)
            if spec is step.split_spec and inside is None:  # not silently absent: say what is missing
                notes[layer] += ("its collectives inside the layer are not listed: they are predicted from a "
                                 "batch, step.plan(mesh, params, batch)",)
    return Plan(mesh, tuple(per_rank), memory, {n: notes[n] for n in step.chain.names if n in notes})


def planned_device(params: Params | None, batch: Any) -> torch.device:
    """Where the planned ranks compute: their parameters' device, or for meta parameters (a model
    not yet made) the batch's, else the CPU. The run reads its parameters' device: a plan of a
    meta model for a GPU run wants a batch on the GPU."""
    device = device_of(params, default="cpu")
    return device_of(batch, default="cpu") if device.type == "meta" else device


def _inside_computes(
    step: Step, mesh: Mesh, params: Params | None, batch: Any, placement: Placement, layouts: dict[int, StateLayout]
) -> Inside | None:
    """The collectives each compute issues inside its layers (tensor parallel), predicted on fake
    tensors from a micro-batch: None without tensor parallel, parameters or a batch."""
    tp = step.split_spec
    if tp is None or params is None or batch is None:
        return None
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for spec in layouts[0].leaves.values():
        dtype = compute_dtype(step.precision, spec.layer, spec.dtype)
        shapes.setdefault(spec.layer, {})[spec.name] = (torch.Size(spec.local_shape), dtype)
    found = tp.inner_collectives(step.chain, placement, shapes, step.loss_fn, one_microbatch(step, mesh, batch), mesh)
    return {key: [(op, label, wire_of(shape, dtype)) for op, label, dtype, shape in issued] for key, issued in found.items()}


def _units_without_params(step: Step, placement: Placement, index: int) -> list[str] | None:
    if step.sharding_spec is None:
        return None
    held = [n for n in placement.layers_of(index) if step.chain.owned_param_names(n)]
    return held + [o for o, _ in placement.replicas_of(index) if o not in held]

def one_microbatch(step: Step, mesh: Mesh, batch: Any) -> tuple[Any, Any]:
    pair = split_batch(batch)
    zero = step.sharding_spec
    whole = batch_multiple(step, mesh)
    if zero is not None:
        n = mesh.axis_size(zero.axis)
        pair = split_over(pair, n, 0, f"shard_params over axis {zero.axis!r} of size {n}", whole)
    k = microbatch_count(step)
    return split_over(pair, k, 0, f"{k} micro-batches", whole) if k > 1 else pair


def batch_multiple(step: Step, mesh: Mesh | None) -> tuple[int, str]:
    """What the global batch size must be a multiple of: it is cut per data-parallel rank, then
    per micro-batch; and the words that say so."""
    k = microbatch_count(step)
    zero = step.sharding_spec
    if zero is None or mesh is None or k == 1:
        return (k if zero is None or mesh is None else mesh.axis_size(zero.axis)), ""
    ranks = mesh.axis_size(zero.axis)
    return ranks * k, f" ({ranks} ranks of axis {zero.axis!r} x {k} micro-batches)"

def _memory(
    step: Step, mesh: Mesh, params: Params, batch: Any, placement: Placement,
    layouts: dict[int, StateLayout], per_rank: list[tuple[Action, ...]],
) -> dict[str, tuple[int, ...]]:
    figures: dict[str, list[int]] = {"params": [], "grads": [], "opt_state": []}
    zero = step.sharding_spec
    if zero is not None:
        figures["gathered_peak"] = []
    for r in range(mesh.size):
        layout = layouts[r]
        master = step._master_meta(local_params(step.tp_view(params, mesh, r), placement, placement.index_of(mesh, r)))
        sharding = layout.sharding
        shards = None if sharding is None else meta_shards(sharding)
        figures["params"].append(tree_nbytes(shards if sharding is not None and sharding.holds_shards else master))
        figures["grads"].append(tree_nbytes(shards if shards is not None else master))
        figures["opt_state"].append(tree_nbytes(step.optimizer.init(shards if shards is not None else master)))
        if "gathered_peak" in figures:
            assert sharding is not None
            figures["gathered_peak"].append(peak_gathered_units(per_rank[r], {
                u: lay.padded_numel * torch.empty((), dtype=compute_dtype(step.precision, u, lay.dtype)).element_size()
                for u, lay in sharding.units.items()
            }))
        if zero is not None:
            assert sharding is not None
            figures.setdefault("reduce_buffers", []).append(_reduce_buffers(step, sharding, per_rank[r]))
            figures.setdefault("comm_buffers", []).append(_comm_buffers(sharding))
    memory = {k: tuple(v) for k, v in figures.items()}
    if batch is not None:
        memory["kept_for_backward"] = _kept_per_rank(step, mesh, params, batch, placement, layouts)
    # Every figure is live at the backward's worst moment: the state at rest, the gradients, the
    # units gathered, the reduce buffers and what the forward kept (an upper bound, tight for
    # ZeRO-3: benchmarks/memory.py measures it within a few percent).
    memory["peak"] = tuple(sum(per_rank) for per_rank in zip(*memory.values(), strict=True))
    return memory


def _reduce_buffers(step: Step, sharding: FlatSharding, actions: Sequence[Action]) -> int:
    """Peak bytes of full gradients on their way to a reduce-scatter, walking ``actions``: while a
    backward runs, the next bucket's gradients and the copies in flight; when a bucket is issued,
    its gradients (twice when it joins several units: they and the copy that
    concatenates them; one unit's move into its flat buffer one by one), the copies still in
    flight (how many: lower._waits_for_reductions), and after the last compute the gradients of
    every bucket still to be issued (the deferred ones of tied weights, complete and waiting)."""
    sizes = {u: lay.padded_numel * torch.empty((), dtype=_reduce_dtype(step, u, lay.dtype)).element_size()
             for u, lay in sharding.units.items()}
    last_compute = max((i for i, a in enumerate(actions) if a.kind in GRAD_COMPUTES), default=-1)
    issued = [(i, a.units or (a.require("layer"),)) for i, a in enumerate(actions) if a.kind == REDUCE_SCATTER]
    bucket_bytes = [sum(sizes[u] for u in b) for _, b in issued]
    pending: dict[str, int] = {}
    peak = made = 0  # made: how many buckets were issued so far
    for i, action in enumerate(actions):
        if action.kind in GRAD_COMPUTES and made < len(issued):  # the next bucket's gradients grow
            peak = max(peak, bucket_bytes[made] + sum(pending.values()))
        elif action.kind == WAIT_REDUCE:
            pending.pop(action.require("layer"), None)
        elif action.kind == REDUCE_SCATTER:
            units = action.units or (action.require("layer"),)
            size = sum(sizes[u] for u in units)
            waiting = sum(sum(sizes[u] for u in b) for j, b in issued if j > i) if i > last_compute else 0
            peak = max(peak, size * (2 if len(units) > 1 else 1) + sum(pending.values()) + waiting)
            pending[units[0]] = size
            made += 1
    return peak


def _comm_buffers(sharding: FlatSharding) -> int:
    """About one unit for what a collective holds of its own while it runs. Until issue 25 that
    was our async collectives' snapshot of each reduce-scatter's input (a whole unit); that copy
    is gone, but the measured peak per rank stayed above the other figures by 3, 11 and 17 MiB
    at worlds 2, 4 and 8 (12 x 16 MiB units, gloo: its per-peer buffers grow with the world),
    so one unit stays counted (the Plan within 3% of the measured peak at each of those worlds)."""
    return max((lay.padded_nbytes for lay in sharding.units.values()), default=0)


def _reduce_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).reduce

def _gather_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).compute

def _kept_per_rank(
    step: Step, mesh: Mesh, params: Params, batch: Any, placement: Placement, layouts: dict[int, StateLayout]
) -> tuple[int, ...]:
    inputs = one_microbatch(step, mesh, batch)[0]
    with step.tp_predicting(mesh):
        view = step.compute_view(step.tp_view(params, mesh, 0))
        parts = predict_kept_parts(step.chain, view, inputs)
    pipe = step.pipeline_spec
    if pipe is None:
        return (sum(parts.own.values()) + _batch_bytes(parts.batch, step.chain.names),) * mesh.size
    per_stage = [sum(parts.own[n] for n in layers) for layers in placement.stages]
    # Micro-batches are views of one batch: what the stages keep of it is kept once.
    of_batch = [_batch_bytes(parts.batch, layers) for layers in placement.stages]
    per_index = pipe.kept_per_index(layouts[0].schedule, per_stage, of_batch)
    return tuple(per_index[placement.index_of(mesh, r)] for r in range(mesh.size))


def _batch_bytes(of_batch: Mapping[str, Mapping[int, int]], layers: Sequence[str]) -> int:
    """Bytes of the batch's storages that ``layers`` keep, each storage once."""
    return sum({key: n for layer in layers for key, n in of_batch[layer].items()}.values())


def peak_gathered_units(actions: Sequence[Action], unit_bytes: Mapping[str, int]) -> int:
    """Largest total bytes of gathered (and in-flight) units at any point of ``actions``."""
    held: set[str] = set()
    peak = 0
    for action in actions:
        if action.kind == GATHER and action.layer is not None:
            held.add(action.layer)
        elif action.kind == FREE and action.layer is not None:
            held.discard(action.layer)
        peak = max(peak, sum(unit_bytes[u] for u in held))
    return peak
