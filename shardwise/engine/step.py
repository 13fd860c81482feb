"""The single-device training step, the reference every transform is checked against.

``train_step(chain, loss_fn, optimizer)`` returns a :class:`Step`: an immutable
value with ``init(params, mesh) -> TrainState``, ``step(state, batch) ->
(state, metrics)`` and ``plan(mesh) -> Plan``. Transforms (shard_params,
pipeline, ...) take a Step and return a new one; this one computes exactly
what ``loss.backward(); optimizer.step()`` computes on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..collectives.mesh import Mesh
from .accounting import predict_kept_for_backward
from .chain import Chain
from .data_parallel import DataParallel
from .devices import host_scalar
from .executor import Executor, LossFn
from .metrics import REPORTABLE, MetricExchange, check_metrics
from .optim import Optimizer, global_norm
from .plan import BACKWARD, FORWARD, LOSS, UPDATE, Action, Plan
from .precision import Precision, all_finite
from .state import Params, TrainState, map_params

Metrics = dict[str, torch.Tensor]


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A batch is ``(inputs, targets)``: inputs feed the chain, targets the loss."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"a batch must be a pair (inputs, targets), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "; inputs feed the chain and targets go to loss_fn(output, targets)"
        )
    return batch[0], batch[1]


def split_over(tree: Any, parts: int, index: int, what: str) -> Any:
    """Slice ``index`` of ``parts`` equal slices along dim 0 of every tensor in ``tree``."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ValueError(f"{what}: every batch leaf must be a tensor with a batch dim, got {t!r:.60}")
        if t.shape[0] % parts:
            raise ValueError(
                f"{what}: batch size {t.shape[0]} (tensor of shape {tuple(t.shape)}) does not divide into "
                f"{parts} equal parts; use a batch size that is a multiple of {parts}"
            )
        size = t.shape[0] // parts
        return t[index * size : (index + 1) * size]

    return optree.tree_map(cut, tree)


