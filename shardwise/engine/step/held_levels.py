"""What a rank holds at each action of its step beyond its state at rest, the levels every stack shares.

The Plan's ``held_in_step`` is the most a rank's levels hold together at one action
(``planning._class_memory``). Under ``shard_params`` the gradients, gathered units and collectives'
buffers have levels of their own (``planning.py``); these are the ones every stack has:

* the optimizer's update (:func:`update_levels`): an out-of-place update's new parameters and
  state beside the old ones, and its temporaries;
* the compute copies a precision policy casts once per step and holds to ``finish_grads``
  (:func:`compute_copy_bytes`), under ZeRO-1/2 each to its reduce-scatter
  (:func:`copies_to_reductions`), under ZeRO-3 per gather (:func:`shard_copy_levels`);
* without ``shard_params``, the gradients (:func:`unsharded_levels`): the backward's, in the compute
  dtype, and the optimizer's, in the master dtype, where the loss scale or a cast makes new ones.

Each was measured as a per-action VmHWM trace (one device, pipeline, tensor parallel, ZeRO-1 and
ZeRO-3, with and without ``mixed_precision``; 16 MiB MLP, world 2, glibc's thresholds low).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch

from ..layout.precision import DynamicLossScale, NoLossScale, compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state_layout import Placement
from ..model import reuse
from ..optim.meta_like import meta_like
from ..plan.actions import FINISH_GRADS, GATHER, GRAD_COMPUTES, REDUCE_SCATTER, UPDATE, WAIT_GATHER, Action
from ..plan.update_memory import predict_update_held
from ..run.wide_grads import summed_in
from ..torch_api import data_dependent_errors

if TYPE_CHECKING:
    from .step import Step

__all__ = ["compute_copy_bytes", "copies_to_finish_grads", "copies_to_reductions", "shard_copy_levels",
           "unsharded_levels", "update_levels"]


def update_levels(
    step: Step, tree: Mapping[str, Any], actions: Sequence[Action], device: torch.device,
    guessed: set[str] | None = None, runs: Mapping[str, Any] | None = None,
) -> list[int]:
    """At each action, what the optimizer's update allocates: at an update action, the whole update's
    own peak, or, updated bucket by bucket (``update_in_buckets``), that bucket's, beside what the
    buckets updated before it keep; after it, what the updates keep, to the step's end.

    ``tree``: what the update runs on (ZeRO's flat shards per unit, else the rank's master parameters
    by layer). An out-of-place update keeps its new parameters and state (nothing, in place): they
    are the new TrainState, beside the old one, which the caller holds until the step returns. What
    comes after the update meets them: ZeRO-1/2's all-gathers of the updated parameters (counted
    only at the update, ZeRO-1's Plan was 14% under the measured peak with the functional AdamW).

    An update that reads its values to decide what it does (``.item()``, a Python ``if`` on a
    tensor), which fake tensors cannot run, is counted as an out-of-place update's new parameters and
    state, without its temporaries, and ``"update"`` is added to ``guessed`` (the Plan says so).

    ``runs``: by unit, what each leaf of ``tree``'s elements get from the optimizer's groups, as the
    step gives them (``param_groups.master_runs``: a flat shard mixes parameters of several groups,
    whose names its path in the tree does not carry); None: the update resolves the groups itself."""
    levels = []
    kept_before = 0
    # An update of like trees (the same names, shapes and dtypes) by a like optimizer holds alike:
    # predicted once per plan search (reuse.sharing_runs); outside one, at every update action.
    held = reuse.results_for("update_memory")
    for action in actions:
        if action.kind != UPDATE:
            levels.append(kept_before)
            continue
        units = action.units or ((action.layer,) if action.layer is not None else tuple(tree))
        part = {u: tree[u] for u in units}
        part_runs = None if runs is None else {u: runs[u] for u in units}
        key = _update_key(step.optimizer, part, device)
        if key is not None and part_runs is not None:
            key = (key, _frozen(part_runs))
        found = held.get(key) if key is not None else None
        if found is None:
            with meta_like():
                state = step.optimizer.init(part)
                try:
                    found = predict_update_held(step.optimizer.update, part, part, state, device, part_runs)
                except data_dependent_errors():
                    new = _tree_bytes(part) + _tree_bytes(state)
                    found, key = (new, new), None  # a guess: not kept for another plan, which must say so too
                    if guessed is not None:
                        guessed.add("update")
            if key is not None:
                held[key] = found
        peak, kept = found
        levels.append(kept_before + peak)
        kept_before += kept
    return levels


def _frozen(tree: Any) -> Hashable:
    """``tree`` (runs by unit, or by layer and name) as a hashable key."""
    if isinstance(tree, Mapping):
        return tuple((k, _frozen(v)) for k, v in tree.items())
    return tree


def _tree_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _update_key(optimizer: Any, part: Mapping[str, Any], device: torch.device) -> Hashable | None:
    """What an update's held memory depends on: the optimizer's init and update (their settings, where
    they compare by value: the library's optimizers), the tree's names, shapes and dtypes, the
    device; None if the optimizer cannot be hashed or the tree has no signature."""
    try:
        hash((optimizer.init, optimizer.update))
    except TypeError:
        return None
    shapes = reuse.tree_signature(part)
    return None if shapes is None else (optimizer.init, optimizer.update, shapes, device.type)


def compute_copy_bytes(step: Step, master: Mapping[str, Mapping[str, torch.Tensor]]) -> int:
    """Bytes of the compute copies a precision policy casts at the start of every step and holds to
    its ``finish_grads`` (``run_inputs.param_source``, ``Executor.finish_grads``) of the parameters a
    rank holds whole (by layer, ``master``). A leaf whose compute dtype is its stored one is not copied
    (``Tensor.to`` returns it): nothing without a policy. ZeRO-3's are cast per gather:
    :func:`shard_copy_levels`."""
    if step.precision is None:
        return 0
    return sum(_copy_bytes(t.numel(), t.dtype, compute_dtype(step.precision, layer, t.dtype))
               for layer, tensors in master.items() for t in tensors.values())


def copies_to_finish_grads(copies: int, actions: Sequence[Action]) -> list[int]:
    """``copies`` bytes at each action up to the first ``finish_grads`` (inclusive: it casts the
    gradients beside them), none after it, where the executor releases them."""
    levels, held = [], copies
    for action in actions:
        levels.append(held)
        if action.kind == FINISH_GRADS:
            held = 0
    return levels


def copies_to_reductions(step: Step, master: Mapping[str, Mapping[str, torch.Tensor]],
                         actions: Sequence[Action]) -> list[int]:
    """ZeRO-1/2 under a precision policy: at each action (after it), the bytes of the compute copies
    of the layers whose gradients are not yet taken: each goes at the reduce-scatter of its bucket
    (``ZeroActions._release_compute``), any left at ``finish_grads``."""
    copy = {layer: sum(_copy_bytes(t.numel(), t.dtype, compute_dtype(step.precision, layer, t.dtype))
                       for t in tensors.values()) for layer, tensors in master.items()}
    held = dict(copy) if step.precision is not None else {}
    levels = []
    for action in actions:
        if action.kind == REDUCE_SCATTER:
            for unit in action.units or (action.require("layer"),):
                held.pop(unit, None)
        levels.append(sum(held.values()))
        if action.kind == FINISH_GRADS:
            held.clear()
    return levels


def shard_copy_levels(step: Step, sharding: FlatSharding, actions: Sequence[Action]) -> list[int]:
    """ZeRO-3 under a precision policy: at each action (after it), the bytes of the compute-dtype
    copies of this rank's shards that the all-gathers in flight send (``ParamSource.gather_input``:
    each made at its unit's gather, freed at its wait)."""
    copy = {u: _copy_bytes(lay.shard_numel, lay.dtype, compute_dtype(step.precision, u, lay.dtype))
            for u, lay in sharding.units.items()} if step.precision is not None else {}
    in_flight: set[str] = set()
    levels = []
    for action in actions:
        if action.layer is not None and action.layer in copy:
            if action.kind == GATHER:
                in_flight.add(action.layer)
            elif action.kind == WAIT_GATHER:
                in_flight.discard(action.layer)
        levels.append(sum(copy[u] for u in in_flight))
    return levels


def _copy_bytes(numel: int, stored: torch.dtype, compute: torch.dtype) -> int:
    return 0 if compute == stored else numel * compute.itemsize


def unsharded_levels(
    step: Step, master: Mapping[str, Mapping[str, torch.Tensor]], actions: Sequence[Action], device: torch.device,
    guessed: set[str] | None = None, runs: Mapping[str, Any] | None = None, placement: Placement | None = None,
) -> tuple[list[int], dict[str, list[int]]]:
    """Without ``shard_params``: (the gradients held at each action, the other levels by figure; without
    ``placement``, every gradient from the first backward on).

    * Gradients: none at the step's start (the last step's update consumed them); each in the compute
      dtype from the first backward of a stage that uses its parameter (its layers' own, and the weights
      they tie to: autograd makes a leaf's gradient as the backward reaches it), a parameter no stage of
      ``placement`` uses from the rank's first backward; from ``finish_grads`` on, beside them,
      the optimizer's in the master dtype where unscaling makes new ones (a loss scale, or a compute
      dtype that is not the stored one: ``master.unscale_like``); after it, those and the backward's
      that needed no cast (``Executor.finish_grads`` drops the leaves that held the others).
    * ``grad_accumulation``: a backward of a later micro-batch makes each weight's gradient before
      adding it into the one held (autograd's accumulation): the largest such gradient of that stage's, beside
      them. Under a policy reducing in a wider dtype than it computes in, the earlier micro-batches' gradients
      go into sums in that dtype before it instead (run/wide_grads.py): those sums, beside the gradients, from
      the second micro-batch's backward to ``finish_grads``, which folds them in.
    * ``compute_copies``: see :func:`compute_copy_bytes`, to ``finish_grads``.
    * ``update_buffers``: see :func:`update_levels` (``guessed`` as there).

    Counted from the first backward, every gradient was beside the activations at the last stage's
    backward, where the peak is: a one-device BERT's embeddings' and earlier layers' (6.3 of 7.2 MiB)
    made only as the backward reaches them, the Plan 1.13x its measured peak (a plain MLP's first
    Linear's, 1.08x).
    """
    prec = step.precision
    leaves = [(layer, t) for layer, tensors in master.items() for t in tensors.values()]
    backward = [t.numel() * compute_dtype(prec, layer, t.dtype).itemsize for layer, t in leaves]
    cast = [scales_gradients(step) or compute_dtype(prec, layer, t.dtype) != t.dtype for layer, t in leaves]
    unscaled = sum(t.numel() * t.element_size() for (_, t), new in zip(leaves, cast, strict=True) if new)
    # After finish_grads the optimizer's gradients only: the unscaled ones, and the backward's that
    # needed no cast (the executor drops its leaves there, and with them the backward's gradients).
    final = unscaled + sum(b for b, new in zip(backward, cast, strict=True) if not new)
    several = any((a.microbatch or 0) > 0 for a in actions)
    sums = [t.numel() * wide.itemsize if several and (wide := summed_in(prec, layer)) is not None else 0
            for layer, t in leaves]
    every = range(len(leaves))
    made_by = _made_by_stage(step, placement, master)
    # The leaves whose gradients a backward made so far; at the first, those no stage uses.
    reached = set(every).difference(*made_by) if made_by is not None else set(every)
    made, accumulating = [], []
    held, summing = 0, 0
    for action in actions:
        grads = action.kind in GRAD_COMPUTES
        later = grads and (action.microbatch or 0) > 0
        stage_leaves: Collection[int] = every
        if grads:
            if made_by is not None and action.stage is not None:
                stage_leaves = made_by[action.stage]
            else:
                reached.update(every)
            reached.update(stage_leaves)
            held = max(held, sum(backward[i] for i in reached))
        if later:
            summing = sum(sums)
        if action.kind == FINISH_GRADS:
            made.append(sum(backward) + max(unscaled, summing))  # the sums folded in, then the cast
            accumulating.append(0)
            held, summing = final, 0
            continue
        made.append(held + summing)
        # (those autograd still adds to: not summed in a wider dtype)
        accumulating.append(max((backward[i] for i in stage_leaves if not sums[i]), default=0) if later else 0)
    levels = {"update_buffers": update_levels(step, master, actions, device, guessed, runs)}
    copies = copies_to_finish_grads(compute_copy_bytes(step, master), actions)
    if any(copies):  # figures only where a policy casts, or micro-batches accumulate
        levels["compute_copies"] = copies
    if any(accumulating):
        levels["grad_accumulation"] = accumulating
    return made, levels


def _made_by_stage(
    step: Step, placement: Placement | None, master: Mapping[str, Mapping[str, torch.Tensor]]
) -> list[frozenset[int]] | None:
    """Per stage of ``placement``, the leaves of ``master`` (by their index, layer by layer) whose gradients its
    backward makes: its layers' own parameters and the weights they tie to (``lower.stage_needs``, by
    parameter). None without ``placement``."""
    if placement is None:
        return None
    index = {(layer, name): i for i, (layer, name) in enumerate(
        (layer, name) for layer, tensors in master.items() for name in tensors)}
    out = []
    for layers in placement.stages:
        used = {(name, local) for name in layers for local in master.get(name, {})}
        used.update(owner for name in layers for owner in step.chain[name].ties.values())
        out.append(frozenset(index[key] for key in used if key in index))
    return out


def scales_gradients(step: Step) -> bool:
    """Whether the step's loss scale may divide its gradients (a factor other than 1)."""
    scale = step.initial_loss_scale()
    return scale is not None and not isinstance(scale, NoLossScale) and (
        isinstance(scale, DynamicLossScale) or scale.scale_value() != 1.0)
