"""Functional optimizers: ``init`` and ``update`` are pure functions over pytrees of tensors.

An :class:`Optimizer` has the shape of optax's ``GradientTransformation``, except that
``update`` returns the new parameters rather than an update to add::

    opt = adamw(lr=warmup_cosine(3e-4, 100, 10_000))
    state = opt.init(params)
    params, state = opt.update(grads, state, params)

The math is torch's, operation for operation (``torch/optim/sgd.py`` and the single-tensor
and foreach paths of ``torch/optim/adam.py`` with ``decoupled_weight_decay``), so on CPU the
results agree bitwise with ``torch.optim.SGD`` / ``torch.optim.AdamW``; see
``tests/engine/test_optim.py``.

Contracts the rest of the engine relies on:

- Pure: inputs (grads, state, params) are never written to; every returned tensor is new.
  The math runs under ``torch.no_grad()``, like ``optimizer.step()``.
- Elementwise: each output element depends only on the same element of the inputs and on
  scalars (lr, betas, the step count), never on a tensor's shape. So ``update`` run on 1-D
  shards of flattened parameters returns exactly the shards of the full update (ZeRO), and on
  a tensor-parallel slice the slice of it. The built-ins say so (``elementwise=True``); a
  transform that hands the update such pieces refuses an optimizer that does not
  (:func:`is_elementwise`).
- State is a NamedTuple of tensors (optree flattens it with no registration). ``step`` is a
  0-d ``torch.int64`` tensor on the CPU counting updates applied so far: an integer so it
  counts exactly forever (torch's float32 step stops at 2**24) and compares and
  serializes without rounding, and on the CPU so reading it (for the schedule and the bias
  corrections) never waits for an accelerator. ``torch.save`` / ``torch.load`` round-trip
  it; load a whole state object under ``torch.serialization.safe_globals(STATE_TYPES)``,
  or save its flattened leaves, which need no allow-listing.
- Parameter trees may mix devices and dtypes: the vectorized kernels run grouped by
  (device, dtype), as in torch (see :mod:`shardwise.engine.optim.foreach`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple, TypeAlias

import optree
import torch
from torch import Tensor

from . import flat
from . import foreach as fe
from .groups import Group, Options, ParamGroups, Pieces, Runs, tree_runs, whole_pieces
from .schedules import Constant, Schedule, as_step

__all__ = [
    "STATE_TYPES",
    "AdamWState",
    "OptState",
    "Optimizer",
    "Params",
    "SgdState",
    "adamw",
    "global_norm",
    "is_elementwise",
    "sgd",
    "sum_of_squares",
]

Params: TypeAlias = Any
"""Any optree pytree whose leaves are tensors, e.g. ``dict[str, dict[str, Tensor]]``."""
OptState: TypeAlias = Any
"""An optimizer's state: a pytree of tensors (for the built-in ones, a NamedTuple)."""


class Optimizer(NamedTuple):
    """A functional optimizer: a pair of pure functions, and its parameter groups.

    ``init(params) -> state``; ``update(grads, state, params) -> (new_params, new_state)``,
    where ``grads`` has the same tree structure as ``params``. With ``groups`` (see
    :func:`sw.optim.group`), ``update`` also takes ``runs=``: a tree like
    ``params`` of ``Runs``, each leaf's options range by
    range, which a Step gives for ZeRO's flat shards; without it the options are resolved
    from the tree's own paths and shapes.

    ``elementwise=True`` declares that ``update`` treats each element alone: every element of
    its results depends only on the same element of ``grads``, ``params`` and the state, and on
    scalars (the learning rate, the step count), never on a tensor's shape, a norm or another
    element. Then its update of pieces of the parameters is the pieces of its update, which
    is what ``shard_params`` (flat 1-D shards) and ``tensor_parallel`` (slices) hand it; they
    refuse an optimizer that does not declare it. ``sgd`` and ``adamw`` are elementwise.

    >>> import torch, shardwise as sw
    >>> def update(grads, state, params):
    ...     return {k: p - 0.1 * grads[k] for k, p in params.items()}, state
    >>> plain_sgd = sw.optim.Optimizer(lambda params: (), update, elementwise=True)
    >>> plain_sgd.update({"w": torch.ones(2)}, (), {"w": torch.ones(2)})[0]["w"]
    tensor([0.9000, 0.9000])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]
    groups: ParamGroups | None = None
    elementwise: bool = False


class SgdState(NamedTuple):
    """State of :func:`sgd`: updates applied so far, and the momentum buffers (a tree like
    the params; None when ``momentum == 0``, so plain SGD carries no per-parameter state)."""

    step: Tensor
    momentum: Params | None


class AdamWState(NamedTuple):
    """State of :func:`adamw`: updates applied so far and the first and second moment
    estimates (trees like the params), as torch's ``exp_avg`` and ``exp_avg_sq``."""

    step: Tensor
    exp_avg: Params
    exp_avg_sq: Params


