"""What one call of a step gives the executor: made from the step, its TrainState and the batch.

:func:`rank_run` is what a rank's run reads of its layout and of the step's stack (its Plan
actions, what the metrics count, the replica check's selection, whose random streams it draws);
it depends on the layout and on what the step exchanges only, so it is made once per layout and
kept in the layout's cache. :func:`prepare_run` adds what changes every call (the rank's
micro-batches, where its layers read their parameters, the loss scale, the step's seed, the
optimizer's update) and :func:`finish_run` turns the executor's results into the new TrainState
and the metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives.backends.current import current_backend
from ...collectives.mesh import Mesh
from ..layout.devices import device_of, host_scalar
from ..layout.in_flight import InFlightParams
from ..layout.precision import StaticLossScale
from ..layout.sharding import FlatSharding
from ..layout.state import TrainState
from ..layout.state_layout import ModelTag, StateLayout, unit_names
from ..model.batch_loss_terms import own_loss_refused
from ..model.given_params import given_of
from ..model.whole_batch import called_modules
from ..optim.optimizers import join_parts, state_part
from ..plan.actions import Action
from ..plan.batches import split_over
from ..plan.lower import gathers_into_params, metric_axes, microbatch_count, rank_actions, reduce_sizes
from ..run.bindings import StageBindings
from ..run.executor import Executor
from ..run.heap import keep_freed
from ..run.loss_rows import LossProbe
from ..run.metrics import MetricExchange, Summed, batch_fingerprint, different_batches, different_steps
from ..run.own_loss_count import OwnCount, own_count_of
from ..run.param_source import ParamSource
from ..run.rng import mix
from ..run.send_delivery import Key, grad_sends_delivered
from ..run.step_end import ReplicaCheck
from ..run.wide_grads import summed_in
from ..stack import in_layer
from ..stack.compose import cutting_the_batch
from ..stack.in_layer import BatchShares
from .batch_cut import batch_multiple, batch_shares, cut_words, loss_probe_cut, rank_share, refuse_padded_mean
from .donation import donates
from .dynamic_rope_rows import refuse_dynamic_rope_rows
from .held_levels import scales_gradients
from .layouts import output_shapes
from .master import compute_params, unscale_like
from .sequence_cut import refuse_rows_on_sequence_dim
from .state_check import check_layout

if TYPE_CHECKING:
    from .step import Metrics, Step


@dataclass(frozen=True)
class RankRun:
    """What a rank's run reads of its layout and of the step's stack (see :func:`rank_run`)."""

    actions: tuple[Action, ...]  # this rank's Plan actions
    exchange: MetricExchange  # what the ranks sum after the backward
    metric_axes: tuple[str, ...]  # the axes they sum it over
    replica_layers: frozenset[str]  # layers of which this rank holds only tied copies
    reduce_dtypes: Mapping[str, torch.dtype] | None  # under ZeRO and a precision policy: per unit
    # Under a precision policy reducing in a wider dtype than it computes in: per layer, that dtype, in which its
    # micro-batches' gradients are summed (run/wide_grads.py); None where none does.
    accumulate_dtypes: Mapping[str, torch.dtype] | None
    counted: Any  # the gradients this rank's metrics count (None: all), see Splits.counted
    counts_losses: bool  # whether it counts its losses and tokens also then: the splits cut the batch
    replicas: Mapping[str, ReplicaCheck]  # per split axis, the gradients that must agree over it
    rng_rank: int | None  # the rank whose random streams this one draws (None: its own)
    into_params: bool  # ZeRO-1/2 gathers into the parameters it was given (as ``actions`` lists it)
    # A pipeline's receives, and the gradient sends each proves delivered (run/send_delivery.py)
    sends_delivered_by: Mapping[Key, tuple[Key, ...]]


def rank_run(step: Step, layout: StateLayout, mesh: Mesh | None, device: torch.device) -> RankRun:
    """This rank's :class:`RankRun` on ``device`` (where its parameters are: how many reductions the
    lowering keeps in flight depends on it), made once per layout and per what the step exchanges."""
    exchange = step.metric_exchange()
    key = ("rank run", layout.index_of(mesh), exchange, step.update_needs_sums, device.type)
    made = layout.cache.get(key)
    if made is None:
        made = layout.cache[key] = _make_rank_run(step, layout, mesh, exchange, device)
    assert isinstance(made, RankRun)
    return made


def _make_rank_run(
    step: Step, layout: StateLayout, mesh: Mesh | None, exchange: MetricExchange, device: torch.device
) -> RankRun:
    placement, sharding, prec, split = layout.placement, layout.sharding, step.precision, step.split
    index = layout.index_of(mesh)
    keys = split.counted(step.base_chain, mesh)
    counted = None if keys is None else gradient_selection(keys, layout, mesh)
    counts_losses = split.counts_losses(mesh)
    if sharding is not None and sharding.replicate is not None and mesh is not None \
            and mesh.axis_index(sharding.replicate) != 0:
        # HSDP: every index of the replicas' axis holds the same all-reduced shards, which index 0
        # counts (in the norm, the finite check); each index counts its own losses and tokens (its
        # own rows of the batch), unless the split says this rank counts none.
        counts_losses = counts_losses if counted is not None else True
        counted = {}
    return RankRun(
        actions=rank_actions(
            step, placement, layout.schedule, index, unit_names(sharding), device, reduce_sizes(step, sharding)
        ),
        exchange=exchange,
        into_params=gathers_into_params(step, device),
        metric_axes=metric_axes(step),
        replica_layers=frozenset(o for o, _ in placement.replicas_of(index)),
        reduce_dtypes=None if prec is None or sharding is None else {
            u: prec.for_layer(u).reduce for u in sharding.units
        },
        accumulate_dtypes={
            layer: dtype for layer in step.chain.names if (dtype := summed_in(prec, layer)) is not None
        } or None,
        counted=counted,
        counts_losses=counts_losses,
        replicas={
            r.axis: ReplicaCheck(gradient_selection(r.keys, layout, mesh), r.by, r.fix)
            for r in split.replica_checks(step.base_chain)
        },
        rng_rank=split.rng_rank(mesh),
        sends_delivered_by={} if layout.schedule is None else grad_sends_delivered(
            layout.schedule, index, placement.backward_from),
    )


def gradient_selection(keys: frozenset[tuple[str, str]], layout: StateLayout, mesh: Mesh | None) -> Any:
    """This rank's gradients of the parameters ``keys`` (by owner layer and local name): their keys,
    or under ZeRO per unit the ranges of its flat shard."""
    sharding = layout.sharding
    if sharding is None:
        return frozenset((s.layer, s.name) for s in layout.leaves.values() if (s.layer, s.name) in keys)
    assert mesh is not None
    index = mesh.axis_index(sharding.axis)
    return {
        u: lay.ranges_in_shard(frozenset(n for n in lay.names if (u, n) in keys), index)
        for u, lay in sharding.units.items()
    }


def local_microbatches(step: Step, mesh: Mesh | None, sharding: FlatSharding | None, batch: Any) -> tuple[
        list[tuple[Any, Any]], int]:
    """(this rank's micro-batches, the replicas of the mean): its share of the global batch
    (batch_cut.rank_share: shard_params' axis, then the split's cut), then cut into the pipeline's
    micro-batches or shard_params' accumulation."""
    pair, replicas = rank_share(step, mesh, batch, None)
    k = microbatch_count(step)
    whole = batch_multiple(step, mesh)
    pipelined = step.pipeline_spec is not None
    what = f"pipeline(microbatches={k})" if pipelined else f"shard_params(accumulation={k}) on the local batch"
    if k == 1 and sharding is None:
        return [pair], replicas
    return [split_over(pair, k, j, what, whole) for j in range(k)], replicas


def param_source(step: Step, state: TrainState, sharding: FlatSharding | None) -> tuple[Any, ParamSource]:
    """(what the optimizer updates, where the layers read their parameters) of this rank's state."""
    prec = step.precision
    params = state.params
    if isinstance(params, InFlightParams):
        if sharding is not None and not sharding.holds_shards and not params.exposed:
            # ZeRO-1/2 after an overlapped step: the update starts from the shards that step made
            # (the ones its all-gathers carry), and each bucket's parameters join the compute copies
            # at its wait_params (executor: wait_params), before its first forward.
            incoming = params if params.in_flight else None
            return dict(params.shards), ParamSource(
                compute=dict(compute_params(prec, params.ready())), sharding=sharding, incoming=incoming,
                cast=functools.partial(compute_params, prec), copies=prec is not None,
            )
        params = params.copy()  # read by someone (so complete): cut again, as any other state's
    if sharding is None:
        return params, ParamSource(compute=compute_params(prec, params))
    # Gathered into the parameters it was given, ZeRO-1/2 updates its shards where they lie in them
    # (laid out by init: views, updated in place); handed on, the next state's parameters are
    # other tensors, and views would keep these alive beside them: cut.
    views = not sharding.holds_shards and gathers_into_params(step, device_of(params))
    master = sharding.my_shards(params, state.mesh.axis_index(sharding.axis), views)
    if sharding.holds_shards:
        # Each unit's compute copy is cast as its gather is issued (ParamSource.gather_input), before
        # it travels (half the bytes in bf16), and lives only while the gather is in flight.
        dtypes = None if prec is None else {u: prec.for_layer(u).compute for u in master}
        return master, ParamSource(sharding=sharding, gather_from=master, gather_dtypes=dtypes)
    return master, ParamSource(compute=compute_params(prec, params), sharding=sharding, copies=prec is not None)


@dataclass
class PreparedRun:
    """One call of a step, ready to run: its executor, the rank's cached run, and what the update
    made besides the new master tree (the optimizer state, the loss scale)."""

    executor: Executor
    rank: RankRun
    replicas: int  # the data-parallel replicas the batch was cut into (0: none)
    outcome: dict[str, Any]
    shares: BatchShares  # how the batch is shared out: what a compute's statistic of the whole batch sums over

    def run(self) -> None:
        with in_layer.sharing_batch(self.shares):
            self.executor.run(self.rank.actions)

    @property
    def updated(self) -> bool:
        """Whether the optimizer ran (and, in place, wrote into the state it was given)."""
        return "updating" in self.outcome

    def written(self) -> list[Any]:
        """What the update made (the new master tree and optimizer state, or their parts): an
        in-place optimizer's are the given state's own tensors."""
        trees = [self.executor.new_master, self.outcome.get("opt_state"), self.outcome.get("opt_parts")]
        return [t for t in trees if t is not None]


def prepare_run(step: Step, state: TrainState, layout: StateLayout, batch: Any) -> PreparedRun:
    """The executor of this call on ``batch``, with the rank's cached :class:`RankRun`."""
    mesh: Mesh | None = state.mesh
    _check_world(mesh)
    check_layout(step, state, layout)  # a state cast or replaced by hand
    sharding, pipe = layout.sharding, step.pipeline_spec
    refuse_padded_mean(step, mesh, batch)
    refuse_dynamic_rope_rows(step, layout, mesh, batch)
    micro, replicas = local_microbatches(step, mesh, sharding, batch)
    refuse_rows_on_sequence_dim(step, layout, mesh, micro[0][0])
    master, source = param_source(step, state, sharding)
    device = device_of(master)
    run = rank_run(step, layout, mesh, device)
    if device.type == "cpu":
        _keep_step_memory(layout, mesh, state)
    scale, k = step.loss_scale_value(state), microbatch_count(step)
    if step.token_weighted and scales_gradients(step):
        scale /= token_sum_divisor(micro)  # (seeded and unscaled alike: only the backward's magnitude changes)
    outcome: dict[str, Any] = {}

    def update(grads: Any, summed: Summed, units: tuple[str, ...] | None = None) -> Any:
        """The new master tree, or with ``units`` (ZeRO-1/2, a bucket at a time) those units' part
        of it; finish_run joins the parts' optimizer states."""
        if "updating" not in outcome:
            # Before the first write where the fingerprints are in already (a clipped or scaled step):
            # an in-place optimizer writes into ``state``, which a refusal after it would leave
            # consumed (Step.__call__ then marks it so: a retry is refused, not another model).
            _check_same_batches(mesh, run.metric_axes, summed)
            outcome["updating"] = True
        norm = summed.norm
        if step.token_weighted:  # the gradients of the summed losses: divide by the global count
            grads, norm = divided_by_tokens(grads, norm, summed)
        if units is None:
            new_master, outcome["opt_state"], outcome["loss_scale"] = step.finish(
                state, grads, master, norm, summed.finite)
            return new_master
        part = state_part(state.opt_state, units)
        new_master, opt_part, outcome["loss_scale"] = step.finish(
            state, grads, {u: master[u] for u in units}, norm, summed.finite, opt_state=part)
        outcome.setdefault("opt_parts", []).append(opt_part)
        outcome.setdefault("updated", []).extend(units)
        return new_master

    executor = Executor(
        chain=step.chain, loss_fn=step.loss_fn, mesh=mesh, placement=layout.placement, source=source,
        microbatches=micro,
        # A mean loss counts 1/(replicas x micro-batches) of the step; a token sum is divided
        # by the global count in the update instead.
        seed=scale if step.token_weighted else scale / (max(replicas, 1) * k),
        whole_seed=scale, static_scale=isinstance(state.loss_scale, StaticLossScale),
        finalize=lambda grads: unscale_like(grads, master, scale), update=update,
        master=master, held=state.params, grad_scale=scale, reduce_dtypes=run.reduce_dtypes,
        accumulate_dtypes=run.accumulate_dtypes if len(micro) > 1 else None,
        into_params=run.into_params, sends_delivered_by=run.sends_delivered_by,
        metric_dtype=layout.metric_dtype, exchange=run.exchange, metric_axes=run.metric_axes,
        replica_layers=run.replica_layers,
        boundaries=None if pipe is None else _boundaries(step, layout, micro, mesh),
        poison=bool(pipe is not None and pipe.poison),
        # (under a split, off: its name, for the refusal of a micro-batch unlike the example; inline: the hot path)
        follow_batches=bool(pipe is not None and pipe.follow_batches) and (
            step.split.name if step.split.parts else True), record=step.traced,
        tokens=step.tokens if step.token_weighted else None,
        rng_seed=None if state.rng is None else mix(state.rng, state.step), counted=run.counted,
        counts_losses=run.counts_losses,
        # Summed with the metrics (and, under a split, compared in its replica check).
        batch_fingerprint=batch_fingerprint(batch) if run.exchange.batch or run.replicas else None,
        step_digest=step.agreement_digest if run.exchange.batch else None,
        rng_rank=run.rng_rank, replicas=run.replicas,
        bindings=_bindings(step, layout, mesh, source),
        loss_probe=_loss_probe(step, layout, mesh),
        given_params=given_of(step.base_chain),
        param_writes_refused=_param_writes_refused(step, mesh),
        frequency_cut=next((words for _, words in cutting_the_batch(step.transforms)), None),
        batch_cut=_batch_cut(step, layout, mesh),
        # On a layout's first call on this thread and mesh: the executor walks each backward's graph for another
        # stage's or rank's leaves (run/cut_graphs.py), and marks it done through this; None after (no call).
        graph_watch=None if (watch := ("graph watch", threading.get_ident(), id(mesh))) in layout.cache else
        functools.partial(layout.cache.__setitem__, watch, True),
    )
    return PreparedRun(executor, run, replicas, outcome, batch_shares(step, mesh))


def token_sum_divisor(micro: list[tuple[Any, Any]]) -> float:
    """What a token-weighted step's loss scale is divided by before seeding its summed losses: about the tokens
    of a micro-batch, the power of two nearest the elements of its largest integer (label) tensor, the targets'
    first, then the inputs', else of its largest floating target without its last dim (a distribution over a
    vocabulary: its rows); the same on every rank, whose shares are cut alike, and a power of two, so that the
    scale and the unscaling stay exact. Seeded with the loss scale alone, a sum over thousands of tokens made f16
    gradients that many times a mean's: every step skipped under a static scale a mean loss trains with (65536),
    without an error, and a dynamic scale backed off 32x on 128 tokens."""
    inputs, targets = micro[0]

    def tensors(tree: Any) -> list[torch.Tensor]:
        return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim()]

    labels = [t.numel() for t in tensors(targets) if not t.is_floating_point()] or [
        t.numel() for t in tensors(inputs) if not t.is_floating_point()]
    sizes = labels or [t.numel() // (t.shape[-1] if t.dim() > 1 else 1) for t in tensors(targets)]
    return float(2 ** round(math.log2(max(sizes, default=1) or 1)))


def _param_writes_refused(step: Step, mesh: Mesh | None) -> str | None:
    """None for the one-device step without transforms, whose leaves are the parameters the update reads
    (a write in forward persists, as in torch); else the layout in words, where it is refused
    (run/param_writes.py)."""
    if not step.transforms and (mesh is None or mesh.size == 1):
        return None
    names = ", ".join(dict.fromkeys(str(s.name) for s in step.transforms))
    return f"under {names}," if names else "on a mesh of several ranks,"


def _batch_cut(step: Step, layout: StateLayout, mesh: Mesh | None) -> str | None:
    """How the step cuts the batch into the shares a layer's call sees, in words, or None where every call
    sees the whole batch (run/first_call_state.py); kept per layout and rank."""
    key = ("batch cut", layout.index_of(mesh))
    if key not in layout.cache:
        layout.cache[key] = " x ".join(cut_words(step, mesh)) or None
    found = layout.cache[key]
    return found if isinstance(found, str) else None


def _boundaries(step: Step, layout: StateLayout, micro: list[tuple[Any, Any]], mesh: Mesh | None) -> Any:
    """Each micro-batch's predicted stage outputs (a model may leave a mask out of some of them), or None
    where they cannot be predicted: then every transfer is announced."""
    found = [step.boundaries(layout, inputs, mesh) for inputs, _ in micro]
    return None if any(b is None for b in found) else found


def _loss_probe(step: Step, layout: StateLayout, mesh: Mesh | None) -> LossProbe | None:
    """The probe that loss_fn is a mean over the rows (run/loss_rows.py), kept per layout, rank and loss
    until it has run once (a rank that computes no loss, a pipeline's first stage, keeps it unused: one
    lookup a call); None where it does not apply (batch_cut.loss_probe_cut) or has run."""
    key = ("loss probe", layout.index_of(mesh), id(step.loss_fn), id(step.tokens))  # (a loss may not hash)
    made = layout.cache.get(key)
    if made is None:
        cut = loss_probe_cut(step, mesh)
        # A split's layers run on fake tensors only inside its predicting block, and note what they ran
        # (tensor parallel: whether the head left the logits split, which the loss reads next): under a
        # split the probe tells the rows without a fake run.
        predict = _no_prediction if step.split.parts else functools.partial(output_shapes, step, layout)
        # A Hugging Face CTC head's own loss, which the probe cannot see (a scalar the model computed)
        counted = step.tokens is not None and not isinstance(step.tokens, str)
        own = None if cut is None else next(
            (found for _, m in called_modules(step.base_chain) if (found := own_loss_refused(m, counted))), None)
        own_count = None if cut is None else own_count_of(m for _, m in called_modules(step.base_chain))
        made = layout.cache[key] = False if cut is None else LossProbe(
            cut, functools.partial(layout.cache.__setitem__, key, False), predict, own,
            own_count=own_count if isinstance(own_count, OwnCount) else None,
        )
    return made if isinstance(made, LossProbe) else None


def _no_prediction(inputs: Any) -> None:
    """No shapes predicted (the probe's rule without them applies: run/loss_rows.py)."""
    return None


def _bindings(step: Step, layout: StateLayout, mesh: Mesh | None, source: ParamSource) -> StageBindings | None:
    """The last step's leaves and bound layers, to be reused (run/bindings.py): one device, no ZeRO,
    an in-place optimizer (whose next step reads the same parameter tensors), no precision policy
    (whose compute copies are new each step: kept, they would hold a copy of the model between
    steps). One per thread: thread ranks may step states of one layout at once."""
    if mesh is not None or source.sharding is not None or source.compute is None or not donates(step) \
            or step.precision is not None:
        return None
    key = ("bindings", threading.get_ident())
    bindings = layout.cache.get(key)
    if bindings is None:
        bindings = layout.cache[key] = StageBindings()
    assert isinstance(bindings, StageBindings)
    return bindings


def _keep_step_memory(layout: StateLayout, mesh: Mesh | None, state: TrainState) -> None:
    """Once per layout and rank: glibc keeps what a step frees (about its parameters' bytes in
    gradients) for the next step, instead of giving it back and faulting it in again (run/heap.py).

    Asked for four times the parameters' bytes: the free chunk at the top of the heap also holds
    what the rest of the process freed next to the gradients (another model stepped in the same
    process, as the benchmarks do, or the data pipeline), and a top chunk past the trim threshold
    (twice the request) goes back to the OS whole: with one times, the pipeline benchmark's MLP
    faulted its 4 MB of gradients in again every step on one rank."""
    key = ("keep freed", layout.index_of(mesh))
    if key not in layout.cache:
        layout.cache[key] = True
        keep_freed(4 * sum(t.nbytes for t in optree.tree_leaves(state.params) if isinstance(t, torch.Tensor)))


def finish_run(step: Step, state: TrainState, prepared: PreparedRun) -> tuple[TrainState, Metrics]:
    """The new TrainState and the metrics, once the prepared run ran."""
    mesh, executor, summed = state.mesh, prepared.executor, prepared.executor.summed
    _check_same_batches(mesh, prepared.rank.metric_axes, summed)
    if step.token_weighted:
        count = token_count(summed)
        loss = None if summed.loss_sum is None else summed.loss_sum / count.to(summed.loss_sum.dtype)
        norm = None if summed.norm is None else summed.norm / count.to(summed.norm.dtype)
        metrics = step.report(loss, norm)
    else:
        metrics = step.report(summed.mean_loss(max(prepared.replicas, 1) * microbatch_count(step)), summed.norm)
    if state.layout.sharding is not None:
        metrics["peak_gathered_bytes"] = host_scalar(executor.peak_gathered_bytes)
    if step.precision is not None:
        metrics["loss_scale"] = host_scalar(step.loss_scale_value(state))
        metrics["skipped"] = host_scalar(not summed.finite)
    if step.traced:
        metrics["trace"] = executor.events  # type: ignore[assignment]
        # Every action with its position in this rank's list: a measured timeline of the Plan.
        metrics["action_times"] = executor.action_times  # type: ignore[assignment]
    outcome = prepared.outcome
    if "opt_parts" in outcome:  # updated bucket by bucket: every unit exactly once
        keys = list(executor.master)
        if sorted(outcome["updated"]) != sorted(keys):
            raise RuntimeError(f"the update by buckets covered units {outcome['updated']}, not this rank's {keys}")
        outcome["opt_state"] = join_parts(outcome["opt_parts"], keys)
    layout = state.layout
    ref, base = layout.model.ref, step.chain if step.source_chain is None else step.source_chain  # (no calls: hot path)
    if ref is None or ref() is not base:
        # Stepped by another step than its layout's (another model's, on a state of the same shapes): trained with
        # this step's buffers and frozen parameters now, its checkpoint is this model's (checkpoint/model_of_state).
        layout = dataclasses.replace(layout, model=ModelTag(step.base_chain))
    new_state = state._replace(
        params=_next_params(layout.sharding, executor),
        opt_state=outcome["opt_state"], step=state.step + 1,
        loss_scale=prepared.outcome["loss_scale"], layout=layout,
    )
    return new_state, metrics


def _next_params(sharding: FlatSharding | None, executor: Executor) -> Any:
    """The new state's parameters: under ZeRO-1/2 an ``InFlightParams`` (``_in_flight``)."""
    zero_12 = sharding is not None and not sharding.holds_shards and executor.new_master is not None
    if zero_12 and (executor.params_in_flight or executor.new_held is not None):
        return _in_flight(executor)
    if zero_12:  # nothing gathered: no unit holds a parameter that trains (all frozen), they stay as given
        held = executor.held
        return held.settle() if isinstance(held, InFlightParams) else held
    return executor.new_held


def _in_flight(executor: Executor) -> InFlightParams:
    """ZeRO-1/2: the new full parameters, gathered at the step's end or (``overlap_gather``) as the
    step's all-gathers still in flight will bring them, beside the shards the update made, which
    those gathers carry. The next update starts from the shards instead of cutting them again out
    of the full parameters (a copy of 1/world of the model per step) unless the parameters were read
    in between. The step held the shards through its end anyway (the Plan's ``master_shards``), so
    the peak is the same; at rest they are 1/world of the parameters more, unless they are views
    of them (gathered into the parameters: ``FlatSharding.shards_in``)."""
    if not executor.params_in_flight:
        full = executor.new_held
        return InFlightParams(full, [], executor.new_master, tuple(full))
    held = executor.held
    old = held.settle() if isinstance(held, InFlightParams) else held  # every bucket was waited for
    gathered = {u for bucket, _ in executor.params_in_flight for u in bucket.names}
    base = {k: v for k, v in old.items() if k not in gathered}
    return InFlightParams(base, executor.params_in_flight, executor.new_master, tuple(old))


def token_count(summed: Summed) -> torch.Tensor:
    """The global token count of a token-weighted step, refused when there is none to learn from."""
    count = summed.count
    assert count is not None, "a token-weighted step exchanges its token count"
    if not bool(count > 0):
        raise ValueError(
            "the global batch has no token to learn from (the token count is 0: every label is padding); "
            "skip such batches or check the labels"
        )
    return count


def divided_by_tokens(grads: Any, norm: torch.Tensor | None, summed: Summed) -> tuple[Any, torch.Tensor | None]:
    """The gradients (and norm) of the summed losses of a token-weighted step, divided by the global count."""
    count = token_count(summed)
    grads = optree.tree_map(lambda g: g / count.to(g.dtype), grads)
    return grads, None if norm is None else norm / count.to(norm.dtype)


def _check_world(mesh: Mesh | None) -> None:
    """Refuse a TrainState of another world (one torch.save'd on another mesh): it holds one
    rank's shards of its own mesh, which only sw.checkpoint reshards."""
    if mesh is None:  # a single-device state: every rank may run its own
        return
    world = current_backend().world_size
    if mesh.size != world:
        raise ValueError(
            f"this TrainState was made on {mesh!r} ({mesh.size} ranks), but this program runs on "
            f"a world of {world}: a state (a torch.save'd one too) holds one rank's part of its "
            "own mesh; to go on with another mesh, save it on that mesh with "
            "sw.checkpoint.save(path, state, step) and load it with "
            "sw.checkpoint.load(path, step, mesh), which reshards"
        )


def _check_same_batches(mesh: Mesh | None, axes: tuple[str, ...], summed: Summed) -> None:
    """Refuse a step whose ranks called steps built differently, or passed different batches (their
    summed digests and fingerprints say so)."""
    if mesh is None or summed.batch is None:
        return
    group = _exchange_group(mesh, axes)
    if summed.steps_differ(group):  # first: another step may also have cut another batch
        raise ValueError(different_steps())
    if summed.batches_differ(group):
        raise ValueError(different_batches())


def _exchange_group(mesh: Mesh, axes: tuple[str, ...]) -> list[int]:
    """The ranks whose shares the calling rank's metrics exchange sums: those that differ from it
    on ``axes`` only."""
    me = mesh.coords
    return [r for r in range(mesh.size) if all(c == me[a] for a, c in mesh.coords_of(r).items() if a not in axes)]

