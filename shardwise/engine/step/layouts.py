"""How a step lays out the parameters on a mesh: the checks of the mesh, the StateLayout of a rank
(placement, per-leaf shard specs, the rank's flat units, the optimizer state's specs) and the
pipeline's stage boundaries predicted on fake tensors."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives.mesh import Mesh
from ..checkpoint.cut import split_opt_state
from ..layout.precision import compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state import Params, check_params
from ..layout.state_layout import ModelTag, StateLayout, leaf_specs, local_params, meta_shards
from ..optim.meta_like import meta_like
from ..plan.lower import placement_of, zero_holds_shards
from ..plan.predict import FirstOutput, first_output, predict_boundaries, predict_output
from ..run.rng import untouched
from .shared_predictions import prediction_key, shared

if TYPE_CHECKING:
    from .step import Step


def check_mesh(transforms: tuple[Any, ...], mesh: Mesh | None) -> Mesh | None:
    """``mesh``, once it has the axis of every spec that goes over one (refused, naming it, if not)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r}: a sw.Mesh, e.g. sw.Mesh(dp=2, pp=2) (not its text form or a dict), or None")
    for spec in transforms:
        # REWRITE specs go over no axis; HSDP's shard_params over a second one, ``replicate``
        for field in ("axis", "replicate"):
            axis = getattr(spec, field, None)
            if axis is None:
                continue
            if mesh is None:
                raise ValueError(f"{spec.name}({field}={axis!r}) needs the mesh: call step.init(params, mesh)")
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{spec.name}({field}={axis!r}): {mesh!r} has no axis {axis!r}; use one of {mesh.axis_names} "
                    "or build the mesh with that axis"
                )
    return mesh


def refuse_unused_axes(transforms: tuple[Any, ...], mesh: Mesh | None) -> None:
    """Refuse, at ``init`` and a checkpoint's load, a mesh axis of more than one rank that no transform goes over:
    the ranks along it would each run the whole step on their own batch and train their own model (a
    tensor-parallel step on ``Mesh(dp=2, tp=2)`` with ``shard_params`` over ``dp`` forgotten), and nothing compares
    them (each rank's loss is its own). ``step.plan`` of such a mesh (what a layout would do) is left alone, and so is
    a step no transform distributes (the one-device step, remat or mixed_precision alone, on each rank of a mesh:
    ``sw.testing.assert_equivalent(step, step, mesh, ...)`` checks a step against itself so, each rank on the
    whole batch)."""
    if mesh is None or not any(getattr(spec, "axis", None) for spec in transforms):
        return
    used = {getattr(spec, field, None) for spec in transforms for field in ("axis", "replicate")}
    unused = [(axis, size) for axis, size in mesh.shape.items() if size > 1 and axis not in used]
    if unused:
        axis, size = unused[0]
        rest = {a: n for a, n in mesh.shape.items() if a != axis}
        smaller = ", ".join(f"{a}={n}" for a, n in rest.items()) if rest else "world=1"
        raise ValueError(
            f"{mesh!r} has axis {axis!r} of {size} ranks, which no transform of this step goes over "
            f"({' + '.join(s.name for s in transforms) or 'no transform'}): each rank along it would run the whole "
            "step on its own batch and train its own model, with no error. Data parallel over it is "
            f"sw.shard_params(step, {axis!r}, stage) (stage 1 for plain replicas, as DDP), applied with the other "
            f"transforms; or build the mesh without it (sw.Mesh({smaller}))"
        )


def build_layout(step: Step, mesh: Mesh | None, params: Params, rank: int | None) -> StateLayout:
    """See Step.layout."""
    mesh = check_mesh(step.transforms, mesh)
    check_params(step.chain, params)
    placement, _ = placement_of(step, mesh, params)
    if rank is None and mesh is not None and (placement.axis is not None or step.split.axes):
        try:
            rank = mesh.rank
        except RuntimeError:  # not inside a launched program: describe rank 0
            rank = 0
    index = placement.index_of(mesh, rank) if rank is not None else 0
    return layouts_by_index(step, mesh, params, rank)[index]