# What `torch.load(weights_only=True)` must be allowed to rebuild to load a whole state.
STATE_TYPES: tuple[type, ...] = (SgdState, AdamWState)


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    inplace: bool = False,
    groups: Sequence[Group] | None = None,
) -> Optimizer:
    """Stochastic gradient descent, as ``torch.optim.SGD`` with the same arguments.

    Per update with gradient ``g``: ``d = g + weight_decay * p``; with momentum, the buffer
    ``b`` becomes ``d`` on the first update (no dampening) and ``momentum * b + (1 -
    dampening) * d`` after; ``d`` becomes ``d + momentum * b`` (nesterov) or ``b``; finally
    ``p - lr * d``. ``lr`` is a float or a schedule called with the update count.

    ``inplace=True`` writes the new parameters and state into the ones given, as torch
    does, and returns them (bitwise the same values): the update then allocates nothing
    parameter-sized, but it consumes its inputs, so a TrainState passed to a step must
    not be used after the call (the step's own inputs are donated, as with JAX's
    ``donate_argnums``; a step refuses a state whose tensors a later update already wrote).
    ``step.init`` copies the parameters it is given, so those stay intact.

    ``groups``: per-parameter options, ``[sw.optim.group("*.bias", weight_decay=0.0), ...]``
    (first match wins; see :func:`sw.optim.group`), as torch's param
    groups with ``lr = lr * lr_scale``; a frozen group's parameters and buffers stay as they are.
    """
    schedule = _as_schedule(lr)
    _check_nonnegative("momentum", momentum, "0 turns momentum off")
    _check_nonnegative("weight_decay", weight_decay, "0 turns weight decay off")
    if not math.isfinite(dampening):
        raise ValueError(f"dampening: must be finite, got {dampening}; torch's default is 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov: Nesterov momentum needs momentum > 0 and dampening == 0 (torch's rule), "
            f"got momentum={momentum}, dampening={dampening}; set those or pass nesterov=False"
        )

    param_groups = ParamGroups.of(groups, weight_decay)
    update = _SgdUpdate(
        schedule, momentum, dampening, weight_decay, nesterov, inplace, param_groups
    )
    return Optimizer(_SgdInit(momentum), update, param_groups, elementwise=True)


def adamw(
    lr: float | Schedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    inplace: bool = False,
    groups: Sequence[Group] | None = None,
) -> Optimizer:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW`` (defaults included).

    Per update ``t`` (counting from 1) with gradient ``g``: ``p *= 1 - lr * weight_decay``;
    ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``.
    ``lr`` is a float or a schedule called with ``t - 1`` (0 for the first update).
    ``inplace=True`` updates the given parameters and state (see :func:`sgd`); ``groups`` as
    for :func:`sgd` (a group's ``weight_decay`` and ``lr`` enter the decay factor too, as torch's).
    """
    schedule = _as_schedule(lr)
    if len(betas) != 2:
        raise ValueError(
            f"betas: expected a pair (beta1, beta2), got {betas!r}; torch's default is (0.9, 0.999)"
        )
    beta1, beta2 = float(betas[0]), float(betas[1])
    for i, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(
                f"betas[{i}]: must be in [0, 1), got {beta}; it is a moving-average decay, "
                "e.g. (0.9, 0.999)"
            )
    _check_nonnegative("eps", eps, "torch's default is 1e-8")
    _check_nonnegative("weight_decay", weight_decay, "0 turns weight decay off")

    param_groups = ParamGroups.of(groups, weight_decay)
    update = _AdamWUpdate(schedule, beta1, beta2, eps, weight_decay, inplace, param_groups)
    return Optimizer(_AdamWInit(), update, param_groups, elementwise=True)


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like``, with the same shape, dtype and device on the meta device too, where the
    Plan sizes the state: there torch's ``zeros_like`` is a Python reference that imports sympy
    (0.35 s of CPU, once per process); ``torch.zeros`` has a C++ meta kernel."""
    if t.device.type == "meta" and type(t) is torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return torch.zeros_like(t)


