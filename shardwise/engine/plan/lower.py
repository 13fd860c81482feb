"""Lowering: from a Step's whole transform stack to each rank's actions.

The passes run in a fixed order of roles (``engine/stack/compose.py``), whatever the
order the transforms were applied in:

1. placement: the pipeline spec says which layers each pipeline index holds
   and lists its computes and transfers (or, without one, every layer is a
   stage and each micro-batch runs forward, loss and backward in turn);
2. sharding: the shard_params spec inserts the gathers, frees and
   reduce-scatters of the rank's units around those computes;
3. the step's end, here: the tied weights' exchange, the remaining
   reductions, the gradients for the optimizer, the metrics' all-reduces, the
   update and (ZeRO-1/2) the all-gather of the updated shards, waited for at the
   step's end or (``overlap_gather``) before each bucket's first forward of the next
   step, at the top of the list.

:func:`annotate` then fills in what every communicating action moves (dtype and
bytes per tensor) from the parameters, the precision policy and the tensors
each stage boundary carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from ...collectives.mesh import Mesh
from ..layout.precision import compute_dtype
from ..layout.sharding import FlatSharding
from ..layout.state_layout import Placement
from ..model.chain import Chain
from ..optim.optimizers import updates_by_key, updates_in_place
from ..stack.compose import PLACEMENT, SHARDING, find, reshard_after_forward
from ..stack.splits import splits_of
from .actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    CHECK_REPLICAS,
    FINISH_GRADS,
    FORWARD,
    FREE,
    GATHER,
    GATHER_PARAMS,
    INSIDE,
    LOSS,
    RECV_ACTIVATION,
    RECV_GRAD,
    RECV_TIED,
    REDUCE_METRICS,
    REDUCE_REPLICAS,
    REDUCE_SCATTER,
    REPLICA_BINS,
    SEND_ACTIVATION,
    SEND_GRAD,
    SEND_TIED,
    SUM_TIED,
    UPDATE,
    WAIT_CHECK,
    WAIT_METRICS,
    WAIT_PARAMS,
    WAIT_REDUCE,
    WAIT_REPLICAS,
    WAIT_SENDS,
    Action,
    Boundary,
    Wire,
)


class Step(Protocol):
    """What the lowering reads of a step (engine/step/step.py's Step, which imports this module)."""

    @property
    def transforms(self) -> tuple[Any, ...]: ...

    @property
    def chain(self) -> Chain: ...

    @property
    def precision(self) -> Any: ...

    @property
    def update_needs_sums(self) -> bool: ...

    @property
    def optimizer(self) -> Any: ...

    def metric_exchange(self) -> Any: ...



def placement_of(step: Step, mesh: Mesh | None, params: Mapping[str, Any] | None) -> tuple[Placement, Any]:
    """(Placement, schedule or None) of the step on ``mesh``."""
    pipe = find(step.transforms, PLACEMENT)
    if pipe is None:
        return Placement.single(step.chain), None
    if mesh is None:
        raise ValueError(f"pipeline(axis={pipe.axis!r}) needs the mesh: call step.init(params, mesh)")
    return pipe.place(step.chain, mesh, params)


def microbatch_count(step: Step) -> int:
    """How many micro-batches each rank's batch is cut into."""
    pipe, zero = find(step.transforms, PLACEMENT), find(step.transforms, SHARDING)
    if pipe is not None:
        return int(pipe.microbatches)
    return 1 if zero is None else int(zero.accumulation)


def plain_computes(placement: Placement, microbatches: int, numbered: bool) -> list[Action]:
    """Each micro-batch in turn: every layer's forward, the loss, every layer's backward."""
    out: list[Action] = []
    for m in range(microbatches):
        mb = m if numbered else None
        out += [Action(FORWARD, layers[0], mb, s) for s, layers in enumerate(placement.stages)]
        out.append(Action(LOSS, None, mb))
        out += [Action(BACKWARD, placement.stages[s][0], mb, s) for s in reversed(range(len(placement.stages)))]
    return out


def stage_needs(chain: Chain, placement: Placement, units: Sequence[str]) -> dict[int, tuple[str, ...]]:
    """For every stage: the units that must be gathered for its layers to run (their own, and the
    units holding the weights they tie to)."""
    unit_set = set(units)
    needs: dict[int, tuple[str, ...]] = {}
    for s, layers in enumerate(placement.stages):
        wanted: list[str] = []
        for name in layers:
            for owner in (name, *(o for o, _ in chain[name].ties.values())):
                if owner in unit_set and owner not in wanted:
                    wanted.append(owner)
        needs[s] = tuple(wanted)
    return needs


def metric_axes(step: Step) -> tuple[str, ...]:
    """The axes the metrics' share is summed over: the pipeline's, the data-parallel one (and HSDP's
    replicas' axis, on which only index 0 counts the gradients: every index holds the same shards),
    then the splits' (on each, one index per group counts what they all compute alike:
    SplitRole.counts_replicated)."""
    pipe, zero = find(step.transforms, PLACEMENT), find(step.transforms, SHARDING)
    axes = tuple(spec.axis for spec in (pipe, zero) if spec is not None)
    if zero is not None and zero.replicate is not None:
        axes = (*axes, zero.replicate)
    return (*axes, *splits_of(step.transforms).axes)


def rank_actions(
    step: Step, placement: Placement, schedule: Any, index: int, units: Sequence[str] | None,
    device: torch.device | str = "cpu", sizes: Mapping[str, tuple[int, str]] | None = None,
) -> tuple[Action, ...]:
    """The actions of pipeline index ``index`` (every rank along the other axes runs the same list);
    ``units`` are the rank's ZeRO units (the layers it holds parameters of), under shard_params;
    ``device`` where the rank computes (shard_params' default of reductions in flight depends on it);
    ``sizes`` each unit's (bytes, dtype) of its gradient on the wire, which buckets are made of
    (None: unknown, each unit reduced alone)."""
    pipe, zero = find(step.transforms, PLACEMENT), find(step.transforms, SHARDING)
    if pipe is not None:
        actions = list(pipe.rank_computes(placement, schedule, index))
    else:
        actions = plain_computes(placement, microbatch_count(step), numbered=zero is not None)
    deferred: list[str] = []
    units = list(units or ())
    if zero is not None:
        tied_units = {owner for owner, _, users in placement.tied if index in users}
        # Stage 1 holds every full gradient until the end of the step, where it reduces them (in
        # buckets): issuing them during the backward would make it stage 2.
        deferred = units if zero.stage == 1 else [u for u in units if u in tied_units]
        actions = zero.insert(
            actions,
            stage_needs(step.chain, placement, units),
            reshard=reshard_after_forward(zero, pipelined=pipe is not None),
            pipelined=pipe is not None,
            holds_shards=zero_holds_shards(step),
            deferred=set(deferred),
            device=device,
        )
        actions = _sends_first(actions)
    if pipe is not None:
        actions.append(Action(WAIT_SENDS))
        for i, (owner, _name, users) in enumerate(placement.tied):
            if index in users:
                peers = [u for u in users if u != index]
                actions += [Action(SEND_TIED, owner, axis=pipe.axis, peer=p, tied=i) for p in peers]
                actions += [Action(RECV_TIED, owner, axis=pipe.axis, peer=p, tied=i) for p in peers]
                actions.append(Action(SUM_TIED, owner, tied=i))
    buckets: list[tuple[str, ...]] = [(u,) for u in units]
    if zero is not None:
        late = [(u,) for u in deferred]
        if sizes is not None:
            actions, buckets = _bucket_reductions(actions, zero, sizes)
            late = zero.buckets(deferred, sizes)
            buckets = [*buckets, *late]
        actions += [_bucket_action(REDUCE_SCATTER, b, zero.axis) for b in late]
        in_flight = zero.reductions_in_flight(device)
        actions = _waits_for_reductions(actions, zero.axis, deferred=len(late), in_flight=in_flight)
        if zero.replicate is not None:
            actions = _replica_reductions(actions, zero.replicate)
    actions.append(Action(FINISH_GRADS))
    split_axes = splits_of(step.transforms).axes
    # Each split's replicated gradients are compared over its axis.
    actions += [Action(CHECK_REPLICAS, axis=axis) for axis in split_axes]
    overlap = zero is not None and not zero_holds_shards(step) and zero.overlaps_gather(device)
    needs = stage_needs(step.chain, placement, units) if overlap else {}
    if overlap:  # gathered in the order the next forward needs them: the first bucket waits for one
        buckets = sorted(buckets, key=lambda b: _first_use(actions, b, needs))
    update, waits = _update_and_gathers(step, zero, units, buckets, device)
    if waits and overlap:
        actions = _waits_before_first_use(actions, waits, needs)
        waits = []
    axes = metric_axes(step)
    if not step.metric_exchange().empty and axes:
        actions.append(Action(REDUCE_METRICS, axis=axes[0]))
        rest = [Action(WAIT_METRICS), *(Action(REDUCE_METRICS, axis=a) for a in axes[1:])]
        # The update waits for the sums only when it uses them (clipping, the skip on a non-finite
        # gradient); otherwise the all-reduce completes while this rank updates.
        actions += [*rest, *update] if step.update_needs_sums else [*update, *rest]
    else:
        actions += update
    if split_axes:  # the replicated gradients agree before anything is updated
        at = next(i for i, a in enumerate(actions) if a.kind == UPDATE)
        actions[at:at] = [Action(WAIT_CHECK, axis=axis) for axis in split_axes]
    return (*actions, *waits)


def _update_and_gathers(
    step: Step, zero: Any, units: Sequence[str], buckets: Sequence[tuple[str, ...]], device: torch.device | str
) -> tuple[list[Action], list[Action]]:
    """(the update and the all-gathers of ZeRO-1/2's updated shards, their waits at the step's end;
    with ``overlap_gather`` the caller moves the waits into the next step's forward instead).

    A built-in optimizer (elementwise, its state keyed like the shards) updates one bucket at a
    time, and each bucket's all-gather is issued as soon as its shards are updated: it travels
    while the next bucket updates and the metrics complete (where the spec says so for
    ``device``: ``ShardSpec.updates_in_buckets``). Otherwise every shard is updated at once,
    then the all-gathers are issued together. A state that holds shards (``zero_holds_shards``)
    gathers none: the next step gathers what it computes with."""
    if zero is None or zero_holds_shards(step):
        return [Action(UPDATE)], []
    in_buckets = {u for b in buckets for u in b}
    gathered = [*buckets, *((u,) for u in units if u not in in_buckets)]
    gathers = [_bucket_action(GATHER_PARAMS, b, zero.axis) for b in gathered]
    waits = [_bucket_action(WAIT_PARAMS, b, zero.axis) for b in gathered]
    if gathers_into_params(step, device):  # one bucket at a time, written into the parameters
        return [Action(UPDATE), *(a for pair in zip(gathers, waits, strict=True) for a in pair)], []
    if not (zero.updates_in_buckets(device) and updates_by_key(step.optimizer)) or not gathered:
        return [Action(UPDATE), *gathers], waits
    update: list[Action] = []
    for b, gather in zip(gathered, gathers, strict=True):
        label = "+".join(b) if len(b) > 1 else None
        update += [Action(UPDATE, b[0], units=b if len(b) > 1 else (), label=label), gather]
    return update, waits


def zero_holds_shards(step: Step) -> bool:
    """Whether shard_params' state holds this rank's master shards at rest rather than whole
    parameters (``FlatSharding.holds_shards``): at stage 3, and at stages 1-2 under a precision policy
    that narrows, computing a layer that owns parameters in a dtype narrower than it stores them
    (bf16 or fp16 from float32). Those stages then hold float32 only in the shards, as DeepSpeed's
    bf16 ZeRO-1/2 and Megatron's distributed optimizer do, and each step gathers every unit in the
    compute dtype (half the bytes of a float32 all-gather), before its first forward, to its last
    backward. Whole float32 parameters beside whole compute copies held more than float32 ZeRO-2
    itself (407.9 against 371.4 MiB a rank on benchmarks/memory.py's 200 MB model at world 4).
    Decided over the whole model, so that every pipeline index holds alike."""
    zero = find(step.transforms, SHARDING)
    if zero is None:
        return False
    if zero.stage == 3:
        return True
    prec = step.precision
    if prec is None:
        return False
    return any(
        prec.for_layer(layer.name).compute.itemsize < prec.for_layer(layer.name).params.itemsize
        for layer in step.chain.layers if layer.owned_param_names
    )


def gathers_into_params(step: Step, device: torch.device | str) -> bool:
    """Whether ZeRO-1/2 writes the updated parameters into the parameters the step was given, one
    bucket at a time (each bucket's all-gather written into them and waited for before the next is
    issued: through shared memory straight from the peers' slots, elsewhere copied in at the wait),
    instead of handing on the gathered buffers beside them: the step's end then holds the
    parameters once, not twice, as FairScale's OSS does (it updates in place and broadcasts into the
    same tensors). Only where the optimizer updates in place (``inplace=True``: the state given is
    consumed, its tensors written, as torch's optimizers write a model's), the all-gathers are
    waited for at the step's end (not ``overlap_gather``) and the update runs at once."""
    zero = find(step.transforms, SHARDING)
    if zero is None or zero_holds_shards(step) or zero.gather_into_params is False or zero.overlaps_gather(device):
        return False
    if zero.updates_in_buckets(device) and updates_by_key(step.optimizer):
        return False
    return updates_in_place(step.optimizer)


def _first_use(actions: Sequence[Action], units: Sequence[str], needs: Mapping[int, tuple[str, ...]]) -> int:
    """The position of the first forward that uses one of ``units``, else of ``finish_grads``."""
    wanted = set(units)
    for i, a in enumerate(actions):
        if a.kind == FORWARD and wanted & set(needs.get(a.stage or 0, ())):
            return i
    return next(i for i, a in enumerate(actions) if a.kind == FINISH_GRADS)


def _waits_before_first_use(
    actions: list[Action], waits: Sequence[Action], needs: Mapping[int, tuple[str, ...]]
) -> list[Action]:
    """ZeRO-1/2 with ``overlap_gather``: each ``wait_params`` of the all-gathers the previous step
    issued at its end, just before the first forward that uses one of its units, so that the
    gather overlaps the forwards before it; a bucket no forward uses is waited for before the
    gradients are finished (the update then writes the shards that gather read)."""
    first: dict[int, list[Action]] = {}
    for wait in waits:
        first.setdefault(_first_use(actions, wait.units or (wait.require("layer"),), needs), []).append(wait)
    out: list[Action] = []
    for i, action in enumerate(actions):
        out += first.get(i, [])
        out.append(action)
    return out


def _bucket_action(kind: str, units: tuple[str, ...], axis: str, microbatch: int | None = None) -> Action:
    """A collective of one unit or of a bucket of them; ``microbatch`` names a micro-batch's share of
    a reduction (shard_params' ``reduce_each_microbatch``: the last one, unnamed, completes the shard)."""
    if len(units) == 1:
        return Action(kind, units[0], microbatch, axis=axis)
    return Action(kind, units[0], microbatch, axis=axis, units=units, label="+".join(units))


def _bucket_reductions(
    actions: list[Action], zero: Any, sizes: Mapping[str, tuple[int, str]]
) -> tuple[list[Action], list[tuple[str, ...]]]:
    """The backward's reduce-scatters grouped into the spec's buckets, each issued where its last
    unit's gradient is complete (that unit's own reduce-scatter was there); and the buckets."""
    # (Reduced each micro-batch, a unit's reduce-scatters come once per micro-batch, in the same order.)
    order = list(dict.fromkeys(a.require("layer") for a in actions if a.kind == REDUCE_SCATTER))
    buckets = zero.buckets(order, sizes)
    last = {b[-1]: b for b in buckets}
    out = []
    for a in actions:
        if a.kind != REDUCE_SCATTER:
            out.append(a)
        elif a.layer in last:
            out.append(_bucket_action(REDUCE_SCATTER, last[a.layer], zero.axis, a.microbatch))
    return out, buckets


def reduce_sizes(step: Step, sharding: FlatSharding | None) -> dict[str, tuple[int, str]] | None:
    """Each unit's (bytes, dtype) of its gradient on the wire: what buckets are made of."""
    if sharding is None:
        return None
    out = {}
    for u, lay in sharding.units.items():
        dtype = step.precision.for_layer(u).reduce if step.precision is not None else lay.dtype
        out[u] = (wire_of(lay.padded_numel, dtype).nbytes, f"{dtype}/{lay.dtype}")
    return out


def _waits_for_reductions(actions: list[Action], axis: str, deferred: int, in_flight: int) -> list[Action]:
    """A wait for each reduce-scatter: at most ``in_flight`` of the backward's in flight (0: each
    waited for right after it is issued and the gathers issued right after it, which travel beside
    it (a CPU's backward prefetch: ``ShardSpec.prefetches_backward_after``), before the next
    compute; else the oldest waited for just
    before another is issued), the last ``deferred`` ones (issued together at the end of the
    step) all at once, then waited for in order.

    A unit's full local gradient lives until its reduce-scatter is waited for: waiting for them
    all at the end kept the whole model's gradients at once (a ZeRO-3 rank's peak held the
    model's gradients, not its shards). One in flight, as FSDP2 on a GPU: each still has the
    next unit's backward to overlap with, for one unit's full gradient more at the peak. On gloo
    (an 8 x Linear(512) MLP, world 2, three paired runs of 30 steps, step time over FSDP2's):
    ZeRO-3 0.71 with one in flight, 0.70 with two or four, 0.71 with all; ZeRO-2 0.60, 0.57,
    0.53 and 0.56: within the noise, so none in flight is ZeRO-3's CPU default, and one ZeRO-2's,
whose extra buffer is at most a bucket (see ShardSpec.reductions_in_flight). The
    deferred ones (stage 1, tied units) come after the backward, where the full gradients are
    held anyway: all in flight."""
    out: list[Action] = []
    pending: list[Action] = []
    unwaited: Action | None = None  # none in flight: the reduction to wait for before the next action
    reductions = [i for i, a in enumerate(actions) if a.kind == REDUCE_SCATTER]
    bounded = set(reductions[: len(reductions) - deferred])
    for i, action in enumerate(actions):
        if unwaited is not None and action.kind != GATHER:  # a gather issued right after it overlaps it
            out.append(_wait_for(unwaited, axis))
            unwaited = None
        # (A unit's reduction of an earlier micro-batch is waited for before its next one is issued.)
        if i in bounded and in_flight > 0:
            while pending and (len(pending) >= in_flight or any(p.layer == action.layer for p in pending)):
                out.append(_wait_for(pending.pop(0), axis))
        out.append(action)
        if action.kind == REDUCE_SCATTER and action.layer is not None:
            if i in bounded and in_flight == 0:
                unwaited = action
            else:
                pending.append(action)
    if unwaited is not None:
        out.append(_wait_for(unwaited, axis))
    out += [_wait_for(a, axis) for a in pending]
    return out


def _wait_for(reduction: Action, axis: str) -> Action:
    return _bucket_action(WAIT_REDUCE, reduction.units or (reduction.require("layer"),), axis, reduction.microbatch)


def _replica_reductions(actions: list[Action], axis: str) -> list[Action]:
    """HSDP: each gradient shard all-reduced over the replicas' ``axis``, issued as soon as its
    reduce-scatter is waited for and waited for at the end of the backward, before the gradients
    are finished (FSDP2 waits for its all-reduce stream there too): they overlap the rest of the
    backward, and hold only shards (``memory["replica_buffers"]``)."""
    out: list[Action] = []
    issued: list[tuple[str, ...]] = []
    for action in actions:
        out.append(action)
        # (A micro-batch's share is summed into the next one's shard: the shard goes over the replicas once.)
        if action.kind == WAIT_REDUCE and action.microbatch is None:
            units = action.units or (action.require("layer"),)
            out.append(_bucket_action(REDUCE_REPLICAS, units, axis))
            issued.append(units)
    return out + [_bucket_action(WAIT_REPLICAS, units, axis) for units in issued]


# (compute kind, stage) -> every collective it issues inside its layers: (op, axis, label, wire)
Inside = Mapping[tuple[str, int], Sequence[tuple[str, str, str, Wire]]]


def insert_inside(actions: Sequence[Action], inside: Inside) -> tuple[Action, ...]:
    """``actions`` with, after each compute, the collectives its layers issue while it runs (each over
    its axis, labelled by the module that issues it): the executor skips these, the ledger has them."""
    loss_stage = next((s for kind, s in inside if kind == LOSS), 0)  # the last stage's
    out: list[Action] = []
    for a in actions:
        out.append(a)
        if a.kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            stage = a.require("stage")
        elif a.kind == LOSS:
            stage = loss_stage
        else:
            continue
        for op, axis, label, wire in inside.get((a.kind, stage), ()):
            out.append(Action(INSIDE, a.layer, a.microbatch, stage, axis, wire=(wire,), label=label, op=op))
    return tuple(out)


def _sends_first(actions: Sequence[Action]) -> list[Action]:
    """A compute's sends go straight after it, before the frees and reduce-scatters ZeRO put there:
    a peer waits for the transfer, nobody waits for the free."""
    out: list[Action] = []
    for action in actions:
        if action.kind in (SEND_ACTIVATION, SEND_GRAD):
            j = len(out)
            while j > 0 and out[j - 1].kind in (FREE, REDUCE_SCATTER):
                j -= 1
            out.insert(j, action)
        else:
            out.append(action)
    return out


# -- what each communicating action moves ------------------------------------------------------


def wire_of(shape: Sequence[int] | int, dtype: torch.dtype) -> Wire:
    numel = shape if isinstance(shape, int) else int(torch.Size(shape).numel())
    return Wire(str(dtype).removeprefix("torch."), numel * dtype.itemsize)


def annotate(
    actions: Sequence[Action],
    step: Step,
    placement: Placement,
    sharding: FlatSharding | None,
    master: Mapping[str, Any],
    boundaries: Sequence[Sequence[Boundary]] | None,
    metric_dtype: torch.dtype,
) -> tuple[Action, ...]:
    """``actions`` with the dtype and bytes of every tensor each communicating action moves.

    ``master`` is the rank's tree the optimizer updates (parameters, or ZeRO shards) as real or
    meta tensors; ``boundaries`` the tensors every stage boundary carries, per micro-batch (None:
    unknown, so transfers stay unannotated); ``metric_dtype`` the model-wide dtype of the metrics' exchange.
    """
    prec = step.precision

    def compute(layer: str, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(prec, layer, dtype)

    exchange = step.metric_exchange()
    metric_len = exchange.length
    out: list[Action] = []
    for a in actions:
        wire: tuple[Wire, ...] = ()
        if a.kind in (GATHER, REDUCE_SCATTER, GATHER_PARAMS, REDUCE_REPLICAS) and sharding is not None \
                and a.layer is not None:
            unit = sharding.units[a.layer]
            # A bucket's units share their dtypes (buckets are made so): its numels add up.
            together = [sharding.units[u] for u in a.units or (a.layer,)]
            if a.kind == GATHER:
                wire = (wire_of(unit.shard_numel, compute(a.layer, unit.dtype)),)
            elif a.kind == REDUCE_SCATTER:
                dtype = prec.for_layer(a.layer).reduce if prec is not None else unit.dtype
                wire = (wire_of(sum(u.padded_numel for u in together), dtype),)
            elif a.kind == REDUCE_REPLICAS:  # the reduce-scattered shards, still in the reduce dtype
                dtype = prec.for_layer(a.layer).reduce if prec is not None else unit.dtype
                wire = (wire_of(sum(u.shard_numel for u in together), dtype),)
            else:
                wire = (wire_of(sum(u.shard_numel for u in together), unit.dtype),)
        elif a.kind == REDUCE_METRICS:
            wire = (wire_of(metric_len, metric_dtype),)
        elif a.kind == CHECK_REPLICAS:
            # (sums, sums of magnitudes) of the replicated gradients in bins, and the batch's fingerprint
            wire = (wire_of(2 * REPLICA_BINS + 1, torch.float64),)
        elif a.kind in (SEND_TIED, RECV_TIED) and a.tied is not None:
            owner, name, _ = placement.tied[a.tied]
            shape, dtype = _param_shape(sharding, master, owner, name)
            wire = (wire_of(shape, compute(owner, dtype)),)
        elif a.kind in (SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD, RECV_GRAD) and boundaries is not None:
            assert a.stage is not None and a.microbatch is not None
            # Boundary b is what stage b passes to stage b + 1; a gradient travels back over it.
            b = a.stage if a.kind in (SEND_ACTIVATION, RECV_GRAD) else a.stage - 1
            grads = a.kind in (SEND_GRAD, RECV_GRAD)
            boundary = boundaries[a.microbatch][b]
            carried = boundary.grad_leaves() if grads else boundary.leaves
            wire = tuple(wire_of(shape, dtype) for shape, dtype in carried)
        out.append(dataclasses.replace(a, wire=wire) if wire else a)
    return tuple(out)


def _param_shape(
    sharding: FlatSharding | None, master: Mapping[str, Any], owner: str, name: str
) -> tuple[tuple[int, ...], torch.dtype]:
    if sharding is not None and owner in sharding.units:
        unit = sharding.units[owner]
        return tuple(unit.shapes[unit.names.index(name)]), unit.dtype
    t = master[owner][name]
    return tuple(t.shape), t.dtype
