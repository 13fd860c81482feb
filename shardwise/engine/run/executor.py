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
peers the Plan names; every receive of the step is posted at the first one.
ZeRO's actions live in ``executor_zero.py`` and the pipeline's transfers in
``executor_transfers.py``, mixins of the one :class:`Executor`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import optree
import torch

from ...collectives import Handle, all_gather_async, psum, psum_async
from ...collectives.mesh import Mesh
from ...collectives.mesh_context import use_mesh
from ...collectives.timing import timing
from ..layout.buckets import Bucket
from ..layout.devices import device_of
from ..layout.in_flight import InFlightParams
from ..layout.precision import all_finite
from ..layout.sharding import FlatSharding
from ..layout.state_layout import Placement
from ..model.chain import Chain
from ..model.module_call import calls_forward_alone
from ..model.split_backward import WeightPart, input_part, recomputes, weight_part
from ..optim.optimizers import global_norm
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
from ..stack.batch_term import WithBatchTerm, counting_tokens
from ..torch_api import accumulate_backward, version_of
from .batch_keys import unknown_keys_message
from .bindings import BoundStage, StageBindings
from .handover import release_unkept, watch
from .loss_rows import LossProbe
from .metrics import MetricExchange, Summed, different_batches
from .rng import MASK, START, default_generators, mixed, preserved, ranks_share_generators, seed_all, seeded
from .transfers import TransferActions
from .zero import ZeroActions

LossFn = Callable[[Any, Any], torch.Tensor]
# The actions that may draw random numbers, and the code each mixes into its seed.
_RANDOM = {FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 2, BACKWARD_WEIGHT: 2, LOSS: 3}
_ISSUE_INSIDE = (*COMPUTES, LOSS)  # the actions whose layers may issue collectives (lower.insert_inside)


def float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree`` in pytree order: the values gradients flow through."""
    if isinstance(tree, torch.Tensor):  # the usual layer output
        return [tree] if tree.is_floating_point() else []
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _needs_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


def _no_tokens(mean: torch.Tensor, output: Any) -> torch.Tensor:
    """The summed loss of a micro-batch without tokens: exactly 0, with zero gradients.

    Its mean over no tokens is NaN (0/0), and NaN x 0 is NaN, in the value and in the gradient:
    the global step divides by the global count, to which this shard adds nothing. Summing an
    empty slice of each output keeps the loss on the graph (so backward runs as on any rank)."""
    zero = mean.detach().new_zeros(())
    for leaf in float_leaves(output):
        zero = zero + leaf.flatten()[:0].sum().to(zero.dtype)
    return zero


@dataclass
class ParamSource:
    """Where a rank's layers read their parameters: ``compute`` (full compute copies), or where ZeRO
    holds shards at rest (``FlatSharding.holds_shards``) the flat units of ``sharding`` gathered from
    ``gather_from`` (this rank's shards), each
    cast to its ``gather_dtypes`` entry (the compute dtype, where a precision policy gives one)
    as its all-gather is issued, before it travels."""

    compute: Mapping[str, Mapping[str, torch.Tensor]] | None = None
    sharding: FlatSharding | None = None
    gather_from: Mapping[str, torch.Tensor] | None = None
    gather_dtypes: Mapping[str, torch.dtype] | None = None
    # ZeRO-1/2 with overlap_gather: the full parameters the last step's all-gathers are still
    # bringing (``compute`` lacks their layers until each bucket's wait_params), and the cast of
    # what a wait brings into compute copies (the precision policy's).
    incoming: InFlightParams | None = None
    cast: Callable[[dict[str, dict[str, torch.Tensor]]], Mapping[str, Mapping[str, torch.Tensor]]] | None = None
    # ZeRO-1/2 under a precision policy that does not narrow (one that narrows holds shards, gathered
    # as ZeRO-3's are): ``compute`` holds this step's own copies, each of which
    # goes once its unit's gradients are taken (``ZeroActions.reduce_scatter``), as the backward
    # frees the activations.
    copies: bool = False

    def gather_dtype(self, unit: str) -> torch.dtype:
        """The dtype a ZeRO-3 unit travels and computes in."""
        assert self.gather_from is not None
        if self.gather_dtypes is not None and unit in self.gather_dtypes:
            return self.gather_dtypes[unit]
        return self.gather_from[unit].dtype

    def gather_input(self, unit: str) -> torch.Tensor:
        """This rank's shard of ``unit`` as its all-gather sends it: a new compute-dtype copy, made
        here rather than for every unit at the step's start, so that each lives only while its
        gather is in flight (as FSDP2's copy-in); the shard itself without a cast."""
        assert self.gather_from is not None
        return self.gather_from[unit].to(self.gather_dtype(unit))


@dataclass(frozen=True)
class ReplicaCheck:
    """The gradients that must come out equal on every index of a split's axis (keys, or per ZeRO
    unit the ranges of this rank's shard), and what the error says when they do not: the split's
    name and how to fix it."""

    selection: Any
    by: str
    fix: str


@dataclass
class _Saved:
    inputs: list[torch.Tensor]  # leaves that require grad (empty for stage 0, and for a joined stage)
    params: dict[tuple[str, str], torch.Tensor]  # (owner layer, local name) -> the step's leaf
    outputs: list[torch.Tensor]  # float leaves of the stage output (or [loss] on the last stage)
    output_grads: list[torch.Tensor | None] | None = None  # kept between I and W
    weight_part: WeightPart | None = None  # what I left for W (split_backward)
    # A joined stage (its input left on the previous stage's graph): whether a gradient reached that
    # input in the backward (set by a hook on it); None for a stage whose input is cut.
    reached: list[bool] | None = None


def joined_backwards(actions: Sequence[Action]) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]]]:
    """Runs of adjacent whole backwards of one micro-batch on consecutive stages (``B(s) B(s-1) ...``,
    nothing between them), which then run as one autograd call: (stage at the top, micro-batch) ->
    the run's lowest stage, and the (stage, micro-batch) backwards that call covers (all but the top).

    Their forwards leave each input above the lowest on the previous stage's graph instead of cutting
    it, so the one call goes through them as ``loss.backward()`` would; nothing between the backwards
    (a ZeRO reduce-scatter, a free, a send) needed them apart. Without a pipeline every layer is its
    own stage, so a ZeRO-1 backward is one call instead of one per layer, a ZeRO-2 one one per bucket.
    """
    tops: dict[tuple[int, int], int] = {}
    covered: set[tuple[int, int]] = set()
    top: tuple[int, int] | None = None
    previous: Action | None = None
    for action in actions:
        if (
            action.kind == BACKWARD and previous is not None and previous.kind == BACKWARD
            and top is not None and previous.microbatch == action.microbatch
            and previous.stage is not None and action.stage == previous.stage - 1
        ):
            s, m = action.require("stage"), action.mb
            tops[top] = s
            covered.add((s, m))
        elif action.kind == BACKWARD:
            top = (action.require("stage"), action.mb)
        else:
            top = None
        previous = action
    return tops, covered