# The optimizers' functions are module-level frozen dataclasses, not closures, so that an
# Optimizer pickles (the processes backend sends the step to every rank) and compares by value.


@dataclass(frozen=True)
class _SgdInit:
    momentum: float

    def __call__(self, params: Params) -> SgdState:
        buffers = optree.tree_map(_zeros_like, params) if self.momentum != 0 else None
        return SgdState(step=_zero_step(), momentum=buffers)


@dataclass(frozen=True)
class _SgdUpdate:
    schedule: Schedule
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    inplace: bool
    groups: ParamGroups | None = None

    @torch.no_grad()
    def __call__(
        self, grads: Params, state: SgdState, params: Params, *, runs: Params | None = None
    ) -> tuple[Params, SgdState]:
        _check_state(state, SgdState, "sgd")
        p, spec = flat.flatten(params)
        g = flat.leaves_like(grads, spec, "grads")
        t = as_step(state.step)
        step_lr = _lr_at(self.schedule, t)
        b: list[Tensor] = []
        if self.momentum != 0:
            if state.momentum is None:
                raise ValueError(
                    "state.momentum: is None but momentum != 0; build the state with this optimizer's init"
                )
            b = flat.leaves_like(state.momentum, spec, "state.momentum")
        pieces = _pieces(self.groups, self.weight_decay, params, spec, runs, p)
        out_p: dict[int, Tensor] = {}
        out_b: dict[int, Tensor] = {}
        for opts, class_idx in pieces.classes():
            class_ps = pieces.take(p, class_idx)
            # One device and dtype at a time (the usual one list), read once: each op skips it.
            for kind in fe.kind_groups(class_ps):
                idx = [class_idx[k] for k in kind]
                ps, d_p = [class_ps[k] for k in kind], pieces.take(g, idx)
                if opts.weight_decay != 0:
                    d_p = fe.add(d_p, ps, alpha=opts.weight_decay, uniform=True)
                if self.momentum != 0:
                    bs = self._momentum(pieces.take(b, idx), d_p, t)
                    d_p = fe.add(d_p, bs, alpha=self.momentum, uniform=True) if self.nesterov else bs
                    out_b.update(zip(idx, bs, strict=True))
                lr = step_lr * opts.lr_scale
                out_p.update(zip(idx, fe.add(ps, d_p, alpha=-lr, inplace=self.inplace, uniform=True), strict=True))
        buffers = None
        if self.momentum != 0:
            buffers = flat.unflatten(spec, pieces.assemble(b, out_b, self.inplace))
        new_p = pieces.assemble(p, out_p, self.inplace)
        return flat.unflatten(spec, new_p), SgdState(_next_step(state.step), buffers)

    def _momentum(self, b: list[Tensor], d_p: list[Tensor], t: int) -> list[Tensor]:
        if t == 0:
            # torch starts the buffer at the first d_p itself, without dampening; the
            # zeros from init only fix the state's structure.
            if self.inplace:
                for buffer, x in zip(b, d_p, strict=True):
                    buffer.copy_(x)
                return b
            return [x.clone() for x in d_p]
        # b: the momentum of one (device, dtype) group of parameters, made like them
        decayed = fe.mul_scalar(b, self.momentum, inplace=self.inplace, uniform=True)
        return fe.add(decayed, d_p, alpha=1 - self.dampening, inplace=self.inplace, uniform=True)