def layouts_by_index(step: Step, mesh: Mesh | None, params: Params, rank: int | None) -> dict[int, StateLayout]:
    """See Step.layouts_by_index: every pipeline index's layout, of the ranks with ``rank``'s split index.
    They share every spec (each index's state is in every layout) and differ only in their flat units,
    so the specs are made once (a Plan of 512 ranks asks for 64 layouts, not 512)."""
    mesh = check_mesh(step.transforms, mesh)
    check_params(step.chain, params)
    placement, schedule = placement_of(step, mesh, params)
    meta = step.master_meta(step.local_view(params, mesh, rank))
    splits = step.split.tensor_splits(step.base_chain, mesh)
    zero = step.sharding_spec
    at_rest = zero is not None and zero.stage != 3 and zero_holds_shards(step)
    if zero is not None and zero.stage != 3:
        check_stage12_options(zero, at_rest)
    shardings: dict[int, FlatSharding | None] = {}
    for i in sorted(set(placement.stage_rank)):
        local = local_params(meta, placement, i)
        shardings[i] = (
            None if zero is None or mesh is None
            else FlatSharding.of(zero.axis, zero.stage, local, mesh.axis_size(zero.axis), zero.replicate, at_rest)
        )
    leaves = leaf_specs(meta, placement, shardings, splits)
    opt_leaves: dict[str, dict[tuple[str, str], Any]] = {}
    opt_scalars: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in sorted(set(placement.stage_rank)):  # every pipeline index's state, like ``leaves``
        mirrors, scalars = _opt_specs(step, leaves, local_params(meta, placement, i), shardings[i])
        for path, specs in mirrors.items():
            opt_leaves.setdefault(path, {}).update(specs)
        opt_scalars.update(scalars)
    model = ModelTag(step.base_chain)
    return {
        i: StateLayout(
            placement, shardings[i], leaves, tuple(params), step.stack_key, schedule, opt_leaves=opt_leaves,
            opt_scalars=opt_scalars, frozen_dtypes=frozen_dtypes(step), model=model,
        )
        for i in shardings
    }


def check_stage12_options(zero: Any, at_rest: bool) -> None:
    """The options of ZeRO-1/2 that only one of its layouts gives a meaning, checked against the layout the
    whole step has (``at_rest``: ``plan.lower.zero_holds_shards``, decided by the precision policy, which
    may be applied after ``shard_params``); one that would do nothing is refused, naming the fix.

    Whole parameters (no narrowing policy): the step gathers no unit, so there is nothing to keep
    (``reshard_after_forward=False``) or prefetch; True states what happens. Shards at rest (a policy that
    narrows): every unit is gathered before its first forward and kept to its last backward (so
    ``reshard_after_forward=True`` would not happen: that is stage 3), ``prefetch`` says how far ahead,
    and no all-gather of the updated parameters ends the step for ``overlap_gather``, ``gather_into_params``
    or ``update_in_buckets`` to shape (False, which states what happens, is accepted)."""
    stage = zero.stage
    if not at_rest:
        for name, value in (("reshard_after_forward", zero.reshard_after_forward), ("prefetch", zero.prefetch)):
            if value is not None and value is not True:
                raise ValueError(
                    f"shard_params(stage={stage}, {name}={value!r}): stage {stage} holds whole parameters here "
                    "(no precision policy computes in a narrower dtype than it stores), so the step gathers none "
                    "and there is nothing to keep or prefetch; drop the option or use stage=3"
                )
        return
    narrowed = ("under a precision policy that computes in a narrower dtype than it stores: this stage then "
                "holds the master shards at rest and gathers every unit in the compute dtype before its first "
                "forward")
    if zero.reshard_after_forward is True:
        raise ValueError(
            f"shard_params(stage={stage}, reshard_after_forward=True) {narrowed}, keeping it to its last backward; "
            "to free each unit after its forward and gather it again for its backward, use stage=3"
        )
    asked = [name for name in ("overlap_gather", "gather_into_params", "update_in_buckets")
             if getattr(zero, name, None) is True]
    if asked:
        listing = ", ".join(f"{name}=True" for name in asked)
        raise ValueError(
            f"shard_params(stage={stage}, {listing}) {narrowed}, so no all-gather of the updated parameters ends "
            f"the step for the option to shape; drop {listing}"
        )