def joined_forwards(actions: Sequence[Action], joined: set[tuple[int, int]]) -> dict[int, int]:
    """Runs of adjacent forwards of one micro-batch on consecutive stages whose inputs stay on the
    graph (``joined``: their backwards run as one call), which then run as one loop: the position of
    a run's first forward -> the position after its last. Nothing between them in the Plan needed
    them apart, and each keeps its own seed."""
    runs: dict[int, int] = {}
    i, n = 0, len(actions)
    while i < n:
        j = i + 1
        if actions[i].kind == FORWARD:
            while (
                j < n and actions[j].kind == FORWARD and actions[j].microbatch == actions[i].microbatch
                and actions[j].stage == actions[j - 1].require("stage") + 1
                and (actions[j].stage, actions[j].mb) in joined
            ):
                j += 1
            if j - i > 1:
                runs[i] = j
        i = j
    return runs


@dataclass(frozen=True)
class RunShape:
    """What one rank's actions join (:func:`joined_backwards`, :func:`joined_forwards`), read once per
    actions list: the same list (a layout's cached Plan actions) runs every step."""

    tops: Mapping[tuple[int, int], int]  # (top stage, micro-batch) -> the lowest stage its call covers
    covered: frozenset[tuple[int, int]]  # the backwards a call above runs
    joined: frozenset[tuple[int, int]]  # (stage, micro-batch) whose input stays on the graph
    forward_runs: Mapping[int, int]  # position of a run's first forward -> position after its last
    skipped: frozenset[int]  # positions of the covered backwards, which run nothing


_ALONE = RunShape({}, frozenset(), frozenset(), {}, frozenset())  # a traced step: every compute alone
# id(actions) -> (actions, their shape); the actions are kept, so an id is never another list's.
_SHAPES: dict[int, tuple[Sequence[Action], RunShape]] = {}
_SHAPES_KEPT = 64  # the lists of as many layouts and ranks; beyond that the cache starts again


