"""The one executor: runs one rank's actions of any Plan, on any backend.

It dispatches on action kinds (``engine/plan/actions.py``); every transform that
communicates has put its collectives into the Plan as actions, so this is the
only place a step's computation and communication happen.

Compute. Each (stage, micro-batch) forward keeps its own autograd graph, cut at
the stage input, so its backward runs whenever the plan says: as one ``B``, or
as ``I`` (the input gradient, handed upstream at once; the graph is kept) and
later ``W`` (the weight gradients). Without a pipeline every layer is its own
stage, which is where ZeRO gathers and frees parameters. Whole backwards of one
micro-batch on consecutive stages with nothing between them in the plan run as
one autograd call (their forwards leave those inputs on the graph,
:func:`joined_backwards`): a ZeRO-1 or unsharded backward is one call, a ZeRO-2
one one per gradient bucket (except when the step is traced, which times each). Every micro-batch's
forward uses the same leaf per parameter for the whole step, and weight
gradients go into that leaf's ``.grad`` (``autograd.backward(inputs=)``), so
micro-batches accumulate in place as torch's modules accumulate ``.grad``. Each
micro-batch's loss is seeded with ``loss_scale / (replicas x micro-batches)``, so
the step equals the single-device step on the whole batch (a token-weighted
step seeds its summed losses with the loss scale alone and divides by the global
token count in the update). Kernels and the order of
accumulation are those of one ``loss.backward()``: results are bitwise equal.

Parameters come from a :class:`ParamSource`: the compute copies, or ZeRO-3
shards gathered unit by unit into flat buffers that ``free`` really releases
(and a later gather refills in place: earlier graphs hold views of them, as in
FSDP). Transfers between pipeline ranks go through ``send``/``recv`` with the
peers the Plan names; each receive is posted a few receives before its wait.
The one :class:`Executor` is this module's dispatch and forward, with mixins
for the rest: ``stage_backward.py`` (B, I, W), ``loss_action.py``, ``zero.py``
(ZeRO's gathers, frees and reductions), ``transfers.py`` (the pipeline's sends
and receives) and ``step_end.py`` (the gradients, replica checks, metrics and
update); ``run_shape.py`` reads which computes of an actions list run joined.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import optree
import torch

from ...collectives import Handle
from ...collectives.mesh import Mesh
from ...collectives.mesh_context import use_mesh
from ...collectives.timing import timing
from ..layout.buckets import Bucket
from ..layout.devices import device_of
from ..layout.state_layout import Placement
from ..model.chain import Chain
from ..model.given_params import Given
from ..model.module_call import calls_forward_alone
from ..plan.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    CHECK_REPLICAS,
    COMPUTES,
    FINISH_GRADS,
    FORWARD,
    FREE,
    GATHER,
    GATHER_PARAMS,
    LOSS,
    RECV_ACTIVATION,
    RECV_GRAD,
    RECV_TIED,
    REDUCE_METRICS,
    REDUCE_REPLICAS,
    REDUCE_SCATTER,
    SEND_ACTIVATION,
    SEND_GRAD,
    SEND_TIED,
    SHORT,
    SUM_TIED,
    UPDATE,
    WAIT_CHECK,
    WAIT_GATHER,
    WAIT_METRICS,
    WAIT_PARAMS,
    WAIT_REDUCE,
    WAIT_REPLICAS,
    WAIT_SENDS,
    Action,
    Boundary,
)
from ..torch_api import version_of
from .batch_keys import unknown_keys_message
from .bindings import BoundStage, StageBindings
from .cut_graphs import note_leaves
from .first_call_state import module_before, refuse_state_from_values
from .forward_state import ForwardStateWatch
from .frequency_watch import FrequencyWatch
from .grad_leaves import float_leaves
from .handover import release_unkept, watch
from .loss_action import LossAction
from .loss_rows import LossProbe
from .metrics import MetricExchange, Summed
from .own_scalar_loss import probe_own_scalar_loss
from .param_source import ParamSource
from .param_writes import check_param_writes, param_contents, param_versions
from .rng import MASK, START, default_generators, mixed, preserved, ranks_share_generators, seed_all, seeded
from .run_shape import ALONE, run_shape
from .send_delivery import Key
from .stage_backward import Saved, StageBackward, mark_reached, reaches
from .step_end import ReplicaCheck, StepEnd
from .transfers import TransferActions
from .wide_grads import WideGrads
from .zero import ZeroActions

LossFn = Callable[[Any, Any], torch.Tensor]
# The actions that may draw random numbers, and the code each mixes into its seed.
_RANDOM = {FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 2, BACKWARD_WEIGHT: 2, LOSS: 3}
_ISSUE_INSIDE = (*COMPUTES, LOSS)  # the actions whose layers may issue collectives (lower.insert_inside)


# Each action kind's handler, an Executor method by name: bound per action that runs (a step runs a
# handful of the 28 kinds), not a table of bound methods made every step.
_HANDLERS: dict[str, str] = {
    FORWARD: "forward",
    LOSS: "compute_loss",
    BACKWARD: "backward",
    BACKWARD_INPUT: "backward",
    BACKWARD_WEIGHT: "backward",
    GATHER: "gather",
    WAIT_GATHER: "wait_gather",
    FREE: "free",
    REDUCE_SCATTER: "reduce_scatter",
    WAIT_REDUCE: "wait_reduce",
    REDUCE_REPLICAS: "reduce_replicas",
    WAIT_REPLICAS: "wait_replicas",
    SEND_ACTIVATION: "send_activation",
    SEND_GRAD: "send_grad",
    RECV_ACTIVATION: "receive",
    RECV_GRAD: "receive",
    WAIT_SENDS: "wait_sends",
    SEND_TIED: "send_tied",
    RECV_TIED: "recv_tied",
    SUM_TIED: "sum_tied",
    FINISH_GRADS: "finish_grads",
    CHECK_REPLICAS: "check_replicas",
    WAIT_CHECK: "wait_check",
    REDUCE_METRICS: "reduce_metrics",
    WAIT_METRICS: "wait_metrics",
    UPDATE: "run_update",
    GATHER_PARAMS: "gather_params",
    WAIT_PARAMS: "wait_params",
}


def _needs_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


# id(actions) -> (actions, their shape); the actions are kept, so an id is never another list's.

@dataclass
class Executor(ZeroActions, TransferActions, StageBackward, LossAction, StepEnd):
    """One rank's step. After :meth:`run`: ``final_grads`` (what the optimizer got), ``summed``
    (the exchanged metric values), ``losses``, ``events`` (when recording), the peak bytes of
    gathered units."""

    chain: Chain
    loss_fn: LossFn
    mesh: Mesh | None
    placement: Placement
    source: ParamSource
    microbatches: Sequence[tuple[Any, Any]]
    seed: float  # each micro-batch's loss gradient: loss scale / (data-parallel replicas x micro-batches)
    finalize: Callable[[dict[str, dict[str, torch.Tensor]]], Any]  # local grads -> unscaled master grads
    # (final grads, summed[, units]) -> the new master tree (the optimizer), or those units' part of it
    update: Callable[..., Any]
    master: Any  # the tree the optimizer updates (parameters, or ZeRO shards)
    held: Any = None  # what the TrainState holds at rest (full parameters under ZeRO-1/2)
    grad_scale: float = 1.0  # the precision loss scale, divided out of reduced gradient shards
    # The seed of the single-device step's one loss (the loss scale), and whether the scale is static: where it
    # overflows the loss's dtype, one device's step skips, and so does every layout's (stage_backward.py)
    whole_seed: float | None = None
    static_scale: bool = False
    reduce_dtypes: Mapping[str, torch.dtype] | None = None  # per unit: the dtype its gradient travels in
    # Per layer, where the precision policy reduces gradients in a wider dtype than it computes them and the step
    # has several micro-batches: the dtype their weight gradients are summed in (run/wide_grads.py).
    accumulate_dtypes: Mapping[str, torch.dtype] | None = None
    metric_dtype: torch.dtype = torch.float32  # the same on every rank (metrics.metric_dtype)
    exchange: MetricExchange = field(default_factory=lambda: MetricExchange(False, False, False))
    metric_axes: tuple[str, ...] = ()
    replica_layers: frozenset[str] = frozenset()  # layers of which this rank holds only tied copies
    # Per micro-batch, each stage's predicted output: transfers go bare.
    boundaries: Sequence[Sequence[Boundary]] | None = None
    poison: bool = False
    # each micro-batch's boundaries predicted on it (pipeline(follow_batches=)); the name of a split that turns it off
    follow_batches: bool | str = False
    record: bool = False
    # None: loss_fn returns the mean over the batch's rows. "sum": it returns (sum, count) over
    # tokens. A callable (inputs, targets) -> count: it returns the mean over that many tokens.
    tokens: Any = None
    rng_seed: int | None = None  # this step's seed (engine/run/rng.py); None: the global generators as they are
    # Under a split that replicates values over its axis, on all but one index of it: the gradients the
    # metrics count (keys, or per ZeRO unit the ranges of its shard), and no loss or token count.
    # None: everything.
    counted: Any = None
    counts_losses: bool = False  # with ``counted``: this rank's losses and tokens are its own (a split cut the batch)
    batch_fingerprint: torch.Tensor | None = None  # of the global batch, when the exchange checks it
    step_digest: float | None = None  # of the step, summed beside the batch's fingerprint
    rng_rank: int | None = None  # the rank whose random streams this one draws (None: its own)
    # One device, no ZeRO, an in-place optimizer: the leaves and bound layers of the last step of this
    # rank, reused when the parameters are the same tensors (run/bindings.py); None: bound afresh.
    bindings: StageBindings | None = None
    # Per split axis: the gradients of the parameters that split replicates, which must come out equal
    # on every index of its axis (check_replicas).
    replicas: Mapping[str, ReplicaCheck] = field(default_factory=dict)
    # On a step's first call where it cuts the batch's rows: the probe that loss_fn is a mean over them,
    # run before the first micro-batch's loss (run/loss_rows.py).
    loss_probe: LossProbe | None = None
    # The trainable parameters of the module the step's chain was made from, which its first loss may not read
    # with gradients on (run/loss_reads.py); None: not known (a meta build, a chain built by hand)
    given_params: Given | None = None
    # Where a layer writing its trainable parameters in forward is refused (param_writes.py), the step's
    # layout in words ("under shard_params"); None: the plain one-device step, which keeps the write.
    param_writes_refused: str | None = "under this step,"
    # The transform that cuts the batch, in its refusal's words (stack/compose.py: cutting_the_batch), where a
    # layer's first call is watched for a forward's own F.embedding(..., scale_grad_by_freq=True)
    # (run/frequency_watch.py); None: the step calls the model on the whole batch.
    frequency_cut: str | None = None
    # How the step cuts the batch, in words ("2 micro-batches"), or None where each call sees it whole: then a
    # layer's first call that sets its module's state from its input's values is refused (first_call_state).
    batch_cut: str | None = None
    # On a step's first call on this thread: called once the run is through, having walked every backward's
    # graph for leaves of other stages or ranks (run/cut_graphs.py); None: not watched.
    graph_watch: Callable[[], None] | None = None
    # -- results ----------------------------------------------------------------------------
    final_grads: Any = None
    summed: Summed = field(default_factory=Summed)
    new_master: Any = None
    new_held: Any = None
    losses: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)  # token-weighted: tokens per micro-batch
    events: list[tuple[int, str, float, float]] = field(default_factory=list)
    # When recording: every action of this rank's Plan, (position in the Plan's list, start, end), on
    # time.perf_counter's clock (a compute's in-layer collectives too): the measured counterpart
    # of a simulated Plan.
    action_times: list[tuple[int, float, float]] = field(default_factory=list)
    peak_gathered_bytes: int = 0
    # Stages 1-2: each bucket's all-gather of the updated shards not waited for in this step (with
    # overlap_gather, all of them: the next step's TrainState holds them)
    params_in_flight: list[tuple[Bucket, Handle]] = field(default_factory=list)
    # Stages 1-2 (plan/lower.py: gathers_into_params): each bucket's gathered parameters copied into
    # the ones the step was given, instead of handed on beside them.
    into_params: bool = False
    # per receive of a pipeline rank, the gradient sends it proves delivered (send_delivery.py)
    sends_delivered_by: Mapping[Key, tuple[Key, ...]] = field(default_factory=dict)
    # -- per-step working state -------------------------------------------------------------
    device: torch.device = field(init=False)
    _view: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # gathered units' parameters
    # Buffers written through .data and Python state advanced per call, on a layer's first step.
    _state: ForwardStateWatch = field(default_factory=ForwardStateWatch)
    _frequencies: FrequencyWatch = field(init=False)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    _unflattened: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _in_flight_bytes: int = 0
    _held_bytes: int = 0
    _pending: dict[tuple[str, str], Handle] = field(default_factory=dict)
    _gather_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    _pending_order: list[str] = field(default_factory=list)
    _grad_shards: dict[str, torch.Tensor] = field(default_factory=dict)
    _reduced_shares: dict[str, torch.Tensor] = field(default_factory=dict)  # ZeroActions.wait_reduce
    _share_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    _replica_input: dict[str, torch.Tensor] = field(default_factory=dict)
    _leaves: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    _bound: dict[int, BoundStage] = field(default_factory=dict)
    _saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    _outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    _input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    _inbox: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    _sends: list[Handle] = field(default_factory=list)
    _sent: dict[tuple[str, int, int], list[Handle]] = field(default_factory=dict)  # TransferActions._sent
    _posted: dict[tuple[str, int, int], list[Handle]] | None = None
    _to_post: list[Action] = field(default_factory=list)  # TransferActions._to_post
    _tied_parts: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    _local_metrics: torch.Tensor | None = None
    _metrics_total: torch.Tensor | None = None
    _metrics_handle: Handle | None = None
    _actions: Sequence[Action] = ()
    _tops: Mapping[tuple[int, int], int] = field(default_factory=dict)  # RunShape.tops
    _covered: frozenset[tuple[int, int]] = frozenset()  # RunShape.covered
    _joined: frozenset[tuple[int, int]] = frozenset()  # (stage, mb) whose input stays on the graph
    # per split axis: the replica check in flight, and the rounding its sums may differ by
    _checks: dict[str, tuple[Handle, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Where this rank computes: its parameters', else its micro-batches'. Received values go
        # there (torch.distributed delivers them on the CPU), and so do the metrics.
        # (With ZeRO-1/2's gathers still in flight the compute copies may be empty: the master shards.)
        self.device = device_of(self.source.compute, self.source.gather_from, self.master, self.microbatches)
        self._frequencies = FrequencyWatch(self.frequency_cut)
        self._wide = WideGrads(self.accumulate_dtypes) if self.accumulate_dtypes else None
        self._shared_rng = ranks_share_generators()
        self._rank = 0 if self.mesh is None else self.mesh.rank
        self._rng_rank = self._rank if self.rng_rank is None else self.rng_rank
        self._generators = default_generators(self.device)
        self._seed_prefix = None if self.rng_seed is None else mixed(START, self.rng_seed, self._rng_rank)
        bindings = self.bindings
        if bindings is not None:
            assert self.source.compute is not None and self.source.sharding is None, "bindings: one device, no ZeRO"
            bindings.ready_for(self.chain, self.source.compute)
            self._leaves, self._bound = bindings.leaves, bindings.bound

    # -- dispatch ------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action]) -> None:
        # The step's mesh is the default of collectives issued inside a layer (by a split transform).
        in_mesh = contextlib.nullcontext() if self.mesh is None else use_mesh(self.mesh)
        with in_mesh, preserved(self.device, self._shared_rng, active=self.rng_seed is not None):
            self._run(actions)

    def _run(self, actions: Sequence[Action]) -> None:
        self._actions = actions
        # A traced step times every backward, and the collectives its layers issue, on its own.
        # Otherwise runs of whole backwards run as one call (a covered one runs nothing), a stage's
        # input staying on the graph when its backward and the one below it are in one call, and
        # forwards of such stages, adjacent in the Plan, run as one loop.
        shape = ALONE if self.record else run_shape(actions)
        self._tops, self._covered, self._joined = shape.tops, shape.covered, shape.joined
        forward_runs, skipped = shape.forward_runs, shape.skipped
        after_run = 0
        clock = time.perf_counter
        ran: list[tuple[int, float, float]] = []  # when recording: (position here, start, end)
        planned = 0  # the position of the running action in the Plan's list, which also lists the
        # collectives a compute issues inside its layers (a split transform's) right after it
        for position, action in enumerate(actions):
            if position < after_run or position in skipped:  # run by its run's first forward, or a call above
                continue
            if position in forward_runs:
                after_run = forward_runs[position]
                self._forward_run(actions[position:after_run])
                continue
            if action.kind in (FINISH_GRADS, UPDATE):  # every call of the step has run: before the update
                self._state.check_end()
            name = _HANDLERS.get(action.kind)
            if name is None:
                raise ValueError(f"the executor has no handler for action {action} (kind {action.kind!r})")
            handler: Callable[[Action], None] = getattr(self, name)
            if self.record:
                # Every collective a compute's layers issue (a split's), timed where it runs: the Plan
                # lists each right after its compute.
                timer: contextlib.AbstractContextManager[list[tuple[float, float]]] = (
                    timing() if action.kind in _ISSUE_INSIDE else contextlib.nullcontext([])
                )
                with timer as inside:
                    start = clock()
                    self._call(handler, action)
                    end = clock()
                ran.append((position, start, end))
                self.action_times.append((planned, start, end))
                self.action_times.extend((planned + 1 + k, s, e) for k, (s, e) in enumerate(inside))
                planned += 1 + len(inside)
            else:
                self._call(handler, action)
        if self.record:
            # Named after the step, so recording costs two clock reads per action while it runs.
            rank = 0 if self.mesh is None else self.mesh.rank
            self.events.extend(
                (rank, f"{actions[i].stage}{SHORT[actions[i].kind]}{actions[i].microbatch}", s, e)
                for i, s, e in ran if actions[i].kind in COMPUTES
            )
        self._state.check_end()  # (a step without FINISH_GRADS or UPDATE)
        if self.graph_watch is not None:
            self.graph_watch()

    # -- compute ---------------------------------------------------------------------------------
    def _call(self, handler: Callable[[Action], None], action: Action) -> None:
        """Run ``handler``; a compute runs with the generators seeded for its (rank, stage,
        micro-batch, kind)."""
        code = _RANDOM.get(action.kind)
        if code is None or self._seed_prefix is None or (
            action.kind == BACKWARD and (action.stage, action.mb) in self._covered
        ) or (action.kind == FORWARD and not self._shared_rng):
            # (a backward that its run's top stage's call covered runs nothing; a forward seeds in
            # _forward, unless its stage draws no random numbers)
            handler(action)
            return
        # mix(rng_seed, rng rank, stage, micro-batch, code), the first two mixed once per step
        seed = mixed(self._seed_prefix, action.stage or 0, action.microbatch or 0, code) & MASK
        if self._shared_rng:
            with seeded(seed, self.device, True):
                handler(action)
            return
        # Generators of its own (one rank per process): ``seeded`` without its lock and context
        # managers, which cost more than the seeding itself on every compute of a small layer.
        seed_all(self._generators, seed)
        handler(action)

    def _forward_run(self, run: Sequence[Action]) -> None:
        """Forwards of consecutive stages of one micro-batch (:func:`joined_forwards`) in one loop,
        each seeded as a forward alone is (by :meth:`_forward`, or around it where ranks share the
        generators)."""
        with torch.enable_grad():
            if not self._shared_rng or self._seed_prefix is None:
                for action in run:
                    self._forward(action)
                return
            for action in run:
                with seeded(self._forward_seed(action), self.device, True):
                    self._forward(action)

    def forward(self, action: Action) -> None:
        with torch.enable_grad():
            self._forward(action)

    def _forward_seed(self, action: Action) -> int:
        """The seed of ``action``'s forward: mix(rng_seed, rng rank, stage, micro-batch, forward's code)."""
        assert self._seed_prefix is not None
        return mixed(self._seed_prefix, action.stage or 0, action.microbatch or 0, _RANDOM[FORWARD]) & MASK

    def _forward(self, action: Action) -> None:
        """Stage ``action.stage``'s forward on micro-batch ``action.mb``. Without shared generators
        (one rank per process) it seeds them here, where it knows whether the stage draws any
        random numbers: a stage of layers that draw none (a Linear, a GELU, called directly) runs
        unseeded, as the seed would change nothing it computes (every compute seeds its own)."""
        # (Read once each: this runs for every stage and micro-batch, a few microseconds a stage of Python
        # next to a small layer's kernels; the per-call checks below all stay.)
        s = action.stage
        if s is None:
            s = action.require("stage")  # (raises: a forward names its stage)
        m = action.microbatch or 0  # (Action.mb)
        key = (s, m)
        joined = key in self._joined
        handed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if s == 0:
            x, inputs = self.microbatches[m][0], []
        elif joined:  # the backward runs through here in one call with the stage below
            # Taken, not read: the graph holds what the layers keep of it, and nothing else reads it (a
            # Linear's output that the ReLU after it does not keep goes now, as in a plain torch loop).
            x = self._outputs.pop((s - 1, m))
            if isinstance(x, torch.Tensor):  # the usual layer output: what the tree walk gives
                inputs = [x] if x.is_floating_point() and x.requires_grad else []
            else:
                inputs = [t for t in optree.tree_leaves(x) if _needs_grad(t)]
        else:
            x, inputs, handed = self._take_input(s, m)
        if s > 0 and not inputs and self._earlier_layers_own_params(s):
            previous = self.placement.stages[s - 1][-1]
            raise ValueError(
                f"layer {previous!r} passes no floating-point tensor to layer {self.placement.stages[s][0]!r}, so no "
                "gradient can reach the parameters before it and they would never train; return the activations "
                "as tensors, or tuples / lists / dicts / named tuples of tensors (a tensor computed under "
                "torch.no_grad(), or by torch.utils.checkpoint(use_reentrant=True) from an input that needs no "
                "gradient, carries none either: recompute with sw.remat(step) instead)"
            )
        bound = self._bound.get(s)
        if bound is None or self.source.sharding is not None:  # (else bound already, and no ZeRO unit to check)
            bound = self._bound_stage(s)
        if not joined:
            _require_grad(inputs)  # (no loop name left on an input: handover.release_unkept counts references)
        if self.graph_watch is not None:
            self._note_leaves(bound, inputs, s)
        # Counted now, before the forward can keep anything of it: freed after it where it kept nothing.
        watched = watch(handed) if handed else None
        quiet = bound.quiet
        ran_quiet = quiet is not None and type(x) is torch.Tensor
        if quiet is not None and ran_quiet:
            for q in quiet:  # asked before every call: a hook may come at any time
                if not calls_forward_alone(q[0]):
                    ran_quiet = False
                    break
        if quiet is not None and ran_quiet:
            y = self._run_quiet(quiet, bound, x, s, m)
        else:
            if self._seed_prefix is not None and not self._shared_rng:  # shared ones: seeded by the caller
                seed_all(self._generators, self._forward_seed(action))
            y = self._run_layers(bound, x, s, m)
        self._outputs[key] = y
        if s < self.placement.backward_from:
            return  # no gradient comes back to it (Placement.backward_from): nothing is kept for a backward
        if joined:
            reached = [False] * len(inputs)
            # One tensor in, one out, and a small graph between them: whether a gradient will reach
            # the input is read off the graph now, instead of a Python hook called in backward. The
            # quiet calls (a Linear, a GELU, a LayerNorm, ...) each compute their output from their
            # input differentiably, so through them it always does.
            known = True if ran_quiet and len(inputs) == 1 else (
                reaches(y, inputs[0]) if len(inputs) == 1 and isinstance(y, torch.Tensor) else None)
            if known is not None:
                reached[0] = known
            else:
                for k, t in enumerate(inputs):
                    t.register_hook(functools.partial(mark_reached, reached, k))
            # A stage whose backward the call of a stage above covers never reads its outputs.
            outputs = [] if key in self._covered else self._carrying_grads(s, y)
            self._saved[key] = Saved([], bound.leaves, outputs, reached=reached)
        else:
            # (The lowest stage of a joined run is covered too: the run's one call starts from its top.)
            outputs = [] if key in self._covered else self._carrying_grads(s, y)
            self._saved[key] = Saved(inputs, bound.leaves, outputs)
            if watched:
                del x  # the tree the layers were given (a layer may have taken a leaf out of it)
                release_unkept(watched)

    def _note_leaves(self, bound: BoundStage, inputs: list[torch.Tensor], s: int) -> None:
        """A watched step's stage leaves, named for a backward that reaches them from elsewhere (cut_graphs)."""
        first = self.placement.stages[s][0]
        note_leaves(
            [*((leaf, f"parameter {name!r} of layer {owner!r}") for (owner, name), leaf in bound.leaves.items()),
             *((t, f"the input of layer {first!r}") for t in inputs)],
            self._rank,
        )

    def _run_layers(self, bound: BoundStage, x: Any, s: int, m: int) -> Any:
        """The stage's layers on ``x``, one after the other; refused where a layer wrote into its buffers, or
        into its parameters outside the plain one-device step (:mod:`.param_writes`)."""
        y = x
        refused_writes = self.param_writes_refused
        # The step's first call where the batch is cut and the loss is a mean: the last layer's own scalar loss is
        # probed on halves of its input (own_scalar_loss.py)
        own_loss = self.loss_probe is not None and self.tokens is None and m == 0 and s == self.placement.last
        for name, call, buffers in bound.layers:
            versions = [version_of(b) for b in buffers.values()] if buffers else None
            params = None if refused_writes is None else \
                param_versions(self.chain[name], bound.leaves, len(bound.layers) == 1)
            first = self._state.first_call(name, self.chain)
            before = self._state.snapshot(buffers) if first else None
            # Its first call where the batch is cut: its module as it was, to tell state set from the values
            unset = module_before(self.chain[name]) if first and self.batch_cut is not None else None
            given = y if unset is not None else None
            # Its first call on this thread: the contents too, to see a write through .data (param_writes)
            contents = param_contents(params) if first and params is not None else None
            # Its first call on this thread under a step that cuts the batch: a forward's own
            # F.embedding(..., scale_grad_by_freq=True) refused at the op (frequency_watch)
            frequencies = self._frequencies.around(name, self.chain)
            probed = y if own_loss and name == bound.layers[-1][0] else None
            try:
                if frequencies is None:
                    y = call(y)
                else:
                    with frequencies:
                        y = call(y)
            except Exception as err:
                self._layer_failed(err, name, s, m, y)
            if probed is not None:
                self._probe_own_loss(name, call, probed, y, m)
            if params is not None:
                check_param_writes(self.chain[name], params, refused_writes, contents)  # type: ignore[arg-type]
            if before is not None:  # its first call on this thread: .data writes, Python state (forward_state)
                self._state.after_first(name, self.chain[name], buffers, before)
            if unset is not None:
                sizes = {} if self.mesh is None else {a: self.mesh.axis_size(a) for a in self.mesh.axis_names}
                refuse_state_from_values(self.chain[name], call, given, unset, self.batch_cut or "", sizes)
                given = None
            if versions is None:
                continue
            changed = [b for b, v in zip(buffers, versions, strict=True) if version_of(buffers[b]) != v]
            if changed:
                raise ValueError(
                    f"layer {name!r} wrote into its buffers {changed} during forward: a pure layer keeps no "
                    "state, so the update would be lost between steps or leak across ranks; make it a "
                    "parameter, compute it from the input, or leave the module in eval mode"
                )
        return y

    def _probe_own_loss(self, name: str, call: Callable[[Any], Any], given: Any, y: Any, m: int) -> None:
        """Refuse a scalar loss layer ``name`` computed on ``given`` that is no mean over the rows (own_scalar_loss)."""
        rows = next((int(t.shape[0]) for t in optree.tree_leaves(self.microbatches[m][0])
                     if isinstance(t, torch.Tensor) and t.dim() > 0), 0)
        sizes = {} if self.mesh is None else {a: self.mesh.axis_size(a) for a in self.mesh.axis_names}
        probe_own_scalar_loss(self.chain[name], call, given, y, rows, self.batch_cut or "the batch", sizes)

    def _run_quiet(self, quiet: tuple[Any, ...], bound: BoundStage, x: torch.Tensor, s: int, m: int) -> Any:
        """The stage's layers on ``x`` as their forwards' one calls (``BoundStage.quiet``): what their
        calls in :meth:`_run_layers` run, without the way through the module call."""
        y = x
        for i, (module, tensors, fn) in enumerate(quiet):  # (bound.layers: the same layers, in order)
            try:
                y = fn(module, tensors, y)
            except Exception as err:
                self._layer_failed(err, bound.layers[i][0], s, m, y)
        return y

    def _layer_failed(self, err: Exception, name: str, s: int, m: int, y: Any) -> NoReturn:
        """Say where ``err`` came from, and on what: the message is torch's."""
        keys = unknown_keys_message(name, self.chain[name].fn, y, err)
        if keys is not None:
            raise ValueError(keys) from err
        first = s > 0 and name == self.placement.stages[s][0]
        if isinstance(err, RuntimeError) and _LEAF_WRITTEN in str(err) and first:
            # The stage's input is a leaf of its own here (ZeRO-3's per-stage backward, a pipeline's stage, remat):
            # torch refuses an in-place write into it (torchvision's VGG features: ReLU(inplace=True) a layer alone)
            raise ValueError(
                f"layer {name!r} writes into its input in place (an nn.ReLU(inplace=True), a dropout or x.mul_() on "
                f"the input), which this step hands it as a leaf of its own: the first layer of a stage (stage {s}) "
                "computes its backward apart from the layers before it, and torch refuses a write into such an "
                "input (a leaf that requires grad). Build the module out of place (inplace=False: the same values), "
                "or give it to the layer before it in one unit (functionalize(model, units=...))"
            ) from err
        err.add_note(f"in layer {name!r} (stage {s}, micro-batch {m}), on input {_describe(y)}")
        raise err


    def _take_input(self, s: int, m: int) -> tuple[Any, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Stage ``s``'s input for micro-batch ``m``, its leaves a gradient goes back for (those that
        depend on a parameter, not RoPE's cos and sin, made from buffers and ids), and, handed over in
        memory, each such leaf's (output of stage ``s - 1``, detached copy): the output stays the root
        of that stage's backward (:mod:`.handover`)."""
        if self.placement.stage_rank[s - 1] == self.placement.stage_rank[s]:
            below = (s - 1, m)  # a stage that runs no backward has no later use of its output
            no_backward = s - 1 < self.placement.backward_from
            # Taken: what holds it now is its stage's saved outputs (the root of that backward) and what
            # this returns (handover.release_unkept counts on that).
            y: Any = self._outputs.pop(below)
            if isinstance(y, torch.Tensor):  # the usual layer output: what the tree walk below gives
                alone = y.detach()
                if not _needs_grad(y):
                    return alone, [], []
                return alone, [alone], [] if no_backward else [(y, alone)]
            x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
            leaves = zip(optree.tree_leaves(y), optree.tree_leaves(x), strict=True)
            pairs = [(o, c) for o, c in leaves if _needs_grad(o)]
            return x, [c for _, c in pairs], [] if no_backward else pairs
        x = self._inbox.pop(("activation", s, m))
        if self.boundaries is None:  # announced: the sender expects one per floating leaf
            return x, float_leaves(x), []
        grads = self.boundaries[m][s - 1].grads
        return x, [t for t, g in zip(optree.tree_leaves(x), grads, strict=True) if g], []

    def _carrying_grads(self, s: int, y: Any) -> list[torch.Tensor]:
        """The leaves of stage ``s``'s output a gradient comes back for: those that depend on a
        parameter, unless the next stage cannot tell which (announced transfers to another
        rank), which then sends one for every floating leaf."""
        rank = self.placement.stage_rank
        if s == self.placement.last or (self.boundaries is None and rank[s + 1] != rank[s]):
            return float_leaves(y)
        return [t for t in float_leaves(y) if t.requires_grad]

    def _earlier_layers_own_params(self, s: int) -> bool:
        return any(self.chain.owned_param_names(n) for layers in self.placement.stages[:s] for n in layers)

    def _bound_stage(self, s: int) -> BoundStage:
        """Stage ``s``'s layers bound to the step's leaves (tied ones through their owner), and the
        leaves they use. Bound once per step and stage: every micro-batch runs the same calls."""
        bound = self._bound.get(s)
        if bound is None:
            used: dict[tuple[str, str], torch.Tensor] = {}
            layers = []
            quiet: list[Any] | None = []
            for name in self.placement.stages[s]:
                layer = self.chain[name]
                tensors = {local: self._leaf(layer.ties.get(local, (name, local)), used) for local in layer.param_names}
                layers.append((name, layer.bind(tensors), layer.buffers))
                call = None if quiet is None else layer.bind_quiet(tensors)
                quiet = None if quiet is None or call is None else [*quiet, call]
            bound = self._bound[s] = BoundStage(tuple(layers), used, None if quiet is None else tuple(quiet))
        elif self.source.sharding is not None:
            for key in bound.leaves:  # under ZeRO-3 a unit must be gathered whenever its layers compute
                self._check_gathered(key)
        return bound

    def _leaf(self, key: tuple[str, str], used: dict[tuple[str, str], torch.Tensor]) -> torch.Tensor:
        """The step's leaf (requires grad) for parameter ``key``; one leaf per parameter for the step."""
        leaf = self._leaves.get(key)
        if leaf is None:
            owner, name = key
            tensor = self._param(owner, name)
            leaf = self._leaves[key] = tensor.detach().requires_grad_(True)
            if self.bindings is not None:
                self.bindings.sources[key] = tensor
        else:
            self._check_gathered(key)
        used[key] = leaf
        return leaf

    def _param(self, owner: str, name: str) -> torch.Tensor:
        if self.source.sharding is not None and self.source.sharding.holds_shards:
            unit = self._view.get(owner)
            if unit is None:
                raise RuntimeError(f"layer {owner!r}'s parameters are used while its unit is not gathered")
            tensor = unit.get(name)
        else:
            assert self.source.compute is not None
            tensor = self.source.compute.get(owner, {}).get(name)
        if tensor is None:
            raise KeyError(f"this rank holds no parameter {name!r} of layer {owner!r}, which its stages use")
        return tensor

    def _check_gathered(self, key: tuple[str, str]) -> None:
        sharding = self.source.sharding
        if sharding is not None and sharding.holds_shards and key[0] in sharding.units and key[0] not in self._view:
            raise RuntimeError(f"layer {key[0]!r}'s parameters are used while its unit is not gathered")


# torch's error for an in-place write into a leaf that requires grad
_LEAF_WRITTEN = "a leaf Variable that requires grad is being used in an in-place operation"


def _require_grad(inputs: Sequence[torch.Tensor]) -> None:
    for t in inputs:
        t.requires_grad_(True)


def _describe(tree: Any) -> str:
    """A layer input in a few words: each tensor's dtype and shape."""
    parts = [
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        for t in optree.tree_leaves(tree)
    ]
    text = ", ".join(parts[:6]) + (f", ... ({len(parts)} leaves)" if len(parts) > 6 else "")
    return text or "no tensor"