def frozen_dtypes(step: Step) -> frozenset[torch.dtype]:
    """The floating dtypes of the whole model's buffers (where functionalize puts frozen parameters):
    every rank reads the same, whichever layers it holds."""
    return frozenset(
        t.dtype for layer in step.base_chain.layers for t in layer.buffers.values()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _opt_specs(step: Step, leaves: dict[tuple[str, str], Any], master: Params, sharding: FlatSharding | None) -> tuple[
        dict[str, dict[tuple[str, str], Any]], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The optimizer state's specs (see StateLayout.opt_leaves), from its state on meta tensors."""
    update = master if sharding is None else meta_shards(sharding)
    with meta_like():  # a user's optimizer's zeros_like, without torch's Python reference (meta_like.py)
        mirrors, scalars = split_opt_state(step.optimizer.init(update), update)
    opt_leaves: dict[str, dict[tuple[str, str], Any]] = {}
    for path, mirror in mirrors.items():
        opt_leaves[path] = {}
        for key, spec in leaves.items():
            held = mirror.get(key[0]) if sharding is not None else mirror.get(key[0], {}).get(key[1])
            if isinstance(held, torch.Tensor):
                opt_leaves[path][key] = dataclasses.replace(spec, dtype=held.dtype)
    return opt_leaves, {path: (tuple(t.shape), t.dtype) for path, t in scalars.items()}


def output_shapes(step: Step, layout: StateLayout, inputs: Any) -> list[torch.Size | None] | None:
    """The shape of each leaf of the chain's output on micro-batch ``inputs`` (plan/lower.py:
    predict_output), with this layout's parameters and compute dtypes; None where the chain cannot
    run on fake tensors."""
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for spec in layout.leaves.values():
        shapes.setdefault(spec.layer, {})[spec.name] = (torch.Size(spec.local_shape), spec.dtype)
    prec = step.precision
    with untouched():  # a run on fake tensors (see step.py's _predicting)
        return predict_output(step.chain, shapes, lambda layer, dtype: compute_dtype(prec, layer, dtype), inputs)


def stage_boundaries(step: Step, layout: StateLayout, inputs: Any, mesh: Mesh | None) -> Any:
    """See Step.boundaries.

    Predicted on fake tensors once per input layout, which follows functionalize's example where a model leaves
    a value out on some inputs (an attention mask, None without a padded row). So, under
    ``pipeline(follow_batches=True)``, the first layer also runs on ``inputs`` itself (plan/predict.py:
    first_output), each call where its code reads the batch: where the batch leaves out other values than the
    example did, the boundaries are predicted from that output, once per such structure. Every rank of a
    pipeline holds the same micro-batches, so all predict the same; the executor still checks every stage output
    against it."""
    leaves = optree.tree_leaves(inputs)
    layouts = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves)
    key = ("boundaries", layouts)
    # Under a split the first layer alone is not run: its modules note what they ran for the loss (tensor
    # parallel's split logits), which a part of a forward would leave behind. Those follow the example.
    # Only where the pipeline asks for it (follow_batches): the first layer's run costs each step.
    alone = not step.split.parts and bool(getattr(step.pipeline_spec, "follow_batches", False))
    known = layout.cache.get(key)
    if known is not None and not alone:
        return known[0]  # the usual call, once per micro-batch and step: a lookup
    prec = step.precision
    shapes = _local_shapes(layout)

    def dtype_of(layer: str, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(prec, layer, dtype)

    if known is None:
        sizes = {a: mesh.axis_size(a) for a in mesh.axis_names} if mesh is not None and step.split.axes else None
        with step.predicting(mesh):
            predicted = shared(step.chain, prediction_key(layout.placement.stages, shapes, dtype_of, inputs, sizes),
                               lambda: predict_boundaries(step.chain, layout.placement, shapes, dtype_of, inputs))
            like_example = first_output(step.chain, shapes, dtype_of, inputs, False).output if alone else None
            on_batch = first_output(step.chain, shapes, dtype_of, inputs, True) if alone else FirstOutput(None, False)
        # The boundaries and first output as the example had them, and the batch's first output where
        # making it read no batch (else it is made again for every batch).
        known = layout.cache[key] = (predicted, like_example, None if on_batch.reads_batch else on_batch)
        first = on_batch.output
    elif known[2] is None:
        with step.predicting(mesh):
            first = first_output(step.chain, shapes, dtype_of, inputs, True).output
    else:
        first = known[2].output
    predicted, like_example = known[0], known[1]
    if predicted is None or like_example is None:
        return predicted
    if first is None or not first.differs_only_in_left_out(like_example):
        return predicted
    structure = ("boundaries", layouts, first)
    if structure not in layout.cache:
        with step.predicting(mesh):
            layout.cache[structure] = predict_boundaries(
                step.chain, layout.placement, shapes, dtype_of, inputs, start=first
            )
    return layout.cache[structure]


def _local_shapes(layout: StateLayout) -> dict[str, dict[str, tuple[torch.Size, torch.dtype]]]:
    """Each layer's parameters as this rank computes with them (local shape, dtype), kept in the layout."""
    found = layout.cache.get("local shapes")
    if found is None:
        found = {}
        for spec in layout.leaves.values():
            found.setdefault(spec.layer, {})[spec.name] = (torch.Size(spec.local_shape), spec.dtype)
        layout.cache["local shapes"] = found
    return found