def run_shape(actions: Sequence[Action]) -> RunShape:
    """The :class:`RunShape` of ``actions``, made once per list."""
    known = _SHAPES.get(id(actions))
    if known is not None and known[0] is actions:
        return known[1]
    tops, covered = joined_backwards(actions)
    joined = frozenset((s + 1, m) for s, m in covered)
    skipped = frozenset(
        i for i, a in enumerate(actions) if a.kind == BACKWARD and (a.stage, a.mb) in covered
    )
    shape = RunShape(tops, frozenset(covered), joined, joined_forwards(actions, set(joined)), skipped)
    if len(_SHAPES) >= _SHAPES_KEPT:
        _SHAPES.clear()
    _SHAPES[id(actions)] = (actions, shape)
    return shape


@dataclass
class Executor(ZeroActions, TransferActions):
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
    reduce_dtypes: Mapping[str, torch.dtype] | None = None  # per unit: the dtype its gradient travels in
    metric_dtype: torch.dtype = torch.float32  # the same on every rank (metrics.metric_dtype)
    exchange: MetricExchange = field(default_factory=lambda: MetricExchange(False, False, False))
    metric_axes: tuple[str, ...] = ()
    replica_layers: frozenset[str] = frozenset()  # layers of which this rank holds only tied copies
    boundaries: Sequence[Boundary] | None = None  # predicted stage outputs: transfers go bare
    poison: bool = False
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
    # -- per-step working state -------------------------------------------------------------
    device: torch.device = field(init=False)
    _view: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # gathered units' parameters
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
    _saved: dict[tuple[int, int], _Saved] = field(default_factory=dict)
    _outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    _input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    _inbox: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    _sends: list[Handle] = field(default_factory=list)
    _posted: dict[tuple[str, int, int], list[Handle]] | None = None
    _tied_parts: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    _local_metrics: torch.Tensor | None = None
    _metrics_total: torch.Tensor | None = None
    _metrics_handle: Handle | None = None
    _actions: Sequence[Action] = ()
    _tops: Mapping[tuple[int, int], int] = field(default_factory=dict)  # RunShape.tops
    _covered: frozenset[tuple[int, int]] = frozenset()  # RunShape.covered
    _joined: frozenset[tuple[int, int]] = frozenset()  # (stage, mb) whose input stays on the graph
    _checks: dict[str, Handle] = field(default_factory=dict)  # per split axis: the replica check in flight

    def __post_init__(self) -> None:
        # Where this rank computes: its parameters', else its micro-batches'. Received values go
        # there (torch.distributed delivers them on the CPU), and so do the metrics.
        # (With ZeRO-1/2's gathers still in flight the compute copies may be empty: the master shards.)
        self.device = device_of(self.source.compute, self.source.gather_from, self.master, self.microbatches)
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
        table: dict[str, Callable[[Action], None]] = {
            FORWARD: self.forward,
            LOSS: self.compute_loss,
            BACKWARD: self.backward,
            BACKWARD_INPUT: self.backward,
            BACKWARD_WEIGHT: self.backward,
            GATHER: self.gather,
            WAIT_GATHER: self.wait_gather,
            FREE: self.free,
            REDUCE_SCATTER: self.reduce_scatter,
            WAIT_REDUCE: self.wait_reduce,
            REDUCE_REPLICAS: self.reduce_replicas,
            WAIT_REPLICAS: self.wait_replicas,
            SEND_ACTIVATION: self.send_activation,
            SEND_GRAD: self.send_grad,
            RECV_ACTIVATION: self.receive,
            RECV_GRAD: self.receive,
            WAIT_SENDS: self.wait_sends,
            SEND_TIED: self.send_tied,
            RECV_TIED: self.recv_tied,
            SUM_TIED: self.sum_tied,
            FINISH_GRADS: self.finish_grads,
            CHECK_REPLICAS: self.check_replicas,
            WAIT_CHECK: self.wait_check,
            REDUCE_METRICS: self.reduce_metrics,
            WAIT_METRICS: self.wait_metrics,
            UPDATE: self.run_update,
            GATHER_PARAMS: self.gather_params,
            WAIT_PARAMS: self.wait_params,
        }
        self._actions = actions
        # A traced step times every backward, and the collectives its layers issue, on its own.
        # Otherwise runs of whole backwards run as one call (a covered one runs nothing), a stage's
        # input staying on the graph when its backward and the one below it are in one call, and
        # forwards of such stages, adjacent in the Plan, run as one loop.
        shape = _ALONE if self.record else run_shape(actions)
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
            handler = table.get(action.kind)
            if handler is None:
                raise ValueError(f"the executor has no handler for action {action} (kind {action.kind!r})")
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
        s, m = action.require("stage"), action.mb
        joined = (s, m) in self._joined
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
        bound = self._bound_stage(s)
        if not joined:
            _require_grad(inputs)  # (no loop name left on an input: handover.release_unkept counts references)
        # Counted now, before the forward can keep anything of it: freed after it where it kept nothing.
        watched = watch(handed) if handed else None
        quiet = bound.quiet
        ran_quiet = quiet is not None and type(x) is torch.Tensor and all(calls_forward_alone(q[0]) for q in quiet)
        if quiet is not None and ran_quiet:
            y = self._run_quiet(quiet, bound, x, s, m)
        else:
            if self._seed_prefix is not None and not self._shared_rng:  # shared ones: seeded by the caller
                seed_all(self._generators, self._forward_seed(action))
            y = self._run_layers(bound, x, s, m)
        self._outputs[(s, m)] = y
        if s < self.placement.backward_from:
            return  # no gradient comes back to it (Placement.backward_from): nothing is kept for a backward
        if joined:
            reached = [False] * len(inputs)
            # One tensor in, one out, and a small graph between them: whether a gradient will reach
            # the input is read off the graph now, instead of a Python hook called in backward. The
            # quiet calls (a Linear, a GELU, a LayerNorm, ...) each compute their output from their
            # input differentiably, so through them it always does.
            known = True if ran_quiet and len(inputs) == 1 else (
                _reaches(y, inputs[0]) if len(inputs) == 1 and isinstance(y, torch.Tensor) else None)
            if known is not None:
                reached[0] = known
            else:
                for k, t in enumerate(inputs):
                    t.register_hook(functools.partial(_mark, reached, k))
            # A stage whose backward the call of a stage above covers never reads its outputs.
            outputs = [] if (s, m) in self._covered else self._carrying_grads(s, y)
            self._saved[(s, m)] = _Saved([], bound.leaves, outputs, reached=reached)
        else:
            # (The lowest stage of a joined run is covered too: the run's one call starts from its top.)
            outputs = [] if (s, m) in self._covered else self._carrying_grads(s, y)
            self._saved[(s, m)] = _Saved(inputs, bound.leaves, outputs)
            if watched:
                del x  # the tree the layers were given (a layer may have taken a leaf out of it)
                release_unkept(watched)

    def _run_layers(self, bound: BoundStage, x: Any, s: int, m: int) -> Any:
        """The stage's layers on ``x``, one after the other; refused where a layer wrote into its buffers."""
        y = x
        for name, call, buffers in bound.layers:
            versions = [version_of(b) for b in buffers.values()] if buffers else None
            try:
                y = call(y)
            except Exception as err:
                self._layer_failed(err, name, s, m, y)
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

    def _run_quiet(self, quiet: tuple[Any, ...], bound: BoundStage, x: torch.Tensor, s: int, m: int) -> Any:
        """The stage's layers on ``x`` as their forwards' one calls (``BoundStage.quiet``): what their
        calls in :meth:`_run_layers` run, without the way through the module call."""
        y = x
        for (module, tensors, fn), (name, _, _) in zip(quiet, bound.layers, strict=True):
            try:
                y = fn(module, tensors, y)
            except Exception as err:
                self._layer_failed(err, name, s, m, y)
        return y

    def _layer_failed(self, err: Exception, name: str, s: int, m: int, y: Any) -> NoReturn:
        """Say where ``err`` came from, and on what: the message is torch's."""
        keys = unknown_keys_message(name, self.chain[name].fn, y)
        if keys is not None:
            raise ValueError(keys) from err
        err.add_note(f"in layer {name!r} (stage {s}, micro-batch {m}), on input {_describe(y)}")
        raise err

    def compute_loss(self, action: Action) -> None:
        m = action.mb
        s = self.placement.last
        saved = self._saved[(s, m)]
        inputs, targets = self.microbatches[m]
        output = self._outputs.pop((s, m))
        if self.loss_probe is not None and m == 0:
            # Set back what the probe drew only where no other rank draws meanwhile: this compute holds
            # the shared generators (it was seeded), or they are this rank's own.
            restore = self._seed_prefix is not None or not self._shared_rng
            self.loss_probe.check(self.loss_fn, output, inputs, targets, self._generators, restore)
        # A count function's count is known before the loss: a loss term of the whole batch reads it there.
        counted = None if self.tokens is None or self.tokens == "sum" else self._count(self.tokens(inputs, targets))
        with torch.enable_grad(), counting_tokens(counted):
            got = self.loss_fn(output, targets)
        if isinstance(got, WithBatchTerm) and self.tokens is None:
            raise ValueError(
                "loss_fn returned a WithBatchTerm (a term of the whole batch beside a token-weighted loss), but the "
                "step's loss is a mean (train_step(tokens=None)): return the mean loss"
            )
        loss = self._token_sum(got, counted, output) if self.tokens is not None else got
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean loss over the batch), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        if not loss.requires_grad and self._earlier_layers_own_params(s + 1):
            raise ValueError(
                "the loss does not depend on any parameter: the chain's output carries no tensor that the "
                f"parameters reach (layer {self.chain.names[-1]!r} returned {type(output).__name__}); return the "
                "activations as tensors or pytrees of tensors, and compute the loss from them"
            )
        self.losses.append(loss.detach())
        saved.outputs = [loss]

    def _token_sum(self, got: Any, counted: torch.Tensor | None, output: Any) -> torch.Tensor:
        """The micro-batch's summed token loss (``counted``: its count under a count function, given
        before the loss ran); its token count goes to ``counts``. A :class:`WithBatchTerm`'s term is
        added as it is, not weighed by the count (``stack/batch_term.py``)."""
        term = None
        if isinstance(got, WithBatchTerm):
            got, term = got.loss, got.term
        if self.tokens == "sum":
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise ValueError(
                    "train_step(tokens='sum'): loss_fn must return a pair (sum of the token losses, number of "
                    f"tokens), got {type(got).__name__}; "
                    "e.g. cross_entropy(..., reduction='sum'), (labels != -100).sum()"
                )
            total, count = got[0], self._count(got[1])
        else:
            assert counted is not None, "a count function's count is taken before the loss"
            if not isinstance(got, torch.Tensor):
                raise ValueError(f"loss_fn must return the mean loss over the tokens, got {type(got).__name__}")
            total, count = (got * counted.to(got.dtype) if bool(counted != 0) else _no_tokens(got, output)), counted
        if term is not None:
            total = total + term.to(total.dtype)
        self.counts.append(count.to(torch.float64 if total.dtype == torch.float64 else torch.float32))
        return total

    @staticmethod
    def _count(count: Any) -> torch.Tensor:
        count = torch.as_tensor(count).detach()
        if count.dim() != 0 or count.dtype.is_complex:
            raise ValueError(f"the token count must be a scalar, got a tensor of shape {tuple(count.shape)}")
        return count

    def backward(self, action: Action) -> None:
        try:
            self._backward(action)
        except Exception as err:
            # (sw.remat's regions run torch's checkpoint too: a failure there is not a layer's own call)
            if _raised_in_checkpoint(err) and not recomputes(layer.fn for layer in self.chain):
                err.add_note(_CHECKPOINT_INSIDE)
            raise

    def _backward(self, action: Action) -> None:
        s, m = action.require("stage"), action.mb
        if (s, m) in self._covered:  # done by the call of the run's top stage
            return
        lowest = self._tops.get((s, m))
        if lowest is not None:
            self._joined_backward(s, lowest, m)
            return
        saved = self._saved[(s, m)]
        want_inputs = action.kind in (BACKWARD, BACKWARD_INPUT)
        want_weights = action.kind in (BACKWARD, BACKWARD_WEIGHT)
        if saved.weight_part is not None:  # W after its I: only the weights' branches
            weight_part(saved.weight_part)
            saved.weight_part = None
            self._weights_done(s, m, saved)
            return
        if saved.output_grads is None:
            saved.output_grads = self._output_grads(s, m, saved)
        pairs = [
            (o, g) for o, g in zip(saved.outputs, saved.output_grads, strict=True) if g is not None and o.requires_grad
        ]
        outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        got: list[torch.Tensor | None] = [None] * len(saved.inputs)
        if want_inputs and not want_weights and pairs and saved.inputs:  # I: the graph stays for W
            whole = recomputes(self.chain[n].fn for n in self.placement.stages[s])
            got, saved.weight_part = input_part(outputs, seeds, saved.inputs, list(saved.params.values()), whole=whole)
        elif want_weights and pairs:
            # B or W: weight gradients accumulate into the step's leaves (in place after the first);
            # B also leaves each input's gradient in its (per micro-batch) leaf.
            wrt = (saved.inputs if want_inputs else []) + list(saved.params.values())
            if wrt:
                accumulate_backward(outputs, seeds, wrt)
            if want_inputs:
                got = [x.grad for x in saved.inputs]
        if want_inputs:
            if saved.inputs and all(g is None for g in got) and self._earlier_layers_own_params(s):
                self._not_reaching(s)
            # An input the stage did not use still gets a (zero) gradient: upstream expects one per output.
            self._input_grads[(s, m)] = [
                g if g is not None else torch.zeros_like(x) for g, x in zip(got, saved.inputs, strict=True)
            ]
        if want_weights:
            self._weights_done(s, m, saved)

    def _weights_done(self, s: int, m: int, saved: _Saved) -> None:
        del self._saved[(s, m)]
        if self.poison:
            self._poison(s, saved)

    def _joined_backward(self, top: int, lowest: int, m: int) -> None:
        """The whole backwards of stages ``top`` down to ``lowest`` (micro-batch ``m``) as one autograd
        call: weight gradients into the step's leaves, ``lowest``'s input gradients kept for the stage
        below, as the backwards one by one would leave them."""
        saved = self._saved[(top, m)]
        bottom = self._saved[(lowest, m)]
        grads = self._output_grads(top, m, saved)
        pairs = [(o, g) for o, g in zip(saved.outputs, grads, strict=True) if g is not None and o.requires_grad]
        # Every stage's leaves once (a tied weight is a leaf of each stage that uses it), in stage order.
        leaves = {id(leaf): leaf for s in range(lowest, top + 1) for leaf in self._saved[(s, m)].params.values()}
        wrt = [*bottom.inputs, *leaves.values()]
        if pairs and wrt:
            accumulate_backward([o for o, _ in pairs], [g for _, g in pairs], wrt)
        for s in range(top, lowest, -1):  # each joined input must have had a gradient, as in backward
            part = self._saved[(s, m)]
            if part.reached and not any(part.reached) and self._earlier_layers_own_params(s):
                self._not_reaching(s)
            self._outputs.pop((s - 1, m), None)
        got = [x.grad for x in bottom.inputs]
        if bottom.inputs and all(g is None for g in got) and self._earlier_layers_own_params(lowest):
            self._not_reaching(lowest)
        self._input_grads[(lowest, m)] = [
            g if g is not None else torch.zeros_like(x) for g, x in zip(got, bottom.inputs, strict=True)
        ]
        saved.output_grads = grads
        for s in range(lowest, top + 1):
            part = self._saved.pop((s, m))
            if self.poison and s in (lowest, top):
                self._poison(s, part)

    def _not_reaching(self, s: int) -> None:
        previous = self.placement.stages[s - 1][-1]
        raise ValueError(
            f"the output of layer {previous!r} does not reach the loss: no gradient flows back through "
            f"layer {self.placement.stages[s][0]!r}, so the layers before it would never train; make the "
            "next layers use their input (a layer that ignores it cuts the chain)"
        )

    def _output_grads(self, s: int, m: int, saved: _Saved) -> list[torch.Tensor | None]:
        if s == self.placement.last:
            return [torch.full_like(saved.outputs[0], self.seed)]
        if self.placement.stage_rank[s + 1] == self.placement.stage_rank[s]:
            grads: Sequence[torch.Tensor] = self._input_grads.pop((s + 1, m))
        else:
            grads = self._inbox.pop(("grad", s + 1, m))
        self._outputs.pop((s, m), None)
        if len(grads) != len(saved.outputs):
            raise RuntimeError(
                f"stage {s}, micro-batch {m}: {len(grads)} gradients came back for {len(saved.outputs)} outputs"
            )
        return list(grads)

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
        grads = self.boundaries[s - 1].grads
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

    def _poison(self, s: int, saved: _Saved) -> None:
        """Fill what this (stage, micro-batch) received with NaN once it is used up: reusing a stale
        buffer would then show in the result. That is the activations received from another rank
        and the output gradients, also those handed over in memory (nothing uses them after this
        backward); activations handed over in memory are left alone (their producer's graph holds them)."""
        received = list(saved.output_grads or []) if s != self.placement.last else []
        if s > 0 and self.placement.stage_rank[s - 1] != self.placement.stage_rank[s]:
            received += saved.inputs
        with torch.no_grad():
            for t in received:
                if t is not None:
                    t.fill_(float("nan"))

    # -- end of step -----------------------------------------------------------------------------------
    def local_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every held parameter's accumulated gradient (zeros for one no forward reached)."""
        assert self.source.compute is not None
        out: dict[str, dict[str, torch.Tensor]] = {}
        for layer, tensors in self.source.compute.items():
            out[layer] = {}
            for name, t in tensors.items():
                leaf = self._leaves.get((layer, name))
                out[layer][name] = leaf.grad if leaf is not None and leaf.grad is not None else torch.zeros_like(t)
        return out

    def finish_grads(self, action: Action) -> None:
        """The gradients the optimizer gets (``final_grads``) and this rank's share of the metrics."""
        self._check_no_gather_pending()
        incoming = self.source.incoming
        if incoming is not None and incoming.in_flight:
            raise RuntimeError(
                f"{incoming.in_flight} all-gathers of the last step's updated shards were never waited for "
                "before the update (which writes the shards they read): the Plan lists a wait_params for each"
            )
        if self.source.sharding is not None:
            self.final_grads = dict(self._grad_shards)
        else:
            self.final_grads = self.finalize(self.local_grads())
        if self.bindings is not None:  # kept for the next step, without this one's gradients
            self.bindings.clear_grads()
        else:
            # Only the forwards and backwards read the compute copies: released, with the leaves
            # and bound layers that hold them, before the update's allocations (under a precision
            # policy, a copy of the parameters a rank holds whole).
            self._leaves.clear()
            self._bound.clear()
            self.source.compute = None
        if self.exchange.empty:
            return
        counted: Any = (
            {k: v for k, v in self.final_grads.items() if k not in self.replica_layers}
            if self.replica_layers else self.final_grads
        )
        if not self.metric_axes:  # one rank: nothing to exchange, the values are already global
            loss_sum = torch.stack(self.losses).sum() if len(self.losses) > 1 else self.losses[0]
            norm = global_norm(counted) if self.exchange.norm else None
            finite = not self.exchange.finite or bool(all_finite(list(optree.tree_leaves(counted))))
            count = torch.stack(self.counts).sum() if self.exchange.count else None
            self.summed = Summed(loss_sum, None if norm is None else norm * norm, finite, exact_norm=norm, count=count)
            return
        losses, counts = self.losses, self.counts
        pieces: list[torch.Tensor] = list(optree.tree_leaves(counted))
        if self.counted is not None:  # an index of a split's axis that counts only its split gradients
            if not self.counts_losses:
                losses, counts = [], []
            pieces = _counted_pieces(counted, self.counted)
        self._local_metrics = self.exchange.local(
            losses, pieces, self.metric_dtype, self.device, counts, self.batch_fingerprint, self._rank,
            self.step_digest,
        )

    def _check_no_gather_pending(self) -> None:
        for key in [k for k in self._pending if k[0] == "gather"]:
            raise RuntimeError(f"gather of unit {key[1]!r} issued but never waited for")

    def check_replicas(self, action: Action) -> None:
        """Issue the all-gather of a checksum of this rank's replicated gradients over a split's axis:
        they must be the same on every index (else a replicated parameter was used on per-rank values
        without its gradient being summed, or random ops differed)."""
        axis = action.require("axis")
        replicas = self.replicas.get(axis)
        pieces = _counted_pieces(self.final_grads, replicas.selection) if replicas is not None else []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        absolute = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in pieces:
            total = total + g.double().sum()
            absolute = absolute + g.double().abs().sum()
        batch = torch.zeros((), dtype=torch.float64) if self.batch_fingerprint is None else self.batch_fingerprint
        local = torch.stack([total, absolute, batch.to(device=self.device, dtype=torch.float64)])
        self._checks[axis] = all_gather_async(local, axis, mesh=self.mesh)

    def wait_check(self, action: Action) -> None:
        axis = action.require("axis")
        assert axis in self._checks, f"wait_check over {axis!r} before its check_replicas"
        every = self._checks.pop(axis).wait()
        if not torch.equal(every[:, 2], every[0, 2].expand(every.shape[0])):  # computed alike from one batch
            raise ValueError(different_batches(f"the ranks of axis {axis!r}"))
        # Equal bitwise when right: every index sums the same values in the same order (a sum over
        # the axis gives every index the same bits), so any difference, however small, is a missed sum.
        if not _equal_rows(every[:, :2]):
            replicas = self.replicas.get(axis)
            by, fix = ("the split", "") if replicas is None else (replicas.by, replicas.fix)
            raise ValueError(
                f"{by}: the gradients of the replicated parameters differ between the ranks of axis "
                f"{axis!r} (checksums {every.tolist()}), so their copies would drift apart. {fix}"
            )

    def reduce_metrics(self, action: Action) -> None:
        """Sum this rank's share over ``action.axis``: the first axis asynchronously (the update need
        not wait for it unless it uses the sums), later axes once the first is in."""
        axis = action.require("axis")
        if self._metrics_handle is None and self._metrics_total is None:
            if self._local_metrics is None:
                raise RuntimeError("reduce_metrics before finish_grads")
            self._metrics_handle = psum_async(self._local_metrics, axis, mesh=self.mesh)
            return
        self._complete_first_metrics()
        assert self._metrics_total is not None
        self._metrics_total = psum(self._metrics_total, axis, mesh=self.mesh)
        self.summed = self.exchange.unpack(self._metrics_total)

    def wait_metrics(self, action: Action) -> None:
        self._complete_first_metrics()

    def _complete_first_metrics(self) -> None:
        if self._metrics_handle is not None:
            self._metrics_total = self._metrics_handle.wait()
            self._metrics_handle = None
            self.summed = self.exchange.unpack(self._metrics_total)

    def run_update(self, action: Action) -> None:
        """The optimizer on this rank's master tree, or (ZeRO-1/2, the action naming a bucket) on that
        bucket's units alone, so that its all-gather is issued while the next bucket updates."""
        if action.layer is not None:
            units = action.units or (action.layer,)
            part = self.update({u: self.final_grads[u] for u in units}, self.summed, units)
            self.new_master = {**(self.new_master or {}), **part}
            return
        self.new_master = self.update(self.final_grads, self.summed)
        sharding = self.source.sharding
        if sharding is None or sharding.holds_shards:
            self.new_held = self.new_master


