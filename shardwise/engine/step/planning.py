"""A step's Plan: the lowering of its stack for every rank, what each action moves, and memory.

``Step.plan`` calls :func:`plan_of`. The actions come from ``engine/plan/lower.py``
(the same ones the step runs); with the parameters each communicating action
also gets its wire (dtype and bytes per tensor), and the Plan counts the bytes
each rank holds, from the same layouts ``Step.init`` builds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...collectives.mesh import Mesh
from ..layout.precision import compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state import Params, check_params, tree_nbytes
from ..layout.state_layout import Placement, StateLayout, local_params, meta_shards, unit_names
from ..plan.accounting import predict_kept_parts
from ..plan.actions import FREE, GATHER, Action, Plan
from ..plan.batches import split_batch, split_over
from ..plan.lower import (
    Inside,
    annotate,
    insert_inside,
    microbatch_count,
    placement_of,
    rank_actions,
    wire_of,
)
from ..stack.compose import rewrites_in_order

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
    mesh = step.check_mesh(mesh) or Mesh(world=1)
    if params is not None:
        check_params(step.chain, params)
    placement, schedule = placement_of(step, mesh, params)
    layouts = {r: step.layout(mesh, params, rank=r) for r in range(mesh.size)} if params is not None else {}
    per_rank: list[tuple[Action, ...]] = []
    inside = _inside_computes(step, mesh, params, batch, placement, layouts)
    split_axis = step.split.axis
    for r in range(mesh.size):
        index = placement.index_of(mesh, r)
        if params is None:
            actions = rank_actions(step, placement, schedule, index, _units_without_params(step, placement, index))
        else:
            layout = layouts[r]
            actions = rank_actions(step, placement, schedule, index, unit_names(layout.sharding))
            boundaries = None
            if batch is not None and step.pipeline_spec is not None:
                boundaries = step.boundaries(layout, one_microbatch(step, mesh, batch)[0], mesh)
            master = step.master_meta(local_params(step.local_view(params, mesh, r), placement, index))
            update_tree = master if layout.sharding is None else meta_shards(layout.sharding)
            actions = annotate(
                actions, step, placement, layout.sharding, update_tree, boundaries,
                layout.metric_dtype,
            )
            if inside is not None and split_axis is not None:  # inside is made only under a split
                actions = insert_inside(actions, inside, split_axis)
        per_rank.append(actions)
    memory = {} if params is None else _memory(step, mesh, params, batch, placement, layouts, per_rank)
    notes: dict[str, tuple[str, ...]] = {}
    # In the order the rewrites apply (engine/stack/compose.py), whatever order they were applied in.
    for spec in rewrites_in_order(step.transforms):
        for layer, note in spec.layer_notes(step.base_chain).items():
            notes[layer] = (*notes.get(layer, ()), note)
            if spec is step.split and inside is None:  # not silently absent: say what is missing
                notes[layer] += ("its collectives inside the layer are not listed: they are predicted from a "
                                 "batch, step.plan(mesh, params, batch)",)
    return Plan(mesh, tuple(per_rank), memory, {n: notes[n] for n in step.chain.names if n in notes})


def _inside_computes(
    step: Step, mesh: Mesh, params: Params | None, batch: Any, placement: Placement, layouts: dict[int, StateLayout]
) -> Inside | None:
    """The collectives each compute issues inside its layers (a split transform's), predicted on fake
    tensors from a micro-batch: None without a split, parameters or a batch."""
    split = step.split
    if split.axis is None or params is None or batch is None:
        return None
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for spec in layouts[0].leaves.values():
        dtype = compute_dtype(step.precision, spec.layer, spec.dtype)
        shapes.setdefault(spec.layer, {})[spec.name] = (torch.Size(spec.local_shape), dtype)
    found = split.inner_collectives(step.chain, placement, shapes, step.loss_fn, one_microbatch(step, mesh, batch), mesh)
    return {key: [(op, label, wire_of(shape, dtype)) for op, label, dtype, shape in issued] for key, issued in found.items()}


def _units_without_params(step: Step, placement: Placement, index: int) -> list[str] | None:
    if step.sharding_spec is None:
        return None
    held = [n for n in placement.layers_of(index) if step.chain.owned_param_names(n)]
    return held + [o for o, _ in placement.replicas_of(index) if o not in held]

def batch_cuts(step: Step, mesh: Mesh | None) -> list[tuple[str, int, str]]:
    """The axes the global batch is cut over, with their sizes and the words naming the cut:
    shard_params', then the split's (SplitRole.batch_axes; expert_parallel's), each rank taking its share."""
    if mesh is None:
        return []
    zero, split = step.sharding_spec, step.split
    named = ([] if zero is None else [(zero.axis, "shard_params")]) + [(a, split.name) for a in split.batch_axes(mesh)]
    return [(a, mesh.axis_size(a), f"{who} over axis {a!r} of size {mesh.axis_size(a)}") for a, who in named]


def one_microbatch(step: Step, mesh: Mesh, batch: Any) -> tuple[Any, Any]:
    pair = split_batch(batch)
    whole = batch_multiple(step, mesh)
    for _axis, n, what in batch_cuts(step, mesh):
        pair = split_over(pair, n, 0, what, whole)
    k = microbatch_count(step)
    return split_over(pair, k, 0, f"{k} micro-batches", whole) if k > 1 else pair


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
        master = step.master_meta(local_params(step.local_view(params, mesh, r), placement, placement.index_of(mesh, r)))
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
            figures.setdefault("reduce_buffers", []).append(_reduce_buffers(step, sharding))
            figures.setdefault("comm_buffers", []).append(_comm_buffers(sharding))
    memory = {k: tuple(v) for k, v in figures.items()}
    if batch is not None:
        memory["kept_for_backward"] = _kept_per_rank(step, mesh, params, batch, placement, layouts)
    # Every figure is live at the backward's worst moment: the state at rest, the gradients, the
    # units gathered, the reduce buffers and what the forward kept (an upper bound, tight for
    # ZeRO-3: benchmarks/memory.py measures it within a few percent).
    memory["peak"] = tuple(sum(per_rank) for per_rank in zip(*memory.values(), strict=True))
    return memory


def _reduce_buffers(step: Step, sharding: FlatSharding) -> int:
    """Bytes of full unit gradients alive at once on their way to a reduce-scatter: at stages 2
    and 3 one unit's being made while the previous one's is in flight (one in flight, see
    lower._waits_for_reductions); at stage 1 every unit's, and the flat copy of each, all in
    flight together at the end of the step."""
    sizes = [lay.padded_numel * torch.empty((), dtype=_reduce_dtype(step, u, lay.dtype)).element_size()
             for u, lay in sharding.units.items()]
    if not sizes:
        return 0
    return 2 * sum(sizes) if sharding.stage == 1 else 2 * max(sizes)


def _comm_buffers(sharding: FlatSharding) -> int:
    """A collective's own staging copy of one unit: on gloo an all-gather or a reduce-scatter of
    a unit holds about one more unit while it runs (measured: the peak per rank of a ZeRO-3 run
    was one unit above the other figures, at 4 and 16 MiB units, worlds 2 and 4)."""
    return max((lay.padded_nbytes for lay in sharding.units.values()), default=0)


def _reduce_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).reduce

def _gather_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).compute

def _kept_per_rank(
    step: Step, mesh: Mesh, params: Params, batch: Any, placement: Placement, layouts: dict[int, StateLayout]
) -> tuple[int, ...]:
    inputs = one_microbatch(step, mesh, batch)[0]
    with step.predicting(mesh):
        view = step.compute_view(step.local_view(params, mesh, 0))
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
