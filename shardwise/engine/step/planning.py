"""A step's Plan: the lowering of its stack for every rank, what each action moves, and memory.

``Step.plan`` calls :func:`plan_of`. The actions come from ``engine/plan/lower.py``
(the same ones the step runs); with the parameters each communicating action
also gets its wire (dtype and bytes per tensor), and the Plan counts the bytes
each rank holds, from the same layouts ``Step.init`` builds.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ...collectives.backends.gloo_exchange import sized_for_exchange
from ...collectives.backends.shared_memory_exchange import transport_bytes
from ...collectives.mesh import Mesh
from ..layout.devices import device_of
from ..layout.precision import compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state import Params, check_params, tree_nbytes
from ..layout.state_layout import Placement, StateLayout, local_params, meta_shards, unit_names
from ..model.reuse import sharing_runs
from ..optim.meta_like import meta_like
from ..plan.accounting import KeptParts, predict_kept_parts
from ..plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FREE,
    GATHER,
    GATHER_PARAMS,
    GRAD_COMPUTES,
    LOSS,
    REDUCE_REPLICAS,
    REDUCE_SCATTER,
    WAIT_GATHER,
    WAIT_PARAMS,
    WAIT_REDUCE,
    WAIT_REPLICAS,
    Action,
    Plan,
)
from ..plan.batches import split_over
from ..plan.inside import predict_inside
from ..plan.loss_memory import LossMemory
from ..plan.lower import (
    Inside,
    annotate,
    gathers_into_params,
    insert_inside,
    microbatch_count,
    placement_of,
    rank_actions,
    reduce_sizes,
    stage_needs,
    wire_of,
)
from ..run.send_delivery import grad_sends_delivered
from ..run.wide_grads import summed_in
from ..stack.compose import SPLIT, rewrites_in_order, sums_over_batch
from ..stack.roles import prediction_keywords
from .batch_cut import batch_multiple, rank_share
from .held_levels import copies_to_reductions, shard_copy_levels, unsharded_levels, update_levels
from .param_groups import master_runs
from .rank_boundaries import classes_by_boundaries
from .transfer_levels import transfer_levels

if TYPE_CHECKING:
    from .step import Step


def plan_of(step: Step, mesh: Mesh, params: Params | None, batch: Any, *, share_identical_ranks: bool = True) -> Plan:
    """Per-rank actions of one step: the lowering of the whole transform stack.

    With ``params`` (real or ``device="meta"`` tensors), every communicating action
    also says what it moves (dtype and bytes per tensor), and the plan counts the
    bytes each rank holds; with a ``batch`` too, the pipeline's transfers are sized
    and the activation bytes kept for backward are predicted (on fake tensors: the
    figures ``sw.policies.saved_bytes`` measures).

    Ranks that differ only in their data-parallel coordinate (their ZeRO shard, their slice of
    the batch) lower to the same actions and hold the same bytes: what a rank does depends on
    its pipeline index and its tensor-parallel index only. So each of those *rank classes* is
    lowered once and its actions and figures shared by its ranks (512 ranks of dp 8 x pp 8 x tp 8
    are 64 classes; ZeRO-3 alone over 512 is one), and what a class predicts on fake tensors (the
    pipeline's boundaries) is predicted once per distinct set of local shapes. A pipeline's transfers
    carry what each rank's own micro-batches pass on (an attention mask or none): ranks whose shares
    differ so are told apart (``rank_boundaries.py``).
    ``share_identical_ranks=False`` lowers every rank on its own (the reference the tests compare
    the shared plan with).

    The rank classes make like fake runs (two tensor-parallel ranks update shards of one shape): shared,
    each made once per plan, as a plan search shares them across its plans (``reuse.sharing_runs``); not
    in the reference, where each class makes its own (but inside a search, which shares them all).
    """
    with sharing_runs() if share_identical_ranks else contextlib.nullcontext():
        return _plan_of(step, mesh, params, batch, share_identical_ranks)


def _plan_of(step: Step, mesh: Mesh, params: Params | None, batch: Any, share_identical_ranks: bool) -> Plan:
    mesh = step.check_mesh(mesh) or Mesh(world=1)
    if params is not None:
        check_params(step.chain, params)
    placement, schedule = placement_of(step, mesh, params)
    class_of = [rank_class(step, mesh, placement, r) if share_identical_ranks else r for r in range(mesh.size)]
    first: dict[Any, int] = {}  # each class's lowest rank stands for it
    for r, c in enumerate(class_of):
        first.setdefault(c, r)
    layouts = _layouts(step, mesh, params, placement, first) if params is not None else {}
    boundaries_of: dict[Any, Any] = {}  # class -> the pipeline's boundaries, per micro-batch
    if params is not None and batch is not None and step.pipeline_spec is not None:
        class_of, boundaries_of = classes_by_boundaries(step, mesh, batch, layouts, class_of)
        layouts = {c: layouts[c[0]] for c in boundaries_of}
        first = {}
        for r, c in enumerate(class_of):
            first.setdefault(c, r)
    inside = _inside_computes(step, mesh, params, batch, placement, layouts[class_of[0]] if layouts else None)
    device = planned_device(params, batch)
    by_class: dict[Any, tuple[Action, ...]] = {}
    masters: dict[Any, Params] = {}  # each class's master parameters (meta), as it holds them
    for c, r in first.items():
        index = placement.index_of(mesh, r)
        if params is None:
            by_class[c] = rank_actions(
                step, placement, schedule, index, _units_without_params(step, placement, index), device
            )
            continue
        layout = layouts[c]
        actions = rank_actions(
            step, placement, schedule, index, unit_names(layout.sharding), device, reduce_sizes(step, layout.sharding)
        )
        boundaries = boundaries_of.get(c)
        master = masters[c] = step.master_meta(local_params(step.local_view(params, mesh, r), placement, index))
        update_tree = master if layout.sharding is None else meta_shards(layout.sharding)
        actions = annotate(
            actions, step, placement, layout.sharding, update_tree, boundaries,
            layout.metric_dtype,
        )
        if inside is not None:  # made only under a split
            actions = insert_inside(actions, inside)
        by_class[c] = actions
    per_rank = [by_class[c] for c in class_of]
    memory: dict[str, tuple[int, ...]] = {}
    notes: dict[str, tuple[str, ...]] = {}
    if params is not None:
        guessed: set[str] = set()
        memory, stand_ins = _memory(step, mesh, params, batch, placement, layouts, class_of, masters, by_class,
                                    guessed)
        loss_guess = next((g[len(LOSS_GUESSED):] for g in guessed if g.startswith(LOSS_GUESSED)), None)
        if loss_guess is not None:  # not silently a guess: say why
            notes[step.chain.names[-1]] = (_GUESSED_LOSS.format(why=loss_guess),)
        for layer in (g[len(BACKWARD_UNKNOWN):] for g in sorted(guessed) if g.startswith(BACKWARD_UNKNOWN)):
            notes[layer] = (*notes.get(layer, ()), _BACKWARD_UNKNOWN)
        if "update" in guessed:  # not silently a guess either
            for layer in step.chain.names:
                if step.chain.owned_param_names(layer):
                    notes[layer] = (*notes.get(layer, ()), _GUESSED_UPDATE)
        for layer in stand_ins:  # not silently a guess: say which figure is the stand-ins'
            notes[layer] = (*notes.get(layer, ()), _STAND_INS)
    # In the order the rewrites apply (engine/stack/compose.py), whatever order they were applied in.
    for spec in rewrites_in_order(step.transforms):
        for layer, note in spec.layer_notes(step.base_chain).items():
            notes[layer] = (*notes.get(layer, ()), note)
            if spec.role == SPLIT and inside is None:  # not silently absent: say what is missing
                notes[layer] += ("its collectives inside the layer are not listed: they are predicted from a "
                                 "batch, step.plan(mesh, params, batch)",)
    return Plan(mesh, tuple(per_rank), memory, {n: notes[n] for n in step.chain.names if n in notes})


def _layouts(
    step: Step, mesh: Mesh, params: Params, placement: Placement, first: Mapping[Any, int]
) -> dict[Any, StateLayout]:
    """Each class's layout, those of one split index made together (``layouts_by_index``)."""
    by_index: dict[Any, dict[int, StateLayout]] = {}
    out: dict[Any, StateLayout] = {}
    for c, r in first.items():
        coordinate = step.split.coordinates(mesh, r) if isinstance(c, tuple) else r
        if coordinate not in by_index:
            by_index[coordinate] = step.layouts_by_index(mesh, params, rank=r)
        out[c] = by_index[coordinate][placement.index_of(mesh, r)]
    return out


def rank_class(step: Step, mesh: Mesh, placement: Placement, rank: int) -> tuple[int, tuple[int, ...]]:
    """What decides a rank's actions and bytes: its pipeline index and its indices on the splits' axes.
    Its data-parallel coordinate does not (every ZeRO shard of a unit has the same padded size,
    and a rank's shard is chosen at run time), nor does any other axis's."""
    return placement.index_of(mesh, rank), step.split.coordinates(mesh, rank)


def planned_device(params: Params | None, batch: Any) -> torch.device:
    """Where the planned ranks compute: their parameters' device, or for meta parameters (a model
    not yet made) the batch's, else the CPU. The run reads its parameters' device: a plan of a
    meta model for a GPU run wants a batch on the GPU."""
    device = device_of(params, default="cpu")
    return device_of(batch, default="cpu") if device.type == "meta" else device


def _inside_computes(
    step: Step, mesh: Mesh, params: Params | None, batch: Any, placement: Placement, layout: StateLayout | None
) -> Inside | None:
    """The collectives each compute issues inside its layers (a split transform's), predicted on fake
    tensors from a micro-batch, by the split's own prediction or else the engine's: None without a split
    (or a loss term summed over the batch's axes, :func:`sums_over_batch`), parameters or a batch."""
    split = step.split
    if not (split.axes or sums_over_batch(step.transforms)) or params is None or batch is None or layout is None:
        return None
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for spec in layout.leaves.values():
        dtype = compute_dtype(step.precision, spec.layer, spec.dtype)
        shapes.setdefault(spec.layer, {})[spec.name] = (torch.Size(spec.local_shape), dtype)
    predict = split.own_prediction() or predict_inside
    inputs, targets = one_microbatch(step, mesh, batch)
    found = predict(
        step.chain, placement, shapes, step.loss_fn, inputs, targets, functools.partial(step.predicting, mesh),
        **prediction_keywords(predict, _splits_backward(step, layout)),
    )
    return {
        key: [(i.op, i.axis, i.label, wire_of(i.shape, i.dtype)) for i in issued] for key, issued in found.items()
    }


def _splits_backward(step: Step, layout: StateLayout) -> bool:
    """Whether the step's schedule splits a backward into an input pass and a weight pass (zero-bubble's
    ``I`` and ``W``): what the predictions on fake tensors run those passes for, beside the whole one."""
    schedule = layout.schedule
    return step.pipeline_spec is not None and schedule is not None and any(
        op.kind == "W" for ops in schedule.ranks for op in ops
    )


def _units_without_params(step: Step, placement: Placement, index: int) -> list[str] | None:
    if step.sharding_spec is None:
        return None
    held = [n for n in placement.layers_of(index) if step.chain.owned_param_names(n)]
    return held + [o for o, _ in placement.replicas_of(index) if o not in held]

def one_microbatch(step: Step, mesh: Mesh, batch: Any) -> tuple[Any, Any]:
    """Rank 0's first micro-batch: what the Plan's predictions on fake tensors run on (every rank's
    micro-batches have its shapes)."""
    pair, _ = rank_share(step, mesh, batch, 0)
    k = microbatch_count(step)
    return split_over(pair, k, 0, f"{k} micro-batches", batch_multiple(step, mesh)) if k > 1 else pair


def _memory(
    step: Step, mesh: Mesh, params: Params, batch: Any, placement: Placement,
    layouts: Mapping[Any, StateLayout], class_of: Sequence[Any], masters: Mapping[Any, Params],
    actions: Mapping[Any, tuple[Action, ...]], guessed: set[str],
) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """Each figure per rank, counted once per rank class (see :func:`rank_class`); and the layers whose
    kept_for_backward ran on stand-ins (``guessed`` gets "update" where the update's figure is a guess:
    ``held_levels.update_levels``; ``LOSS_GUESSED`` and why, where the loss's is: ``_kept_per_rank``)."""
    device = planned_device(params, batch)
    by_class: dict[Any, dict[str, int]] = {}
    held_at: dict[Any, list[int]] = {}  # per class, what held_in_step's levels hold at each action
    for c in masters:
        by_class[c], held_at[c] = _class_memory(step, layouts[c], masters[c], actions[c], device, placement, guessed)
    # A figure some classes have not (a policy's compute copies where a rank holds no parameter) is 0 there.
    keys = dict.fromkeys(k for c in by_class for k in by_class[c])
    memory = {k: tuple(by_class[c].get(k, 0) for c in class_of) for k in keys}
    # At rest: the state but the gradients (the parameters, the optimizer's state), held through the step.
    at_rest = [k for k in memory if k not in _COME_AND_GO and k not in ("grads", "held_in_step")]
    kept_at = {c: [0] * len(actions[c]) for c in masters}  # what the forward and the loss keep, at each action
    stand_ins: tuple[str, ...] = ()
    if batch is not None:
        kept = _kept_per_rank(step, mesh, params, batch, placement, layouts[class_of[0]], guessed)
        memory["kept_for_backward"], stand_ins = kept.per_rank, kept.stand_ins
        guessed.update(BACKWARD_UNKNOWN + layer for layer in kept.backward_unknown)
        loss_at = {}
        for c in masters:
            grads_of = None
            if step.pipeline_spec is not None and step.sharding_spec is None:  # (held_levels.unsharded_levels')
                grads_of = {layer: sum(t.numel() * compute_dtype(step.precision, layer, t.dtype).itemsize
                                       for t in tensors.values()) for layer, tensors in masters[c].items()}
            kept_at[c], loss_at[c] = _kept_levels(actions[c], placement, kept, grads_of)
        memory["loss_buffers"] = tuple(max(loss_at[c], default=0) for c in class_of)
        if step.pipeline_spec is not None:  # a pipeline's transfers, beside what the stages keep
            rank_of = {c: class_of.index(c) for c in masters}
            transfers = {c: transfer_levels(actions[c], kept.own_output, grad_sends_delivered(
                layouts[c].schedule, placement.index_of(mesh, rank_of[c]), placement.backward_from)) for c in masters}
            memory["transfer_buffers"] = tuple(max(transfers[c], default=0) for c in class_of)
            for c in masters:
                kept_at[c] = [k + t for k, t in zip(kept_at[c], transfers[c], strict=True)]
    # The peak: the state at rest, and the most that the gradients made so far and the buffers
    # (``held_in_step``'s levels: under shard_params the shards made so far, the units gathered, the
    # gradients on their way to a reduction and the collectives' copies; the update's allocations, the
    # compute copies) and what the forward and the loss keep for backward (the loss's own beside, as it
    # runs) hold together at one action. Summing each one's own peak counted, for a language model, every
    # gradient and the update's new state beside the activations, which are freed by then (19% over the
    # measured peak of a TinyGPT with an 8192-word vocabulary); summing the buffers' peaks counted, at
    # ZeRO-3, a prefetched unit beside a reduce-scatter that it never meets (4-6% over benchmarks/memory.py's).
    memory["peak"] = tuple(
        sum(memory[k][r] for k in at_rest)
        + max((h + k for h, k in zip(held_at[class_of[r]], kept_at[class_of[r]], strict=True)), default=0)
        for r in range(mesh.size)
    )
    return memory, stand_ins


_GUESSED_UPDATE = ("the optimizer's update reads its values (a data-dependent op), which fake tensors cannot run: "
                   "update_buffers counts its new parameters and state, as an out-of-place update's, without "
                   "its temporaries")

_STAND_INS = ("fake tensors cannot run it (it reads data to decide a shape, a routing?, or an op's fake kernel "
              "refuses what its real one runs): its kept_for_backward is predicted on zero-filled stand-ins (a real "
              "batch routes otherwise)")
LOSS_GUESSED, BACKWARD_UNKNOWN = "loss: ", "backward: "  # (prefixes of what ``guessed`` says)
_GUESSED_LOSS = ("loss_fn could not run on fake tensors ({why}): loss_buffers is a guess, what cross-entropy "
                 "holds (the chain's output, a tensor of its size kept for backward, the output's gradient)")
_BACKWARD_UNKNOWN = ("its backward could not run on fake tensors (it reads a value): what it holds as it runs, beyond "
                     "what its forward kept, is not counted in the peak")

# The figures that come and go as the actions run, each its own peak: the Plan's peak counts instead
# the most they hold together at one action (``held_in_step``).
_COME_AND_GO = ("gathered_peak", "reduce_buffers", "comm_buffers", "replica_buffers", "update_buffers",
               "params_in_flight", "master_shards", "compute_copies", "grad_accumulation", "transfer_buffers")


def _class_memory(
    step: Step, layout: StateLayout, master: Params, actions: tuple[Action, ...], device: torch.device,
    placement: Placement, guessed: set[str],
) -> tuple[dict[str, int], list[int]]:
    """The class's figures, and what the step holds at each of its actions beside the state at rest
    (``held_in_step``'s levels: the gradients made so far, the buffers)."""
    figures: dict[str, int] = {}
    sharding = layout.sharding
    shards = None if sharding is None else meta_shards(sharding)
    figures["params"] = tree_nbytes(shards if sharding is not None and sharding.holds_shards else master)
    figures["grads"] = tree_nbytes(shards if shards is not None else master)
    with meta_like():  # a user's optimizer's zeros_like, without torch's Python reference (meta_like.py)
        figures["opt_state"] = tree_nbytes(step.optimizer.init(shards if shards is not None else master))
    if step.sharding_spec is None:
        # The groups resolved over the whole model's names (a pipeline rank holds some layers: a group naming only
        # another stage's parameters matches none of this rank's, which the update resolving them alone refused).
        groups = getattr(step.optimizer, "groups", None)
        runs = None if groups is None else master_runs(groups, step.base_chain, layout, master, 0)
        made, levels = unsharded_levels(step, master, actions, device, guessed, runs, placement)
        held, together = _held(made, levels)
        return figures | held, together
    assert sharding is not None
    levels = {
        "gathered_peak": _gathered_levels(actions, {
            u: lay.padded_numel * compute_dtype(step.precision, u, lay.dtype).itemsize
            for u, lay in sharding.units.items()
        }),
        "reduce_buffers": _reduce_levels(step, sharding, actions,
                                         stage_needs(step.chain, placement, tuple(sharding.units)), device),
        "comm_buffers": _copy_levels(step, sharding, actions, device),
    }
    if sharding.replicate is not None:
        levels["replica_buffers"] = _replica_levels(step, sharding, actions)
    # The update's own allocations (an out-of-place update's new parameters and state beside the
    # old ones, its temporaries), at the update, beside every gradient shard; what it keeps, to the end.
    assert shards is not None
    groups = getattr(step.optimizer, "groups", None)  # a user's optimizer may have no groups
    # The groups' runs over data-parallel index 0's shards: every index's shards have the same shapes,
    # and the class stands for every index (rank_class); another index's runs cut its shards elsewhere,
    # which moves the update's temporaries by what a frozen range there spares. Without the runs, the
    # update resolved its groups on the shards' unit names and refused every pattern of a parameter name.
    runs = None if groups is None else master_runs(groups, step.base_chain, layout, shards, 0)
    levels["update_buffers"] = update_levels(step, shards, actions, device, guessed, runs)
    copies = shard_copy_levels(step, sharding, actions) if sharding.holds_shards else \
        copies_to_reductions(step, master, actions)
    if any(copies):
        levels["compute_copies"] = copies
    if not sharding.holds_shards:
        into = gathers_into_params(step, device)
        levels["params_in_flight"] = _params_levels(sharding, actions, into, device.type == "cpu")
        # ZeRO-1/2: this rank's shard of every unit, what the optimizer updates and the all-gathers
        # send, carried in by the state (the last step's update made them; a first step, or one
        # after the parameters were read, cuts them from the full parameters) and held to its end,
        # beside the parameters at rest; gathered into the parameters, views of their values (laid
        # out so by init and by a checkpoint's load: sharding.UnitLayout.laid_out), no bytes of their own.
        levels["master_shards"] = [0 if into else tree_nbytes(shards)] * len(actions)
    made = _shards_made_levels(actions, {u: tree_nbytes(t) for u, t in shards.items()}, device.type == "cpu",
                               _new_share_bytes(step, sharding))
    held, together = _held(made, levels)
    return figures | held, together


def _held(made: Sequence[int], levels: Mapping[str, Sequence[int]]) -> tuple[dict[str, int], list[int]]:
    """Each level's own peak, and ``held_in_step``: the most they and the gradients ``made`` so far hold
    together at one action; and what they hold together at each action."""
    figures = {key: max(per_action, default=0) for key, per_action in levels.items()}
    together = [sum(at) for at in zip(made, *levels.values(), strict=True)]
    figures["held_in_step"] = max(together, default=0)
    return figures, together


def _params_levels(
    sharding: FlatSharding, actions: Sequence[Action], into_params: bool = False, on_cpu: bool = False
) -> list[int]:
    """ZeRO-1/2, at each action: the updated full parameters the step's all-gathers bring (each
    bucket's whole padded buffer, in the master dtype: the parameters are views of it), from its
    ``gather_params`` to the step's end, where they are the new state's parameters beside the ones
    the step began with (``params``, which its caller still holds). With ``overlap_gather`` they
    are still in flight then, across the step boundary: the next step's ``wait_params`` come
    before its first forwards, and until then the in-flight buffers are its ``params``.
    ``into_params`` (``gathers_into_params``): written into the parameters the step was given, each
    bucket's buffer only to its ``wait_params``, which copies it in; for a bucket the exchanges
    take on a CPU (``on_cpu``), nothing: its row is sent from this rank's shards in the parameters
    and the peers' rows are copied from their shared-memory slots straight into them. The Plan
    takes the ranks to share a host, as it does for the slots (``_copy_levels``); over loopback
    TCP, ranks on several hosts, such a bucket's buffer is held to its wait too."""
    def held(units: Sequence[str]) -> int:
        if into_params and on_cpu and _params_exchanged(sharding, units):
            return 0
        return sum(sharding.units[u].padded_nbytes for u in units)

    live, levels = 0, []
    for action in actions:
        if action.kind == GATHER_PARAMS:
            live += held(action.units or (action.require("layer"),))
        levels.append(live)
        if into_params and action.kind == WAIT_PARAMS:
            live -= held(action.units or (action.require("layer"),))
    return levels


def _params_exchanged(sharding: FlatSharding, units: Sequence[str]) -> bool:
    """Whether the all-gather of these units' updated shards (ZeRO-1/2, in the master dtype: one
    bucket) is big enough for the exchanges on a CPU."""
    first = sharding.units[units[0]]
    return sized_for_exchange(sum(sharding.units[u].padded_nbytes for u in units), first.dtype, first.shards)


def _shards_made_levels(
    actions: Sequence[Action], shard_bytes: Mapping[str, int], on_cpu: bool = False,
    new_share_bytes: Mapping[str, int] | None = None,
) -> list[int]:
    """At each action, the gradient shards made so far in the step: a unit's from its first
    reduce-scatter on (the step starts without them: the update consumed the last step's); a unit
    no listed reduce-scatter makes, from the start.

    On a CPU (gloo) a reduce-scatter's shard is made after its issue: the exchanges' thread makes it
    when it starts on the job (in issue order, one job at a time, releasing the job's flat input when
    it ends), gloo's all-reduce path at the wait. There a unit's shard counts from its wait on, and
    while reduce-scatters are in flight, the largest of their shards (the job the thread runs; a job
    starts after its issue, which made its flat input): their flat inputs are counted to their waits
    (``_reduce_levels``), and one that ended holds its shard, at most half its flat input, instead.
    Counted from the issue, ZeRO-1's Plan, which issues every reduce-scatter before it waits for any,
    was 11% over the measured peak (benchmarks/memory.py, 200 MB model, world 2).

    A unit reduced again in the step (``reduce_each_microbatch``: a micro-batch's share, then the
    next's) holds its accumulated share while the new shard is made and added into it
    (``run/zero.py``'s ``wait_reduce``): both at once, the new one's ``new_share_bytes`` (the shard
    in the reduce dtype, and its copy in the gradients' dtype where that differs) more than its
    share, at its wait on a CPU (before, the in-flight job's shard counts it), from its issue to its
    wait elsewhere. Without them a pipeline under ZeRO-3 with 3 or more micro-batches, whose later
    micro-batches' waits come while its units are gathered, was one unit's shard (6%) under the
    measured peak (a per-action VmHWM trace: every such wait 8 MiB above the Plan's level)."""
    first: dict[str, int] = {}
    for i, action in enumerate(actions):
        if action.kind == (WAIT_REDUCE if on_cpu else REDUCE_SCATTER):
            for u in action.units or (action.require("layer"),):
                first.setdefault(u, i)
    levels = [sum(n for u, n in shard_bytes.items() if first.get(u, -1) <= i) for i in range(len(actions))]
    if new_share_bytes is not None:
        _count_new_shares(actions, first, new_share_bytes, on_cpu, levels)
    if on_cpu:
        in_flight: dict[str, int] = {}  # by the reduction's key (its first unit), its shards' bytes
        for i, action in enumerate(actions):
            if action.kind == WAIT_REDUCE:  # its shard is made, counted above from here on
                in_flight.pop(action.require("layer"), None)
            levels[i] += max(in_flight.values(), default=0)
            if action.kind == REDUCE_SCATTER:  # its job starts once the issue has made its flat input
                units = action.units or (action.require("layer"),)
                in_flight[units[0]] = sum(shard_bytes.get(u, 0) for u in units)
    return levels


def _count_new_shares(
    actions: Sequence[Action], first: Mapping[str, int], new_share_bytes: Mapping[str, int], on_cpu: bool,
    levels: list[int],
) -> None:
    """Add to ``levels`` the new shard of each reduction of a unit whose share is made already (its
    ``first`` reduction came before): on a CPU at its wait, elsewhere from its issue to its wait."""
    again: dict[str, int] = {}  # by the reduction's key (its first unit): the new shards' bytes
    live = 0  # elsewhere than on a CPU: those issued and not yet waited for
    for i, action in enumerate(actions):
        if action.kind == REDUCE_SCATTER:
            units = action.units or (action.require("layer"),)
            again[units[0]] = sum(new_share_bytes.get(u, 0) for u in units if first.get(u, len(actions)) < i)
            live += 0 if on_cpu else again[units[0]]
        levels[i] += live
        if action.kind == WAIT_REDUCE:
            held = again.pop(action.require("layer"), 0)
            if on_cpu:
                levels[i] += held
            else:
                live -= held


def _replica_levels(step: Step, sharding: FlatSharding, actions: Sequence[Action]) -> list[int]:
    """HSDP, at each action: bytes of the gradient shards in flight in their all-reduce over the replicas'
    axis (each in the reduce dtype, from its issue to the end of its wait: lower._replica_reductions)."""
    sizes = {u: lay.shard_numel * _reduce_dtype(step, u, lay.dtype).itemsize
             for u, lay in sharding.units.items()}
    live = 0
    levels = []
    for action in actions:
        size = sum(sizes[u] for u in action.units or (action.require("layer"),)) if action.kind in (
            REDUCE_REPLICAS, WAIT_REPLICAS) else 0
        live += size if action.kind == REDUCE_REPLICAS else 0
        levels.append(live)
        live -= size if action.kind == WAIT_REPLICAS else 0
    return levels


def _reduce_levels(
    step: Step, sharding: FlatSharding, actions: Sequence[Action], needs: Mapping[int, tuple[str, ...]],
    device: torch.device,
) -> list[int]:
    """At each action, bytes of full gradients on their way to a reduce-scatter: each unit's from the
    first backward that adds to it (its stage ``needs`` the unit: a layer without parameters makes
    none) to its reduce-scatter's issue, over as many micro-batches as come between (accumulated
    for one reduction after the last: every unit's, from the first micro-batch's backward on); when
    a bucket is issued, its gradients and the flat buffer they are concatenated into (in the reduce
    dtype), then that buffer to the wait; or, where they go as they are (on a CPU, a message big
    enough for the exchanges: through shared memory each slice is copied into the slot it is sent
    from), its gradients alone, held to the wait instead of a buffer; and the inputs still in flight
    (until their waits end: how many, lower._waits_for_reductions). The gradients are in the compute
    dtype (the backward's, of the compute copies), the buffer in the reduce dtype: under
    ``compute=f32,reduce=bf16`` the gradients held are twice the bytes of the message, under
    ``compute=bf16,reduce=f32`` half. A backward adding to a gradient it holds makes the micro-batch's
    before adding it in: both at that compute, for one unit at a time (autograd adds each new gradient
    in as soon as it is made, and frees it, before the next layer's backward: a pipeline stage of
    several units holds one unit's more, the largest, not all of theirs; counting all of them, a
    pipeline's stage of two Linear(2048) under ZeRO-3 with one reduction after the last micro-batch
    was 13% over the measured peak). (Counting only the next bucket's gradients during a backward,
    the Plan said 0.87x the model a rank for a ZeRO-3 Llama with accumulation 2, which held 1.81x.)"""
    sizes = _reduce_sizes(step, sharding)
    grad_sizes = {u: lay.padded_numel * _gather_dtype(step, u, lay.dtype).itemsize
                  for u, lay in sharding.units.items()}
    # A later micro-batch's backward into gradients held (one reduction after the last) under a policy reducing in
    # a wider dtype: those go into sums in it first (run/wide_grads.py), held beside this one's to the issue.
    several = any((a.microbatch or 0) > 0 for a in actions)
    sum_sizes = {u: lay.padded_numel * wide.itemsize for u, lay in sharding.units.items()
                 if several and (wide := summed_in(step.precision, u)) is not None}
    reduced = {u for a in actions if a.kind == REDUCE_SCATTER for u in a.units or (a.require("layer"),)}
    live: dict[str, int] = {}  # the full gradients made and not yet issued
    summing: set[str] = set()  # the units whose gradients went into sums in the reduce dtype
    pending: dict[str, int] = {}
    levels = []
    for action in actions:
        # A later micro-batch's gradient of a unit that holds one is made before it is added in (or, summed in
        # the reduce dtype, beside the sum its held one went into).
        again = 0
        if action.kind in GRAD_COMPUTES:
            made = [u for u in needs.get(action.stage or 0, ()) if u in reduced]
            again = max((grad_sizes[u] for u in made if u in live and u not in sum_sizes), default=0)
            summing.update(u for u in made if u in live and u in sum_sizes)
            live.update((u, grad_sizes[u] + (sum_sizes[u] if u in summing else 0)) for u in made)
        level = sum(live.values()) + sum(pending.values()) + again
        if action.kind == REDUCE_SCATTER:
            units = action.units or (action.require("layer"),)
            # A summed unit's gradient goes as its sum (the held one added in and freed).
            size = sum(sizes[u] for u in units)
            grads = sum(sum_sizes[u] if u in summing else grad_sizes[u] for u in units)
            for u in units:
                live.pop(u, None)
                summing.discard(u)
            first = sharding.units[units[0]]
            as_slices = device.type == "cpu" and sized_for_exchange(
                size, _reduce_dtype(step, first.unit, first.dtype), first.shards)
            level = grads + (0 if as_slices else size) + sum(live.values()) + sum(pending.values())
            pending[units[0]] = grads if as_slices else size
        levels.append(level)
        if action.kind == WAIT_REDUCE:  # held until the wait ends
            pending.pop(action.require("layer"), None)
    return levels


def _copy_levels(
    step: Step, sharding: FlatSharding, actions: Sequence[Action], device: torch.device
) -> list[int]:
    """At each action, what the collectives in flight hold of their own, from their issue to the end of
    their wait. gloo's own all-gather receives into a flat buffer of its own, the whole unit, and copies
    it into ours before the wait returns (a per-action VmHWM trace at world 4: each wait_gather's
    high-water mark one unit above the RSS after it); on a CPU a unit big enough for the direct
    exchanges (``collectives/backends/gloo_exchange.py``) is received straight into the result and
    holds nothing, so only the smaller ones are counted there (800 MB model, world 8: the Plan said
    569 MiB where 514 MiB were measured while it counted every unit). A reduce-scatter holds nothing
    counted of its own: the executor donates its flat input (counted in ``reduce_buffers``) and the
    exchange's receive buffers are 2 MiB at most (gloo's ring scratch, when it runs, under 2 MiB).
    On one host the exchanges go through shared memory instead: the slots a member writes into are
    held from the first exchange on, at every action (``transport_bytes``), wherever one unit, or
    one bucket of several, is big enough for them.
    On other devices every unit is counted: what NCCL holds during them was not measured."""
    dtypes = {u: _gather_dtype(step, u, lay.dtype) for u, lay in sharding.units.items()}
    gathered = {u: lay.padded_numel * dtypes[u].itemsize
                for u, lay in sharding.units.items()}
    full = dict(gathered)
    transport = 0
    if device.type == "cpu":
        exchanged = {u: sized_for_exchange(n, dtypes[u], sharding.units[u].shards) for u, n in gathered.items()}
        reduced = _reduce_sizes(step, sharding)
        lays = sharding.units
        # A bucket of several units travels as one message: big enough together for the exchanges.
        messages = [(n, _reduce_dtype(step, u, lays[u].dtype), lays[u].shards) for u, n in reduced.items()]
        for a in actions:
            if a.units and a.kind == REDUCE_SCATTER:
                first = lays[a.units[0]]
                messages.append((sum(reduced[u] for u in a.units), _reduce_dtype(step, first.unit, first.dtype),
                                 first.shards))
        gathers = [a.units for a in actions if a.units and a.kind == GATHER_PARAMS]
        if any(exchanged.values()) or any(sized_for_exchange(*m) for m in messages) or any(
                _params_exchanged(sharding, units) for units in gathers):
            transport = transport_bytes(max(lay.shards for lay in sharding.units.values()))
        gathered = {u: 0 if exchanged[u] else n for u, n in gathered.items()}
    pending: dict[str, int] = {}
    seen: set[str] = set()  # the units gathered so far in the step
    levels = []
    for action in actions:
        if action.kind == GATHER and action.layer is not None:
            pending[action.layer] = gathered[action.layer]
        level = sum(pending.values()) + transport
        if action.kind == WAIT_GATHER:
            # A unit gathered before in the step is refilled in its own buffer (its first forward's graph
            # holds views of it) from the gathered copy: both at once, one unit more, where no receive
            # copy of as much was counted (a trace of ZeRO-3 with two micro-batches, 16 MiB units at
            # world 4: each such wait one unit above the level after it; the Plan 8% under without it).
            unit = action.require("layer")
            if unit in seen:
                level += max(0, full[unit] - pending.get(unit, 0))
            seen.add(unit)
        levels.append(level)
        if action.kind == WAIT_GATHER:
            pending.pop(action.require("layer"), None)
    return levels


def _new_share_bytes(step: Step, sharding: FlatSharding) -> dict[str, int]:
    """Each unit's reduced shard as a reduction that adds to an earlier share makes it: in the reduce
    dtype, and cast to the gradients' (the share's) where that differs (``run/zero.py``'s
    ``wait_reduce``)."""
    out = {}
    for u, lay in sharding.units.items():
        wire, made_in = _reduce_dtype(step, u, lay.dtype), _gather_dtype(step, u, lay.dtype)
        out[u] = lay.shard_numel * (wire.itemsize + (made_in.itemsize if made_in != wire else 0))
    return out


def _reduce_sizes(step: Step, sharding: FlatSharding) -> dict[str, int]:
    """Each unit's full (padded) gradient in the reduce dtype: what its reduce-scatter takes in."""
    return {u: lay.padded_numel * _reduce_dtype(step, u, lay.dtype).itemsize
            for u, lay in sharding.units.items()}


def _reduce_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).reduce