def _require_grad(inputs: Sequence[torch.Tensor]) -> None:
    for t in inputs:
        t.requires_grad_(True)


def _reaches(y: torch.Tensor, x: torch.Tensor, budget: int = 32) -> bool | None:
    """Whether ``y``'s autograd graph leads to ``x`` (its producing node, at ``x``'s output index): True
    or False once the walk is done, None when the graph has more than ``budget`` nodes (then ask a
    hook). A layer's backward reaches its input exactly when its graph leads there."""
    if y is x:
        return True
    target, index, start = x.grad_fn, x.output_nr, y.grad_fn
    if target is None or start is None:
        return None
    # Breadth first: a residual block's output is its input plus a branch, so the input's node is
    # two levels down, where a depth-first walk would spend the budget inside the branch first.
    queue, seen, head = [start], {start}, 0
    while head < len(queue):
        budget -= 1
        if budget < 0:
            return None
        head += 1
        for node, nr in queue[head - 1].next_functions:
            if node is None:
                continue
            if node is target and nr == index:
                return True
            if node not in seen:
                seen.add(node)
                queue.append(node)
    return False


def _mark(reached: list[bool], k: int, grad: torch.Tensor) -> None:
    """A joined stage input's gradient hook: note that a gradient reached it (and leave it as it is)."""
    reached[k] = True