def check_params(chain: Chain, params: Any) -> None:
    """Refuse a params pytree that does not match the chain, naming the layer and the names."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a dict layer name -> dict of tensors (as functionalize returns), got {type(params).__name__}"
        )
    unknown = set(params) - set(chain.names)
    if unknown:
        raise ValueError(f"params has layers {sorted(unknown)} that the chain does not have; chain layers: {list(chain.names)}")
    for layer in chain.layers:
        expected = set(chain.owned_param_names(layer.name))
        got = set(params.get(layer.name, {}))
        if expected != got:
            raise ValueError(
                f"params[{layer.name!r}] does not match the chain: missing {sorted(expected - got)}, "
                f"unexpected {sorted(got - expected)}"
            )
        for name, value in params.get(layer.name, {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"params[{layer.name!r}][{name!r}] is a {type(value).__name__}, not a tensor")


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clips a gradient of global ``norm`` to ``max_norm`` (torch's clip_grad_norm_)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def unscale_like(grads: Any, like: Any, scale: float) -> Any:
    """Gradients in the dtype of ``like`` (the master parameters), divided by the loss scale."""
    if scale == 1.0:
        return optree.tree_map(lambda g, p: g.to(p.dtype), grads, like)
    return optree.tree_map(lambda g, p: g.to(p.dtype) / scale, grads, like)


def tree_nbytes(tree: Any) -> int:
    """Bytes of every tensor leaf of ``tree`` (meta tensors count their would-be size)."""
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Step:
    """A training step as a value: the chain, the loss and the optimizer, and how to run them.

    ``loss_fn(output, targets)`` must return the *mean* loss over the batch (the
    default reduction of torch's losses), so that a step on a split batch can be
    made equal to the step on the whole batch.
    """

    chain: Chain
    loss_fn: LossFn
    optimizer: Optimizer
    clip_norm: float | None = None
    precision: Precision | None = None  # set by mixed_precision
    metrics: tuple[str, ...] = REPORTABLE  # what the step reports (see shardwise.engine.metrics)

    # -- composition hooks ------------------------------------------------------
    def base_fields(self) -> dict[str, Any]:
        """The fields every kind of step shares, to build a derived step from this one."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Step)}

    @property
    def data_parallel(self) -> DataParallel | None:
        """The data-parallel sharding this step applies, if any (shard_params sets it)."""
        return None

    def with_data_parallel(self, spec: DataParallel) -> Step:
        """This step, data parallel with ZeRO sharding over ``spec.axis``.

        Steps that drive their own computation (a pipeline) override this to
        hold their layers in a sharded store; the plain step is made data
        parallel by shard_params itself, so it never gets here.
        """
        raise ValueError(
            f"{type(self).__name__} cannot be made data parallel over {spec.axis!r}: shard_params does not "
            "compose with it"
        )

    # -- metrics, shared by every kind of step --------------------------------------
    def with_metrics(self, metrics: Iterable[str]) -> Step:
        """This step reporting ``metrics`` instead (any of ``"loss"``, ``"grad_norm"``; ``()`` for
        none). It takes and returns the same states and updates them in the same way."""
        return dataclasses.replace(self, metrics=check_metrics(metrics))

    @property
    def needs_norm(self) -> bool:
        """Whether the step computes the global gradient norm: reported, or needed to clip."""
        return "grad_norm" in self.metrics or self.clip_norm is not None

    @property
    def update_needs_sums(self) -> bool:
        """Whether the update depends on the summed values: clipping by the global norm, or
        skipping everywhere on a gradient that is not finite somewhere."""
        return self.clip_norm is not None or self.precision is not None

    def metric_exchange(self) -> MetricExchange:
        """What the ranks of this step sum after the backward (nothing, if no metric or rule needs it)."""
        return MetricExchange(loss="loss" in self.metrics, norm=self.needs_norm, finite=self.precision is not None)

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

    # -- precision helpers shared by every kind of step ---------------------------
    def master_params(self, params: Params) -> Params:
        """Detached copies of the parameters in the stored (master) dtype of each layer's policy."""
        # Always copies: the step owns its state (an in-place optimizer writes into it), so the
        # caller's tensors must never be the state's.
        if self.precision is None:
            return map_params(lambda t: t.detach().clone(), params)
        prec = self.precision
        return {
            layer: {k: t.detach().to(prec.for_layer(layer).params, copy=True) for k, t in tensors.items()}
            for layer, tensors in params.items()
        }

    def initial_loss_scale(self) -> Any:
        return None if self.precision is None else self.precision.loss_scale

    def loss_scale_value(self, state: TrainState) -> float:
        return 1.0 if state.loss_scale is None else state.loss_scale.scale_value()

    def finish(
        self, state: TrainState, grads: Any, params: Any, norm: torch.Tensor | None, finite: bool
    ) -> tuple[Any, Any, Any]:
        """Clip and update, or skip the update when a gradient anywhere was not finite.

        ``grads`` are unscaled and in the dtype of ``params`` (what the
        optimizer updates). ``norm`` is the global gradient norm, needed only with
        ``clip_norm``. Returns (params, optimizer state, loss scale).
        """
        scale = state.loss_scale
        if not finite:
            # Every rank saw the same global flag, so every rank skips together.
            return params, state.opt_state, None if scale is None else scale.adjust(False)
        if self.clip_norm is not None:
            if norm is None:
                raise ValueError("Step.finish: clip_norm is set, so the global gradient norm must be given")
            factor = clip_scale(norm, self.clip_norm)
            grads = optree.tree_map(lambda g: g * factor.to(g.dtype), grads)
        new_params, new_opt_state = self.optimizer.update(grads, state.opt_state, params)
        return new_params, new_opt_state, None if scale is None else scale.adjust(True)

    # -- state ----------------------------------------------------------------
    def init(self, params: Params, mesh: Mesh | None = None) -> TrainState:
        """Build the TrainState from full parameters (every rank passes the same ones)."""
        check_params(self.chain, params)
        params = self.master_params(params)
        return TrainState(params, self.optimizer.init(params), 0, self.initial_loss_scale())

    def full_params(self, state: TrainState) -> Params:
        """The complete parameters on this rank (a collective once params are sharded)."""
        return state.params

    # -- running --------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        inputs, targets = split_batch(batch)
        scale = self.loss_scale_value(state)
        compute = state.params if self.precision is None else self.precision.compute_params(state.params)
        executor = Executor(self.chain, self.loss_fn, compute, inputs, targets, loss_scale=scale)
        executor.run(self.plan().for_rank(0))
        grads = unscale_like(executor.ordered_grads(), state.params, scale)
        assert executor.loss is not None
        norm = global_norm(grads) if self.needs_norm else None
        # Without a precision policy a step behaves as torch does: no finiteness check, no skip.
        finite = self.precision is None or bool(all_finite(optree.tree_leaves(grads)))
        metrics = self.report(executor.loss, norm)
        params, opt_state, loss_scale = self.finish(state, grads, state.params, norm, finite)
        if self.precision is not None:
            metrics["loss_scale"] = host_scalar(scale)
            metrics["skipped"] = host_scalar(not finite)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, loss_scale=loss_scale), metrics

    # -- inspection -----------------------------------------------------------
    def plan(self, mesh: Mesh | None = None, params: Params | None = None, batch: Any = None) -> Plan:
        """Per-rank actions: forward per layer, the loss, backward per layer in reverse, the update.

        Every rank of ``mesh`` runs the whole step (nothing is distributed until
        a transform says so). With ``params`` (real or ``device="meta"``
        tensors), the plan also counts the bytes each rank holds; with a
        ``batch`` too, the activation bytes kept for backward (predicted on
        fake tensors: the figures ``sw.saved_bytes`` measures).
        """
        mesh = mesh or Mesh(world=1)
        names = self.chain.names
        actions = (
            (*tuple(Action(FORWARD, n) for n in names), Action(LOSS), *tuple(Action(BACKWARD, n) for n in reversed(names)), Action(UPDATE))
        )
        memory: dict[str, tuple[int, ...]] = {}
        if params is not None:
            check_params(self.chain, params)
            meta = map_params(lambda t: torch.empty_like(t, device="meta"), params)
            per_rank = {
                "params": tree_nbytes(meta),
                "grads": tree_nbytes(meta),
                "opt_state": tree_nbytes(self.optimizer.init(meta)),
            }
            if batch is not None:
                per_rank["kept_for_backward"] = self.kept_for_backward(params, split_batch(batch)[0])
            memory = {k: (v,) * mesh.size for k, v in per_rank.items()}
        return Plan(mesh, (actions,) * mesh.size, memory)

    def kept_for_backward(self, params: Params, inputs: Any) -> int:
        """Predicted bytes the layers keep for backward on ``inputs`` (one forward, on fake tensors)."""
        return sum(predict_kept_for_backward(self.chain, self.compute_view(params), inputs).values())

    def compute_view(self, params: Params) -> Params:
        """The parameters as the layers receive them: the compute copies under a precision policy
        (cast once per step and held anyway, so not counted as kept activations)."""
        if self.precision is None:
            return params
        return self.precision.compute_params(self.master_params(params))