@dataclass(frozen=True)
class _AdamWInit:
    def __call__(self, params: Params) -> AdamWState:
        return AdamWState(
            step=_zero_step(),
            exp_avg=optree.tree_map(_zeros_like, params),
            exp_avg_sq=optree.tree_map(_zeros_like, params),
        )


@dataclass(frozen=True)
class _AdamWUpdate:
    schedule: Schedule
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    inplace: bool
    groups: ParamGroups | None = None

    @torch.no_grad()
    def __call__(
        self, grads: Params, state: AdamWState, params: Params, *, runs: Params | None = None
    ) -> tuple[Params, AdamWState]:
        _check_state(state, AdamWState, "adamw")
        p, spec = flat.flatten(params)
        g = flat.leaves_like(grads, spec, "grads")
        m = flat.leaves_like(state.exp_avg, spec, "state.exp_avg")
        v = flat.leaves_like(state.exp_avg_sq, spec, "state.exp_avg_sq")
        t = as_step(state.step) + 1  # torch counts the update first: bias corrections use t >= 1
        step_lr = _lr_at(self.schedule, t - 1)
        pieces = _pieces(self.groups, self.weight_decay, params, spec, runs, p)
        out: tuple[dict[int, Tensor], ...] = ({}, {}, {})
        for opts, idx in pieces.classes():
            results = self._math([pieces.take(x, idx) for x in (p, g, m, v)], opts, step_lr, t)
            for o, r in zip(out, results, strict=True):
                o.update(zip(idx, r, strict=True))
        new_p, new_m, new_v = (
            pieces.assemble(x, o, self.inplace) for x, o in zip((p, m, v), out, strict=True)
        )
        new_state = AdamWState(
            step=_next_step(state.step),
            exp_avg=flat.unflatten(spec, new_m),
            exp_avg_sq=flat.unflatten(spec, new_v),
        )
        return flat.unflatten(spec, new_p), new_state

    def _math(
        self, tensors: list[list[Tensor]], opts: Options, step_lr: float, t: int
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """One option set's (params, exp_avg, exp_avg_sq), torch's AdamW operation for operation."""
        p, g, m, v = tensors
        # A complex parameter is updated as its real view, as torch's Adam does (the second moment per real and
        # imaginary part, not the complex square g * g): the same ops on views of the same memory.
        complex_leaves = [k for k, t in enumerate(p) if t.is_complex()]
        if complex_leaves:
            p, g, m, v = ([torch.view_as_real(t) if t.is_complex() else t for t in xs] for xs in (p, g, m, v))
        lr = step_lr * opts.lr_scale
        # Bias corrections are Python floats (double precision) for every dtype, as in
        # torch's non-capturable paths.
        bias_correction1 = 1 - self.beta1**t
        bias_correction2 = 1 - self.beta2**t
        step_size = lr / bias_correction1
        # One bounded group of tensors at a time (fe.bounded_groups): on CPU each group's
        # tensors stay in cache through all the ops, as in torch's single-tensor path, and the
        # one temporary (sqrt's) is reused. Every op is elementwise, so the grouping changes
        # no value; the order of operations is torch's, so the rounding is too.
        new_p: list[Tensor] = []
        new_m: list[Tensor] = []
        new_v: list[Tensor] = []
        order: list[int] = []  # the leaves' indices, in the order of the results
        # Each group is of one device and dtype (its state made like it): its ops skip reading that.
        for group in fe.bounded_groups(p):
            ps, gs, ms, vs = ([leaves[i] for i in group] for leaves in (p, g, m, v))
            inplace = self.inplace
            if opts.weight_decay != 0:
                ps = fe.mul_scalar(ps, 1 - lr * opts.weight_decay, inplace=inplace, uniform=True)
            ms = fe.lerp_scalar(ms, gs, 1 - self.beta1, inplace=inplace, uniform=True)
            vs = fe.addcmul_scalar(
                fe.mul_scalar(vs, self.beta2, inplace=inplace, uniform=True), gs, gs, 1 - self.beta2,
                inplace=inplace, uniform=True,
            )
            # sqrt makes the one new list; the rest reuses it, as torch's foreach path does.
            denom = fe.add_scalar(
                fe.div_scalar(fe.sqrt(vs, uniform=True), bias_correction2**0.5, inplace=True, uniform=True),
                self.eps, inplace=True, uniform=True,
            )
            new_p += fe.addcdiv_scalar(ps, ms, denom, -step_size, inplace=inplace, uniform=True)
            new_m += ms
            new_v += vs
            order += group
        if order != list(range(len(p))):  # groups of mixed kinds: back to the leaves' order
            at = {i: k for k, i in enumerate(order)}
            new_p, new_m, new_v = ([xs[at[i]] for i in range(len(p))] for xs in (new_p, new_m, new_v))
        for k in complex_leaves:
            new_p[k], new_m[k], new_v[k] = (torch.view_as_complex(xs[k]) for xs in (new_p, new_m, new_v))
        return new_p, new_m, new_v


def updates_in_place(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update writes the state it is given (``inplace=True``; a user's
    optimizer: as its update's ``inplace`` says, else not): a step then consumes its TrainState."""
    return bool(getattr(getattr(optimizer, "update", None), "inplace", False))


def is_elementwise(optimizer: Any) -> bool:
    """Whether ``optimizer`` says its update treats each element alone (see :class:`Optimizer`): its
    ``elementwise`` is True, or its update is a built-in one (``Optimizer(opt.init, opt.update)``
    of a built-in ``opt`` is as elementwise as ``opt``). A user's optimizer that says nothing is
    not: its update may read a whole tensor (a norm, a shape), which a piece of it would change."""
    declared = getattr(optimizer, "elementwise", False)
    if not isinstance(declared, bool):
        raise TypeError(
            f"optimizer.elementwise: a bool saying whether the update treats each element alone, got "
            f"{type(declared).__name__} {declared!r}; set elementwise = True (a class attribute) or leave it out"
        )
    return declared or updates_by_key(optimizer)


def updates_by_key(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a built-in one, whose update of some top-level keys of a mapping of
    parameters is those keys' part of the whole update (it is elementwise, and its state holds
    scalars and trees keyed like the parameters): ZeRO-1/2 then update bucket by bucket."""
    return isinstance(getattr(optimizer, "update", None), (_SgdUpdate, _AdamWUpdate))


def state_part(state: OptState, keys: Sequence[str]) -> OptState:
    """A built-in optimizer's state for the parameters under ``keys`` alone (see :func:`updates_by_key`):
    each per-parameter tree cut to those keys, the step count shared."""
    if not isinstance(state, (SgdState, AdamWState)):
        raise TypeError(f"state: a built-in optimizer's state was expected, got {type(state).__name__}")
    return type(state)(*(_cut(field, keys) for field in state))


def join_parts(parts: Sequence[OptState], keys: Sequence[str]) -> OptState:
    """The whole state from the :func:`state_part` states of updates that covered ``keys`` between them
    (in that order); every part counts the same step."""
    first = parts[0]
    fields = []
    for i, field in enumerate(first):
        if isinstance(field, Mapping):
            merged = {k: v for part in parts for k, v in part[i].items()}
            fields.append({k: merged[k] for k in keys})
        else:
            fields.append(field)
    return type(first)(*fields)


def _cut(field: Any, keys: Sequence[str]) -> Any:
    return {k: field[k] for k in keys} if isinstance(field, Mapping) else field


@torch.no_grad()
def global_norm(tree: Params) -> Tensor:
    """The L2 norm of all of ``tree``'s elements together, computed as
    ``torch.nn.utils.get_total_norm`` / ``clip_grad_norm_`` do: one norm per tensor (in
    that tensor's dtype), then the norm of those norms, on the first leaf's device.
    An empty tree has norm ``tensor(0.)``.

    On sharded gradients this is the norm of the local shards only: combine ranks by
    summing squared norms (``psum(global_norm(shards) ** 2) ** 0.5``).

    The per-tensor norms are summed in the tree's insertion order, the order of
    ``module.parameters()`` for functionalized params, as torch sums them: optree's
    sorted dict keys would put ``bias`` before ``weight``, and a different order of
    the sum can differ in the last bit.
    """
    leaves = tensor_leaves(tree)
    if not leaves:
        return torch.tensor(0.0)
    first_device = leaves[0].device
    norms = fe.norm(leaves, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), 2.0)


_DICT = {dict}


def tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors of ``tree``, mappings in insertion order (:func:`_leaves_in_insertion_order`);
    a step's gradients (a dict of dicts of tensors) read in one comprehension instead of a
    generator per container, or a flattening."""
    if isinstance(tree, dict) and set(map(type, tree.values())) <= _DICT:  # (map: no generator per call)
        flat = [t for v in tree.values() for t in v.values()]
        if all(map(isinstance, flat, repeat(Tensor))):
            return flat
    return list(_leaves_in_insertion_order(tree))


def _leaves_in_insertion_order(tree: Any) -> Iterator[Tensor]:
    """The tensors of nested mappings, lists and tuples, mappings in insertion order."""
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from _leaves_in_insertion_order(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves_in_insertion_order(value)
    else:
        yield from (t for t in optree.tree_leaves(tree) if isinstance(t, Tensor))


@torch.no_grad()
def sum_of_squares(tensors: Sequence[Tensor], dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """The sum of the squares of every element of ``tensors``, in ``dtype`` (0 for none, on ``device``).

    One norm per tensor (the foreach kernel: no squared copy of any tensor), squared and
    summed. Ranks holding parts of the gradients add their sums (one all-reduce); the
    global norm is the square root of the total.
    """
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([n.to(dtype) for n in fe.norm(tensors, 2.0)]).square().sum()


def _as_schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        return lr
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TypeError(
            f"lr: expected a float or a schedule (a callable step -> lr), got {type(lr).__name__} {lr!r}"
        ) from None
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"lr: must be finite and >= 0, got {value}; e.g. lr=1e-3")
    return Constant(value)


def _lr_at(schedule: Schedule, step: int) -> float:
    value = float(schedule(step))
    # `not value >= 0` also catches NaN.
    if not value >= 0 or math.isinf(value):
        raise ValueError(
            f"lr: the schedule {schedule!r} returned {value} at step {step}; "
            "a learning rate must be finite and >= 0"
        )
    return value


def _check_nonnegative(name: str, value: float, hint: str) -> None:
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}: must be finite and >= 0, got {value}; {hint}")


def _check_state(state: object, expected: type, optimizer: str) -> None:
    if not isinstance(state, expected):
        raise TypeError(
            f"state: {optimizer}.update expects the {expected.__name__} its init returned, "
            f"got {type(state).__name__}"
        )


def _pieces(
    groups: ParamGroups | None, weight_decay: float, params: Params, structure: flat.Structure,
    runs: Params | None, leaves: list[Tensor],
) -> Pieces:
    """The params' leaves cut by their options: ``runs`` as given (a Step's, for flat shards),
    else resolved from the tree (whole leaves)."""
    default = Options(weight_decay)
    if runs is None and groups is None:  # whole leaves, one option set: the same cuts every step
        return whole_pieces(tuple(map(Tensor.numel, leaves)), default)
    if runs is None:
        return Pieces(tree_runs(groups, default, params), leaves)
    given, runs_spec = optree.tree_flatten(runs)
    if runs_spec != structure.spec or not all(isinstance(r, Runs) for r in given):
        raise ValueError(
            f"runs: expected a tree like the params ({structure.spec}) of Runs, got {runs_spec}; "
            "give one Runs per parameter leaf"
        )
    return Pieces(given, leaves)


def _zero_step() -> Tensor:
    # On the host, as torch.optim keeps its `step` (unless capturable): the learning-rate
    # schedule and bias corrections read it as a Python number without a device sync.
    return torch.zeros((), dtype=torch.int64, device="cpu")


def _next_step(step: Tensor) -> Tensor:
    # A new tensor (never an in-place `+=`): the caller's state stays as it was.
    return step + 1