def _equal_rows(rows: torch.Tensor) -> bool:
    """Every row bitwise the first, NaN equal to NaN in the same place: gradients that overflowed alike
    (a loss scale too large, to be skipped) give every rank the same NaN checksum."""
    nan = rows.isnan()
    first = rows[:1].expand_as(rows)
    return torch.equal(nan, nan[:1].expand_as(nan)) and torch.equal(rows.nan_to_num(0.0), first.nan_to_num(0.0))


def _counted_pieces(grads: Any, counted: Any) -> list[torch.Tensor]:
    """The gradients (or, of ZeRO's flat shards, the ranges) that ``counted`` names."""
    if isinstance(counted, frozenset):
        return [g for layer, tensors in grads.items() for name, g in tensors.items() if (layer, name) in counted]
    return [grads[u][a:b] for u, ranges in counted.items() if u in grads for a, b in ranges]


_CHECKPOINT_INSIDE = (
    "shardwise: a layer calls torch.utils.checkpoint in its forward (its own call, or a checkpoint_wrapper): "
    "the checkpoint runs the forward again in this backward, outside the pure layer's call, on parameters "
    "the layer does not hold, which cannot work. Take the checkpoint out of the layer and recompute with "
    "sw.remat(step) (for a Hugging Face model: model.activation_checkpointing_disable())."
)


def _raised_in_checkpoint(err: BaseException) -> bool:
    """Whether ``err`` was raised inside torch.utils.checkpoint (its traceback passes through it)."""
    module = sys.modules.get("torch.utils.checkpoint")  # not imported: nothing ran a checkpoint
    where = getattr(module, "__file__", None)
    if where is None:
        return False
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == where:
            return True
        tb = tb.tb_next
    return False


def _describe(tree: Any) -> str:
    """A layer input in a few words: each tensor's dtype and shape."""
    parts = [
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        for t in optree.tree_leaves(tree)
    ]
    text = ", ".join(parts[:6]) + (f", ... ({len(parts)} leaves)" if len(parts) > 6 else "")
    return text or "no tensor"