def train_step(
    chain: Chain,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Optimizer,
    *,
    clip_norm: float | None = None,
    metrics: Iterable[str] = REPORTABLE,
) -> Step:
    """The single-device training step of ``chain`` under ``loss_fn`` and ``optimizer``.

    ``clip_norm`` clips the gradient to that global L2 norm before the update,
    as ``torch.nn.utils.clip_grad_norm_`` does. The metrics report the norm
    before clipping.

    ``metrics`` names what each call reports: ``"loss"`` (the mean over the whole
    batch) and ``"grad_norm"``, the same values on every rank once the step is
    distributed. Each costs something there (one small all-reduce per step, and a
    pass over every gradient for the norm), so a loop that logs now and then can
    run ``step.with_metrics(())`` in between: the same step on the same states,
    reporting neither (torch's pipeline schedules, for one, report nothing but
    the last stage's losses).

    >>> import torch, shardwise as sw
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
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
        raise TypeError(f"train_step(chain=...) needs a shardwise Chain (see functionalize), got {type(chain).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"train_step(loss_fn=...) must be callable loss_fn(output, targets), got {loss_fn!r}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"train_step(optimizer=...) needs a functional optimizer such as shardwise.optim.sgd(...), got {optimizer!r}"
        )
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"train_step(clip_norm={clip_norm!r}): the norm to clip to must be positive")
    return Step(chain, loss_fn, optimizer, clip_norm, metrics=check_metrics(metrics))