def _gather_dtype(step: Step, unit: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if step.precision is None else step.precision.for_layer(unit).compute

class _Kept(NamedTuple):
    """What the forward keeps for backward: ``per_rank``, the Plan's ``kept_for_backward`` (the layers' figures
    at one micro-batch, with the micro-batches in flight); ``held``, what a stage's layers keep of their own at
    one micro-batch from its forward to its backward (with a zero-bubble input pass's records, and the outputs
    a layer keeps itself: ``accounting.KeptParts.kept_outputs``); ``batch``, per layer, the batch's
    storages it keeps (kept once however many micro-batches are in flight: they are views of one batch);
    ``in_backward``, the most a stage's backward holds beyond that and its weights' gradients (the gradients
    of its intermediates, a recomputation's activations: remat's); ``loss``, what the loss holds;
    ``stand_ins``, the layers that ran on stand-ins; ``backward_unknown``, those whose backward could not run
    on fake tensors; ``recorded``, per stage, the gradients a zero-bubble input pass records for the weight pass
    (0 where the backward is not split), held from its I to its W; ``recorded_output``, the part of it that is
    the stage's output's gradient, which the I's level counts already (the loss's gradients, ``in_backward``)."""

    per_rank: tuple[int, ...]
    held: list[int]
    in_backward: list[int]
    batch: Mapping[str, Mapping[int, int]]
    loss: LossMemory
    stand_ins: tuple[str, ...]
    backward_unknown: tuple[str, ...]
    recorded: list[int]
    recorded_output: list[int]
    own_output: list[int]  # per stage, the bytes of its output its last layer keeps itself (in ``held``)
    parts: KeptParts  # per layer, what the figures above sum (``_first_backward_relief``)


def _kept_levels(
    actions: Sequence[Action], placement: Placement, kept: _Kept, grads_of: Mapping[str, int] | None = None,
) -> tuple[list[int], list[int]]:
    """At each action, what the forward and the loss keep for backward, the loss's own as it runs beside;
    and the loss's part of that. A stage's figure is held from its forward of a micro-batch to that
    micro-batch's backward (its weight pass, when the backward is split: it still needs the stage's
    inputs), the batch's storages from the first forward that keeps them to the step's end, the loss's
    kept bytes from the loss to the last stage's backward of that micro-batch, and ``loss.extra`` at the
    loss and at that backward, which starts from the loss (the output's gradient is made there); a stage's
    ``in_backward`` at its backward, after the loss's there; a zero-bubble input pass's records from that
    I to its W (they are made there: counted from the forward, zb_h1's last rank was planned 1.18x its
    measured peak). With ``grads_of`` (per layer, the bytes of its weights' gradients, which ``held_in_step``
    counts whole from a stage's first backward on), that backward's figure less ``_first_backward_relief``."""
    live = loss_live = 0
    backed: set[int] = set()  # the stages whose first backward ran
    of_batch: dict[int, int] = {}
    pending: set[int] = set()  # the micro-batches whose loss ran and whose last stage's backward has not
    levels, loss_levels = [], []
    for action in actions:
        extra, after, loss_extra, later = 0, 0, 0, 0
        if action.kind == FORWARD:
            s = action.require("stage")
            live += kept.held[s]
            for layer in placement.stages[s]:
                for key, n in kept.batch[layer].items():
                    of_batch.setdefault(key, n)
        elif action.kind == LOSS:
            loss_live += kept.loss.kept
            pending.add(action.mb)
            extra = loss_extra = kept.loss.extra
        elif action.kind in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            s = action.require("stage")
            last = s == placement.last and action.mb in pending
            extra = kept.in_backward[s]
            relief = before_grads = 0
            if grads_of is not None and action.kind == BACKWARD and s not in backed:
                relief = _first_backward_relief(placement.stages[s], kept.parts, grads_of)
                before_grads = sum(grads_of.get(n, 0) for n in placement.stages[s])  # the loss's runs before them
            if action.kind != BACKWARD_INPUT:
                backed.add(s)
            if action.kind == BACKWARD_INPUT:  # made by this pass, held to the W
                later = kept.recorded_output[s]  # (at the I, its gradients' figures count it)
                live += kept.recorded[s] - later
            elif action.kind == BACKWARD_WEIGHT:
                after += kept.recorded[s]
            if last and action.kind != BACKWARD_WEIGHT:
                # First the loss's backward, beside all it keeps; then the layers', the output's gradient held and
                # the loss's kept bytes freed (a zero-bubble input pass keeps its graph, theirs too, for the W).
                freed = kept.loss.kept if action.kind == BACKWARD else 0
                extra = max(kept.loss.extra - before_grads, kept.loss.grads - freed + extra - relief)
                loss_extra = max(kept.loss.extra, kept.loss.grads - freed)
            else:
                extra -= relief
            if action.kind != BACKWARD_INPUT:
                after += kept.held[s]
                if last:
                    pending.discard(action.mb)
                    loss_live -= kept.loss.kept
        levels.append(live + sum(of_batch.values()) + loss_live + extra)
        loss_levels.append(loss_live + loss_extra)
        live += later - after
    return levels, loss_levels


def _first_backward_relief(layers: Sequence[str], parts: KeptParts, grads_of: Mapping[str, int]) -> int:
    """What a stage's first backward holds less than every weight's gradient beside all its layers keep and its
    largest ``in_backward``: autograd makes a layer's gradients at that layer's backward, by which time the layers
    after it freed what they kept (less the output a layer keeps itself, a ReLU's, held to its own backward), and
    within a layer as its backward reaches them (``in_backward`` below 0). Counted at once, GPipe's first rank, an
    embedding's gradient (2 MiB, made last) beside its block's activations, was planned 1.03x its measured peak
    (tests/engine/test_plan_peak_memory.py). Its layers' own weights only: a tied weight's gradient stays counted
    whole."""
    own = [parts.own.get(n, 0) for n in layers]
    grads = [grads_of.get(n, 0) for n in layers]
    in_backward = [parts.in_backward.get(n, 0) for n in layers]  # (below 0: see KeptParts.in_backward)
    most = None
    for i, name in enumerate(layers):
        freed = max(sum(own[i + 1:]) - parts.kept_outputs.get(name, (0, 0, 0))[0], 0)
        at = in_backward[i] + sum(grads[i:]) - freed
        most = at if most is None else max(most, at)
    if most is None:
        return 0
    return max(max(max(in_backward), 0) + sum(grads) - most, 0)


def _kept_per_rank(
    step: Step, mesh: Mesh, params: Params, batch: Any, placement: Placement, layout: StateLayout, guessed: set[str],
) -> _Kept:
    """What the forward and the loss keep (see :class:`_Kept`). A loss that could not run on fake tensors adds
    ``LOSS_GUESSED`` and why to ``guessed`` (its figures a guess: the output and its gradient)."""
    inputs, targets = one_microbatch(step, mesh, batch)
    pipe = step.pipeline_spec
    # A zero-bubble schedule's input pass records, per micro-batch, the gradients its weight pass
    # starts from (model/split_backward.py), held to that W: counted with what the micro-batch keeps,
    # from its forward on (an upper bound: they are made at its I). The first stage has no input
    # pass (its input, the batch, needs no gradient): its W is a whole backward.
    split = _splits_backward(step, layout)
    with step.predicting(mesh):
        view = step.compute_view(step.local_view(params, mesh, 0))
        parts = predict_kept_parts(step.chain, view, inputs, split=split, loss=(step.loss_fn, targets),
                                   backward=True)
    assert parts.loss is not None
    if parts.loss.guessed:
        guessed.add(LOSS_GUESSED + parts.loss.guessed)
    per_stage = [sum(parts.own[n] + (parts.recorded.get(n, 0) if s > 0 else 0) for n in layers)
                 for s, layers in enumerate(placement.stages)]
    if pipe is None:
        per_rank = (sum(parts.own.values()) + _batch_bytes(parts.batch, step.chain.names),) * mesh.size
    else:
        # Micro-batches are views of one batch: what the stages keep of it is kept once.
        of_batch = [_batch_bytes(parts.batch, layers) for layers in placement.stages]
        per_index = pipe.kept_per_index(layout.schedule, per_stage, of_batch)
        per_rank = tuple(per_index[placement.index_of(mesh, r)] for r in range(mesh.size))
    # A stage's backward holds the gradient of its output beside its own: the next stage's backward made it (a
    # ReLU's, 32 MiB beside a Linear's input gradient and its own result, in a plain MLP); the last stage's is the
    # loss's (``loss.grads``).
    in_backward = [max((max(parts.in_backward.get(n, 0), 0) for n in layers), default=0)
                   + (0 if s == placement.last else parts.kept_outputs.get(layers[-1], (0, 0, 0))[2])
                   for s, layers in enumerate(placement.stages)]
    # A layer's output that it keeps itself (a ReLU's result) is held to its backward; where the next layer, on
    # this rank, keeps it as its input, that one counted it already from its forward to its backward (within).
    # A ReLU's result between two Linears was counted only to the second one's backward (a plain MLP's Plan 0.78
    # of its measured peak).
    recorded = [sum(parts.recorded.get(n, 0) for n in layers) if s > 0 else 0
                for s, layers in enumerate(placement.stages)]
    recorded_output = [parts.recorded_output.get(layers[-1], 0) if s > 0 else 0
                       for s, layers in enumerate(placement.stages)]
    held = [per_stage[s] - recorded[s] + sum(parts.kept_outputs.get(n, (0, 0, 0))[0]
                               - (parts.kept_outputs.get(n, (0, 0, 0))[1]
                                  if i > 0 or (s > 0 and placement.stage_rank[s - 1] == placement.stage_rank[s]) else 0)
                               for i, n in enumerate(layers))
            for s, layers in enumerate(placement.stages)]
    own_output = [parts.kept_outputs.get(layers[-1], (0, 0, 0))[0] for layers in placement.stages]
    return _Kept(per_rank, held, in_backward, parts.batch, parts.loss, parts.stand_ins, parts.backward_unknown,
                 recorded, recorded_output, own_output, parts)


def _batch_bytes(of_batch: Mapping[str, Mapping[int, int]], layers: Sequence[str]) -> int:
    """Bytes of the batch's storages that ``layers`` keep, each storage once."""
    return sum({key: n for layer in layers for key, n in of_batch[layer].items()}.values())


def _gathered_levels(actions: Sequence[Action], unit_bytes: Mapping[str, int]) -> list[int]:
    """At each action (after it), the bytes of the units gathered or on their way."""
    held: set[str] = set()
    levels = []
    for action in actions:
        if action.kind == GATHER and action.layer is not None:
            held.add(action.layer)
        elif action.kind == FREE and action.layer is not None:
            held.discard(action.layer)
        levels.append(sum(unit_bytes[u] for u in held))
    return levels
