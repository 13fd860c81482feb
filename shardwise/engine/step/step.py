"""The training step as a value: the single-device reference, and every transformed step.

``train_step(chain, loss_fn, optimizer)`` returns a :class:`Step`: an immutable
value with ``init(params, mesh) -> TrainState``, ``step(state, batch) ->
(state, metrics)`` and ``plan(mesh, params, batch) -> Plan``. Transforms
(shard_params, pipeline, mixed_precision, remat) append a frozen spec to
``step.transforms`` (``engine/stack/compose.py`` checks the stack); the step then runs
the lowering of its whole stack (``engine/plan/lower.py``) on the one executor
(``engine/run/executor.py``). With no transform it computes exactly what
``loss.backward(); optimizer.step()`` computes on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ..checkpoint.arguments import check_state as require_state
from ..checkpoint.names import module_params
from ..layout.devices import device_of
from ..layout.precision import Precision
from ..layout.state import Params, TrainState, check_params
from ..layout.state_layout import StateLayout, full_params
from ..model.chain import Chain
from ..model.embedding_options import refuse_sparse
from ..model.materialize import unfilled_frozen
from ..model.pytrees import plain_batch
from ..model.whole_batch import called_modules
from ..optim import foreach as fe
from ..optim.optimizers import Optimizer, tensor_leaves
from ..plan.accounting import predict_kept_for_backward
from ..plan.actions import Plan
from ..plan.lower import metric_axes
from ..run.agreement import check_ranks_agree, fingerprint, stable_text
from ..run.executor import LossFn
from ..run.metrics import REPORTABLE, MetricExchange, check_metrics
from ..run.model_agreement import buffer_items, structure_items, value_items
from ..run.rng import untouched
from ..stack import in_layer
from ..stack.compose import PLACEMENT, REWRITE, SHARDING, describe, find, sums_over_batch
from ..stack.elementwise import check_optimizer
from ..stack.splits import Splits, splits_of
from .batch_cut import PER_SHARD_MEAN, batch_shares
from .donation import check_not_consumed, mark_consumed, mark_updated
from .held_check import expected_trees
from .init_state import held_params, init_seeding, meta_names
from .layouts import build_layout, check_mesh, layouts_by_index, refuse_unused_axes, stage_boundaries
from .master import clip_scale, compute_params, master_meta, master_params
from .param_groups import check_clipping, master_runs, param_options
from .planning import plan_of
from .run_inputs import finish_run, prepare_run
from .state_check import StateMemo, check_layout, note_returned

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Step:
    """A training step as a value: the chain, the loss and the optimizer, and the transforms on them.

    ``loss_fn(output, targets)`` returns the *mean* loss over the batch (the
    default reduction of torch's losses), so that a step on a split batch can be
    made equal to the step on the whole batch; or, with ``tokens`` (see
    :func:`train_step`), a token sum and count, or a mean over counted tokens. ``transforms`` is the stack of
    frozen specs the transforms appended, innermost first.
    """

    chain: Chain
    loss_fn: LossFn
    optimizer: Optimizer
    clip_norm: float | None = None
    precision: Precision | None = None  # set by mixed_precision
    metrics: tuple[str, ...] = REPORTABLE  # what the step reports (see shardwise.engine.run.metrics)
    tokens: Any = None  # how the loss weighs the batch (see train_step)
    transforms: tuple[Any, ...] = ()
    # The chain as train_step got it, once a rewriting transform made ``chain`` from it.
    source_chain: Chain | None = None
    trace: bool | None = None  # whether a step reports when each of its Plan's actions ran (with_trace);
    # None: as its pipeline says (pipeline(..., trace=True)), else not

    @property
    def base_chain(self) -> Chain:
        """The chain before any rewriting transform (mixed_precision, remat)."""
        return self.chain if self.source_chain is None else self.source_chain

    # -- the stack ----------------------------------------------------------------------------
    @property
    def pipeline_spec(self) -> Any:
        """The pipeline's spec, if the step is pipelined."""
        return find(self.transforms, PLACEMENT)

    @property
    def sharding_spec(self) -> Any:
        """shard_params' spec, if the step is data parallel with ZeRO sharding."""
        return find(self.transforms, SHARDING)

    @functools.cached_property
    def split(self) -> Splits:
        """The stack's splits (tensor_parallel, say; one per axis) as one, or NO_SPLIT, which cuts nothing."""
        return splits_of(self.transforms)

    def local_view(self, params: Params, mesh: Mesh | None, rank: int | None = None) -> Params:
        """The parameters as ``rank`` (default: the calling rank) computes with them: under a split
        transform its slices of the split ones, else ``params`` itself."""
        return self.split.local_view(self.base_chain, params, mesh, rank)

    def predicting(self, mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
        """A block in which the layers may run on fake tensors: a split's collectives move nothing, they
        record what they would issue into the list it yields."""
        return _predicting(self, mesh)

    @functools.cached_property
    def parallel_transforms(self) -> tuple[Any, ...]:
        """The transforms of the stack that cut the model or the batch over a mesh axis (not a REWRITE's, such as
        mixed_precision or remat, which run on one device as well)."""
        return tuple(spec for spec in self.transforms if spec.role != REWRITE)

    @functools.cached_property
    def stack_key(self) -> tuple[str, ...]:
        """Each transform's text form: what a TrainState records of the step that made it (read
        once per step value, not at every call)."""
        return tuple(str(spec) for spec in self.transforms)

    def describe(self) -> str:
        """The transform stack in text, innermost first."""
        return describe(self.transforms)

    # -- metrics, shared by every kind of step --------------------------------------
    def with_metrics(self, metrics: Iterable[str]) -> Step:
        """This step reporting ``metrics`` instead (any of ``"loss"``, ``"grad_norm"``; ``()`` for
        none). It takes and returns the same states and updates them in the same way."""
        other = dataclasses.replace(self, metrics=check_metrics(metrics))
        # A loop may make one per call: the rules' words are read once, on this step, and handed on.
        other.__dict__["_rule_texts"] = self._rule_texts
        return other

    def with_trace(self, on: bool = True) -> Step:
        """This step also reporting when each action of its rank's Plan ran: ``metrics["action_times"]``,
        ``(position in the rank's Plan actions, start, end)`` per action (``time.perf_counter``
        seconds; the collectives a compute issues inside its layers, under a split, at
        their own positions, within their compute's time), what ``PlanTimeline.from_measured``
        and ``PlanCosts.fit`` read, and
        ``metrics["trace"]``, the computes as ``(rank, label, start, end)``. Any stack can be
        traced (``pipeline(..., trace=True)`` is the same for a pipelined one); it costs two clock
        reads per action (and, under a split, a context variable set per compute and two
        clock reads per in-layer collective). ``with_trace(False)`` turns it off, a pipeline's
        ``trace=True`` included. The states and updates are unchanged.

        >>> import torch, shardwise as sw
        >>> from shardwise.testing.models import mlp
        >>> chain, params = sw.functionalize(mlp([4, 8, 2]))
        >>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
        >>> traced, batch = step.with_trace(), (torch.randn(8, 4), torch.randn(8, 2))
        >>> def one_step():
        ...     return traced(traced.init(params, sw.Mesh(dp=2)), batch)[1]["action_times"]
        >>> times = sw.launch(one_step, world=2)
        >>> [len(t) for t in times] == [len(a) for a in traced.plan(sw.Mesh(dp=2), params, batch).actions]
        True
        """
        return dataclasses.replace(self, trace=bool(on))

    @property
    def traced(self) -> bool:
        """Whether a step reports its action times (:meth:`with_trace`, or ``pipeline(..., trace=True)``)."""
        if self.trace is not None:
            return self.trace
        pipe = self.pipeline_spec
        return bool(pipe is not None and pipe.trace)

    @property
    def needs_norm(self) -> bool:
        """Whether the step computes the global gradient norm: reported, or needed to clip."""
        return "grad_norm" in self.metrics or self.clip_norm is not None

    @property
    def update_needs_sums(self) -> bool:
        """Whether the update depends on the summed values: clipping by the global norm, skipping
        everywhere on a gradient that is not finite somewhere, or dividing by the global token count."""
        return self.clip_norm is not None or self.precision is not None or self.token_weighted

    @property
    def token_weighted(self) -> bool:
        """Whether the loss is weighed by counted tokens (``tokens="sum"`` or a count function), so that
        the step divides the summed losses by the global count; not for None or ``"per_shard_mean"``."""
        return self.tokens is not None and not (isinstance(self.tokens, str) and self.tokens == PER_SHARD_MEAN)

    def metric_exchange(self) -> MetricExchange:
        """What the ranks of this step sum after the backward (nothing, if no metric or rule needs it)."""
        return self._metric_exchange

    @functools.cached_property
    def _metric_exchange(self) -> MetricExchange:
        # Read at every call of the step; it depends only on the step's own fields.
        values = MetricExchange(
            loss="loss" in self.metrics, norm=self.needs_norm, finite=self.precision is not None,
            count=self.token_weighted,
        )
        # The batch fingerprints ride along an exchange that happens anyway: a step that sums
        # nothing neither exchanges nor computes them (hashing the batch costs a few ms a step).
        return values if values.empty else dataclasses.replace(values, batch=bool(metric_axes(self)))

    def report(self, loss: torch.Tensor | None, norm: torch.Tensor | None) -> Metrics:
        """The asked-for metrics, from the global mean loss and gradient norm (given when asked for)."""
        metrics: Metrics = {}
        if "loss" in self.metrics:
            assert loss is not None, "the step's loss was asked for but not computed"
            metrics["loss"] = loss
        if "grad_norm" in self.metrics:
            assert norm is not None, "the step's gradient norm was asked for but not computed"
            metrics["grad_norm"] = norm
        return metrics

    # -- precision ------------------------------------------------------------------
    def master_params(self, params: Params) -> Params:
        """Detached copies of the parameters in the stored (master) dtype of each layer's policy."""
        return master_params(self.precision, params)

    def master_meta(self, params: Params) -> Params:
        """The master parameters as meta tensors: shapes and stored dtypes, no data."""
        return master_meta(self.precision, params)

    def initial_loss_scale(self) -> Any:
        return None if self.precision is None else self.precision.loss_scale

    def loss_scale_value(self, state: TrainState) -> float:
        # Checked at every step: a state's scale may have been replaced (_replace) since it was made.
        return 1.0 if state.loss_scale is None else state.loss_scale.checked().scale_value()

    def finish(
        self, state: TrainState, grads: Any, params: Any, norm: torch.Tensor | None, finite: bool,
        opt_state: Any = None,
    ) -> tuple[Any, Any, Any]:
        """Clip and update, or skip the update when a gradient anywhere was not finite.

        ``grads`` are unscaled and in the dtype of ``params`` (what the
        optimizer updates), and the step's own: clipping scales them in place. ``norm`` is the
        global gradient norm, needed only with ``clip_norm``. ``opt_state``: the optimizer state of
        ``params`` when they are a part of the state's (ZeRO-1/2 update bucket by bucket); None:
        ``state.opt_state``. Returns (params, optimizer state, loss scale).
        """
        scale = state.loss_scale
        opt_state = state.opt_state if opt_state is None else opt_state
        if not finite:
            # Every rank saw the same global flag, so every rank skips together.
            return params, opt_state, None if scale is None else scale.adjust(False)
        if self.clip_norm is not None:
            if norm is None:
                raise ValueError("Step.finish: clip_norm is set, so the global gradient norm must be given")
            # In place, with one foreach call per dtype (as clip_grad_norm_): the step made these
            # gradients and reads them nowhere else, and fresh copies of them would cost a
            # page-faulting allocation of the model's size every step.
            factor = clip_scale(norm, self.clip_norm)
            if not _reads_one(factor):
                fe.mul_tensor(tensor_leaves(grads), factor, inplace=True)
        new_params, new_opt_state = self._update(state, grads, params, opt_state)
        return new_params, new_opt_state, None if scale is None else scale.adjust(True)

    def _update(self, state: TrainState, grads: Any, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The optimizer's update; a grouped one is told each leaf's options range by range
        (under ZeRO a flat shard mixes parameters of different groups)."""
        groups = getattr(self.optimizer, "groups", None)  # a user's optimizer may have no groups
        if groups is None:
            return self.optimizer.update(grads, opt_state, params)
        layout, sharding = self._state_layout(state), state.layout.sharding
        dp_index = 0 if sharding is None else state.mesh.axis_index(sharding.axis)
        runs = master_runs(groups, self.base_chain, layout, params, dp_index)
        return self.optimizer.update(grads, opt_state, params, runs=runs)

    # -- layout ------------------------------------------------------------------------
    def check_mesh(self, mesh: Mesh | None) -> Mesh | None:
        """``mesh``, refused (naming the transform and the axis) unless it has every axis the stack uses."""
        return check_mesh(self.transforms, mesh)

    def check_axes_used(self, mesh: Mesh | None) -> None:
        """Refuse a mesh axis of more than one rank that no transform of this step goes over (``init`` and
        ``sw.checkpoint.load``, where a state is made for it): each rank along it would train its own model."""
        refuse_unused_axes(self.transforms, mesh)

    def layout(self, mesh: Mesh | None, params: Params, rank: int | None = None) -> StateLayout:
        """How this step lays out ``params`` on ``mesh``, as seen by ``rank`` (default: the calling
        rank inside a launched program, else rank 0): the placement of layers, the per-leaf shard
        specs, and that rank's flat units."""
        return build_layout(self, mesh, params, rank)

    def layouts_by_index(self, mesh: Mesh | None, params: Params, rank: int | None = None) -> dict[int, StateLayout]:
        """:meth:`layout` for every pipeline index, of the ranks with ``rank``'s split index (made together:
        they share every spec)."""
        return layouts_by_index(self, mesh, params, rank)

    def boundaries(self, layout: StateLayout, inputs: Any, mesh: Mesh | None = None) -> Any:
        """The (shape, dtype) of every tensor each pipeline stage passes on, for micro-batch ``inputs``
        (memoised per input layout; None when the chain cannot run on fake tensors)."""
        return stage_boundaries(self, layout, inputs, mesh)

    # -- state ----------------------------------------------------------------
    def check_not_consumed(self, state: TrainState) -> None:
        """Refuse ``state`` when an in-place update of this step already wrote past it (a step, or
        ``sw.checkpoint.save``, would read the tensors of a later state under its step count)."""
        check_not_consumed(self, state)

    def check_state(self, state: TrainState) -> None:
        """Refuse ``state`` when it cannot be read as this step's: consumed by an in-place update, or
        with parameters or optimizer state not laid out as ``init`` laid them out (cast, replaced:
        see state_check). A
        state of another step is left to the caller's own refusal of it."""
        if not isinstance(state, TrainState):
            require_state("step.full_params(state)", state)
        check_not_consumed(self, state)
        layout = state.layout if isinstance(state, TrainState) else None
        if isinstance(layout, StateLayout) and layout.stack == self.stack_key:
            check_layout(self, state, layout)

    def check_ranks_agree(
        self, mesh: Mesh | None, layout: StateLayout, parts: dict[str, object], device: torch.device,
        buffer_values: bool = True,
    ) -> None:
        """Refuse, on every rank alike, a rank that built another step than rank 0's: its stack, schedule
        and mesh, its model (each layer's structure and code, its buffers' values unless
        ``buffer_values=False``: a checkpoint's load, which gives every rank the saved ones), ``parts``
        (where its state comes from), and what else decides the update (optimizer, loss, precision,
        clipping). ``init`` and ``sw.checkpoint.load`` call it (every rank: it gathers)."""
        if mesh is None or not (self.transforms and any(getattr(s, "axis", None) for s in self.transforms)):
            return
        check_ranks_agree(mesh, {
            "transform stack": self.describe(),
            "schedule": str(layout.schedule),
            "mesh": repr(mesh),
            "model's structure and code": structure_items(self.base_chain),
            **({"buffer values": buffer_items(self.base_chain)} if buffer_values else {}),
            **parts,
            **self._update_rules(),
        }, device)

    def _update_rules(self) -> dict[str, object]:
        """What else decides the update: one rank with another learning rate, momentum or clipping
        would train on silently (under ZeRO each updates its own shard)."""
        return {
            "optimizer": self.optimizer,
            "loss function": self.loss_fn,
            "precision policy": self.precision,
            "gradient clipping": self.clip_norm,
            "token weighting": self.tokens,
            "metrics": self.metrics,
        }

    @functools.cached_property
    def agreement_digest(self) -> float:
        """A number in [-1, 1) of this step's stack and update rules, the same on every rank (and
        process) that built the same step: summed with the metrics at every call, so that a rank
        that switched to another step (another learning rate, say) after ``init`` is refused."""
        texts = {**self._rule_texts, "metrics": repr(self.metrics)}
        (digest,) = fingerprint({"step": self.describe() + repr(sorted(texts.items()))})
        return digest / 2.0**51 - 1.0

    @functools.cached_property
    def _rule_texts(self) -> dict[str, str]:
        """The update rules but the metrics in words (reading a loss's captured tensors costs a pass
        over them): kept by :meth:`with_metrics`, which changes only the metrics."""
        return {name: stable_text(v) for name, v in self._update_rules().items() if name != "metrics"}

    def init(self, params: Params, mesh: Mesh | None = None, *, seed: int = 0,
             source: Any = None) -> TrainState:
        """Build this rank's TrainState from the model's parameters (every rank passes the same).

        A rank holds only its own part (its pipeline stages' layers, its tensor-parallel slices,
        its ZeRO shards) and builds it one layer at a time: its peak is its part plus one full
        layer. Meta parameters (a model built on the meta device, functionalized) are made
        here, each from the module's own initializer seeded from ``(seed, its path)``, on the
        device functionalize was given: the same values on every mesh and stack as on one
        device (docs/guide.md, "Models larger than one rank"). Real ones are copied (or cut), so
        the state never shares memory with ``params``.

        ``seed`` also starts the step's random streams (dropout): every rank passes the same;
        each rank, stage, micro-batch and step draws its own stream from it.

        ``source`` (a weights file's reader: ``sw.checkpoint.init_from_pretrained``, ``sw.checkpoint.init_from_dcp``)
        gives the meta parameters' values instead: ``source.read_into(layer, name, into, layout, mesh,
        shard=)`` reads, one layer at a time, of each parameter only what this rank keeps, straight
        into the rank's own tensor of it (its flat shard at ZeRO-3, else its slice). A parameter it
        does not read (``source.reads``: a new head) is made as above and ``source.place``-d so.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"init(seed={seed!r}): the seed of the step's random streams is an int")
        mesh = self.check_mesh(mesh)
        self.check_axes_used(mesh)
        check_optimizer(self.transforms, self.optimizer)  # again: one replaced after the transforms were applied
        check_params(self.chain, params)
        _refuse_unfilled_frozen(self.base_chain)
        self._check_module_shapes(params)
        # (a source reads the meta parameters; one it does not read, a new head, is made as without one)
        maker = self._parameter_maker(params if source is None else {
            layer: {n: t for n, t in given.items() if not source.reads(layer, n)} for layer, given in params.items()})
        layout = self.layout(mesh, params)
        groups = getattr(self.optimizer, "groups", None)
        if groups is not None:  # a group that matches nothing is refused before anything is made
            param_options(groups, self.base_chain, layout)
            check_clipping(groups, self.base_chain, layout, self.clip_norm)
        self.check_ranks_agree(mesh, layout, {
            "parameter names, shapes and dtypes": repr(
                [(k, n, tuple(t.shape), t.dtype) for k, v in params.items() for n, t in v.items()]
            ),
            # Every value, exactly: ranks that built the model themselves from different seeds (or
            # loaded other checkpoints) start from different weights, and a rank whose weights differ
            # in one element trains another model as surely.
            "parameter values": value_items(params),
            "how meta parameters are made": "; ".join(
                ([] if source is None else [source.describe()]) + ["none" if maker is None else maker.describe()]),
            "parameter init_fn": None if maker is None else maker.init_fn,
            "seed": str(seed),
        }, source.device if source is not None else self._agreement_device(params, maker))
        index = layout.index_of(mesh)
        sharding = layout.sharding
        dp_index = 0 if sharding is None or mesh is None else mesh.axis_index(sharding.axis)

        def make(layer: str, names: list[str]) -> dict[str, torch.Tensor]:
            given = params.get(layer, {})
            made = {n: t for n, t in given.items() if n in names and not t.is_meta}
            missing = [n for n in names if n not in made]
            if missing:
                assert maker is not None  # _parameter_maker refused meta parameters without one
                made.update(maker.tensors(layer, missing, seed, lambda s: init_seeding(s, maker.device)))
            return made

        shapes = {k: {n: t.to("meta") for n, t in v.items()} for k, v in params.items()}

        def to_local(layer: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            local = self.local_view({**shapes, layer: {**shapes[layer], **values}}, mesh)[layer]
            return self.master_params({layer: {n: local[n] for n in values}})[layer]

        def read(layer: str, name: str, into: torch.Tensor, shard: bool) -> None:
            if source.reads(layer, name):
                source.read_into(layer, name, into, layout, mesh, shard=shard)
            else:
                source.place(make(layer, [name])[name], layer, name, into, layout, mesh, shard=shard)

        held, update_tree = held_params(shapes, layout, index, dp_index, make, to_local,
                                        None if source is None else read,
                                        None if source is None else source.device)
        return TrainState(
            held, self.optimizer.init(update_tree), 0, self.initial_loss_scale(), mesh=mesh, layout=layout, rng=seed
        )

    def _check_module_shapes(self, params: Params) -> None:
        """Refuse a parameter whose shape is not its module's: the module's forward would broadcast it (a
        bias of [1]) or fail deep inside; functionalize's params, or a checkpoint of this model, fit."""
        for (layer, name), want in module_params(self.base_chain).items():
            given = params.get(layer, {}).get(name)
            if given is not None and tuple(given.shape) != tuple(want.shape):
                raise ValueError(
                    f"init: params[{layer!r}][{name!r}] has shape {list(given.shape)}, its module's parameter "
                    f"{list(want.shape)}; pass the params functionalize returned for this model (or load them "
                    "with sw.checkpoint.init_from_state_dict)"
                )

    @staticmethod
    def _agreement_device(params: Params, maker: Any) -> torch.device:
        device = device_of(params)
        return maker.device if device.type == "meta" and maker is not None else device

    def _parameter_maker(self, params: Params) -> Any:
        """The chain's way of making meta parameters, if ``params`` holds any (refused without)."""
        missing = meta_names(params)
        maker = self.base_chain.init
        if missing and maker is None:
            layer, name = missing[0]
            raise ValueError(
                f"init: params[{layer!r}][{name!r}] (and {len(missing) - 1} more) are meta tensors, with "
                "no values and no way to make them: this chain was not made by functionalize from a "
                "module built on the meta device. Pass real values, or functionalize the meta-built "
                "module (its chain makes each rank's parameters from the module's initializers), or "
                "load them (sw.checkpoint.load, sw.checkpoint.init_from_state_dict)."
            )
        if missing:
            maker.check_can_make_parameters()
        return maker if missing else None

    def _state_layout(self, state: TrainState) -> StateLayout:
        layout = state.layout
        stack = self.stack_key
        if not isinstance(layout, StateLayout) or layout.stack != stack:
            made = layout.stack if isinstance(layout, StateLayout) else "something else"
            raise ValueError(
                f"this TrainState was made by {describe(made) if isinstance(made, tuple) else made}, not by this step "
                f"({self.describe()}). To carry its parameters and optimizer state (moments, step count) "
                "over to this step, save it with sw.checkpoint.save(path, state, the step that made it) and "
                "load it with sw.checkpoint.load(path, this step, mesh); step.init(params, mesh) starts afresh"
            )
        return layout

    def expected_held(self, layout: StateLayout, mesh: Mesh | None) -> Any:
        """This rank's state parameters as init makes them, as meta tensors (see held_check)."""
        return self._expected_trees(layout, mesh)[0]

    def expected_update_tree(self, layout: StateLayout, mesh: Mesh | None) -> Any:
        """What init gives the optimizer's init on this rank, as meta tensors (see opt_check)."""
        return self._expected_trees(layout, mesh)[1]

    def _expected_trees(self, layout: StateLayout, mesh: Mesh | None) -> Any:
        def to_local(shapes: Any, layer: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            local = self.local_view({**shapes, layer: {**shapes[layer], **values}}, mesh)[layer]
            return self.master_params({layer: {n: local[n] for n in values}})[layer]

        return expected_trees(layout, mesh, to_local)

    @functools.cached_property
    def state_memo(self) -> StateMemo:
        """The layouts of the states this step accepted, per rank (see state_check)."""
        return StateMemo()

    def full_params(self, state: TrainState) -> Params:
        """The complete parameters on every rank (collectives, once parameters are sharded or
        pipelined: every rank calls this together)."""
        self.check_state(state)  # consumed by an in-place update, or cast or replaced by hand
        # (Under an in-place optimizer, what it returns holds the state's own tensors where the state holds them
        # whole, as torch's state_dict() does: the next step writes into them. Copying them here would cost the
        # model's size at every evaluation in the very runs that update in place to save memory.)
        return full_params(self._state_layout(state), state.params, state.mesh)

    # -- running --------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        """One training step on the global ``batch``: ``(new state, metrics)`` (every rank passes the same batch)."""
        if not isinstance(state, TrainState):  # (the params functionalize returned, given before step.init)
            require_state("step(state, batch)", state)
        check_not_consumed(self, state)
        batch = plain_batch(batch)  # a tokenizer's BatchEncoding: a dict the batch's pytree code sees into
        # prepare_run refuses a state cast or replaced by hand (state_check), once the world fits the mesh
        prepared = prepare_run(self, state, self._state_layout(state), batch)  # the rank's lowering is cached
        try:
            prepared.run()
            new_state, metrics = finish_run(self, state, prepared)
            note_returned(self, state, new_state)  # where the optimizer's state after an update is not predicted
        except FloatingPointError:  # the loss scale's floor, on a step it skips: nothing was written
            raise
        except BaseException:
            if prepared.updated:  # refused after an in-place update wrote into ``state``
                mark_consumed(self, state, prepared.written())
            raise
        mark_updated(self, new_state)
        return new_state, metrics

    # -- inspection -----------------------------------------------------------
    def plan(self, mesh: Mesh | None = None, params: Params | None = None, batch: Any = None) -> Plan:
        """Per-rank actions of one step: the lowering of the whole transform stack.

        With ``params`` (real or ``device="meta"`` tensors), every communicating action
        also says what it moves (dtype and bytes per tensor), and the plan counts the
        bytes each rank holds; with a ``batch`` too, the pipeline's transfers are sized
        and the activation bytes kept for backward are predicted (on fake tensors: the
        figures ``sw.policies.saved_bytes`` measures). docs/guide.md, "Reading a Plan", reads one.
        """
        return plan_of(self, self.check_mesh(mesh) or Mesh(world=1), params, plain_batch(batch))

    def kept_for_backward(self, params: Params, inputs: Any) -> int:
        """Predicted bytes the layers keep for backward on ``inputs`` (one forward, on fake tensors)."""
        with untouched():  # a run on fake tensors (see _predicting)
            return sum(predict_kept_for_backward(self.chain, self.compute_view(params), plain_batch(inputs)).values())

    def compute_view(self, params: Params) -> Params:
        """The parameters as the layers receive them: the compute copies under a precision policy
        (cast once per step and held anyway, so not counted as kept activations)."""
        return params if self.precision is None else compute_params(self.precision, self.master_params(params))


def _refuse_unfilled_frozen(chain: Any) -> None:
    """A meta-built model's frozen parameters are not made by ``init`` (it makes what trains): they
    come from stored weights. One never loaded is the split's stand-in, a zero: refused, not
    trained around."""
    unfilled = unfilled_frozen(chain)
    if unfilled:
        raise ValueError(
            f"init: the frozen (requires_grad=False) parameters {unfilled[:8]} of this model built on the meta "
            "device hold no values: load them first (sw.checkpoint.init_from_pretrained, init_from_state_dict "
            "or init_from_dcp start the step from stored weights, frozen ones included), or build them trainable "
            "and freeze them in the optimizer (sw.optim.group(..., frozen=True)), which init makes from their "
            "initializers"
        )


def _torch_optimizer(optimizer: Any) -> type | None:
    """The torch optimizer class ``optimizer`` is, or is an instance of (None for anything else)."""
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    return kind if issubclass(kind, torch.optim.Optimizer) else None


def _optimizer_name(optimizer: Any) -> str:
    kind = _torch_optimizer(optimizer)
    if kind is None:
        return repr(optimizer)
    return f"torch.optim.{kind.__name__}" + ("" if kind is optimizer else " (an instance)")


def _torch_twin(optimizer: Any) -> str:
    """For a torch optimizer, which shardwise.optim one computes the same update; else nothing."""
    kind = _torch_optimizer(optimizer)
    if kind is None:
        return ""
    twins = {"AdamW": "shardwise.optim.adamw(lr, betas, eps, weight_decay)", "SGD": "shardwise.optim.sgd(lr, momentum)"}
    groups = "param groups as shardwise.optim.group(pattern or where=..., weight_decay=, lr_scale=, frozen=)"
    if kind.__name__ in twins:
        return (f": a torch optimizer holds its parameters and state itself; use {twins[kind.__name__]}, whose "
                f"update equals torch's, with {groups}")
    return (": a torch optimizer holds its parameters and state itself; shardwise.optim has adamw and sgd (with "
            f"{groups}); for another, write it as a functional optimizer (docs/guide.md, 'Your own optimizer')")


def train_step(
    chain: Chain,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Optimizer,
    *,
    clip_norm: float | None = None,
    metrics: Iterable[str] = REPORTABLE,
    tokens: Any = None,
) -> Step:
    """The single-device training step of ``chain`` under ``loss_fn`` and ``optimizer``.

    ``optimizer`` is ``sw.optim``'s (``sgd``, ``adamw``) or any object with ``init(params) ->
    state`` and ``update(grads, state, params) -> (params, state)`` over pytrees of tensors. On one
    device and in a pipeline its update gets whole parameters; ``shard_params`` hands it one flat
    1-D shard per layer, ``tensor_parallel`` and ``expert_parallel`` slices, so they take a user's
    optimizer only if it declares ``elementwise = True`` (its update treats each element alone: no
    norm or shape of a tensor, which a piece would change), and refuse it otherwise.

    ``clip_norm`` clips the gradient to that global L2 norm before the update,
    as ``torch.nn.utils.clip_grad_norm_`` does (bit for bit; where the norm is
    within the bound on the CPU, the multiply by 1 is skipped: it changes no
    finite value). The metrics report the norm before clipping.

    ``tokens`` says how the loss weighs the batch. ``None``: ``loss_fn`` returns
    the mean over the batch's rows, which split into equal shards, so the mean
    of the shards' means is the global mean. With padding (labels of -100,
    masks) a shard's mean counts its own tokens, and that is no longer true:
    ``tokens="sum"`` has ``loss_fn`` return ``(sum of the token losses, number of
    tokens)``, and ``tokens=count_fn`` has it return the mean over
    ``count_fn(inputs, targets)`` tokens (a Hugging Face model's own loss, with
    ``count_fn = lambda x, _: (x["labels"][:, 1:] != -100).sum()``). The step's
    loss is then the global sum over the global count, under data parallelism,
    micro-batches and accumulation alike: one more value in the step's small
    all-reduce, and the update waits for it. With ``None``, a step that cuts the
    batch (data, context or expert parallel, micro-batches) refuses a batch whose
    integer tensors hold a negative value (padded labels: -100, cross_entropy's
    ``ignore_index``), naming these options; ``tokens="per_shard_mean"`` takes
    the mean of the shards' means knowingly (not the single-device step's loss).
    On its first call such a step also probes that ``loss_fn`` is a mean over the
    rows (on the first rows of a micro-batch's output and their halves; of a
    micro-batch of one row, the row and the row repeated twice) and refuses a
    loss summed over them (``reduction="sum"``), weighted otherwise
    (``cross_entropy(weight=...)``) or over the whole batch (a contrastive loss's
    in-batch negatives), naming these options; with ``tokens="sum"`` or a count
    function, that ``loss_fn`` returns what the mode asks (the sums and counts,
    or loss x count, add up over the halves).

    ``metrics`` names what each call reports: ``"loss"`` (the mean over the whole
    batch) and ``"grad_norm"``, the same values on every rank once the step is
    distributed. Each costs something there (one small all-reduce per step, and a
    pass over every gradient for the norm), so a loop that logs now and then can
    run ``step.with_metrics(())`` in between: the same step on the same states,
    reporting neither (torch's pipeline schedules, for one, report nothing but
    the last stage's losses). What costs nothing is reported either way: under
    ``shard_params``, ``"peak_gathered_bytes"`` (the most gathered parameter
    bytes this rank held at once, which the Plan's ``memory["gathered_peak"]``
    says before the run); under ``mixed_precision``, ``"loss_scale"`` and
    ``"skipped"``.

    >>> import torch, shardwise as sw
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> chain, params = sw.functionalize(
    ...     torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ... )
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9))
    >>> state = step.init(params)
    >>> batch = (torch.randn(16, 4), torch.randn(16, 1))
    >>> state, metrics = step(state, batch)
    >>> sorted(metrics), state.step
    (['grad_norm', 'loss'], 1)
    >>> state, metrics = step.with_metrics(())(state, batch)
    >>> metrics, state.step
    ({}, 2)
    """
    if isinstance(chain, tuple):
        raise TypeError("train_step got a (chain, params) tuple: pass the chain, and give params to step.init(params)")
    if not isinstance(chain, Chain):
        raise TypeError(
            f"train_step(chain=...) needs a shardwise Chain (see functionalize), got {type(chain).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(f"train_step(loss_fn=...) must be callable loss_fn(output, targets), got {loss_fn!r}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"train_step(optimizer=...) needs a functional optimizer such as shardwise.optim.sgd(...), "
                        f"got {_optimizer_name(optimizer)}{_torch_twin(optimizer)}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"train_step(clip_norm={clip_norm!r}): the norm to clip to must be positive")
    if not (tokens is None or (isinstance(tokens, str) and tokens in ("sum", PER_SHARD_MEAN)) or callable(tokens)):
        raise ValueError(
            f"train_step(tokens={tokens!r}): use None (loss_fn returns the mean over the batch), 'sum' (it returns "
            "(sum of token losses, token count)), a function (inputs, targets) -> token count (it returns the "
            f"mean over those tokens) or {PER_SHARD_MEAN!r} (the mean of the shards' mean losses, padding or not)"
        )
    refuse_sparse(called_modules(chain))  # a sparse gradient: refused here, not by the norm's raw error
    return Step(chain, loss_fn, optimizer, clip_norm, metrics=check_metrics(metrics), tokens=tokens)


@contextlib.contextmanager
def _predicting(step: Step, mesh: Mesh | None) -> Iterator[Any]:
    """The splits' predicting block, in which the computes see how the batch is shared out (a statistic
    of the whole batch is a psum over those axes: predicted, as the splits' collectives are)."""
    if mesh is not None and not step.split.axes and sums_over_batch(step.transforms):
        # No split, but the loss sums a statistic over the batch's axes (router_aux_loss under ZeRO alone).
        block: contextlib.AbstractContextManager[Any] = in_layer.predicting(
            {axis: mesh.axis_size(axis) for axis in mesh.axis_names}
        )
    else:
        block = step.split.predicting(mesh)
    with untouched(), block as issued, in_layer.sharing_batch(batch_shares(step, mesh)):
        yield issued


def _reads_one(factor: torch.Tensor) -> bool:
    """Whether clipping by ``factor`` would leave every gradient as it is: the factor is exactly 1 (the
    norm is within the bound), read where that costs no wait, a plain tensor in host memory (the
    metrics read the norm there anyway). A multiply by 1.0 returns every finite value bit for bit (a NaN
    or an infinity anywhere makes the factor NaN or 0, and the multiply runs), so skipping it changes
    nothing but a pass over every gradient, as DeepSpeed's ``clip_grad_norm_`` and FairScale's clipping
    skip it. On an accelerator the multiply runs anyway: reading the factor would wait for the device."""
    return type(factor) is torch.Tensor and factor.device.type == "cpu" and bool(factor == 1.0)
