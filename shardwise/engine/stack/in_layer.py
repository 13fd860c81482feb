"""The collectives a split's layers issue inside a compute: one recording context for every split.

A SPLIT spec's layers communicate while they compute (tensor parallel's sums and gathers, expert
parallel's all-to-alls, ring attention's ppermutes). The Plan lists each of them right after its
compute, so the engine must know them before the step runs. Every split issues them through this
module, which has one context variable:

* While :func:`predicting` (the layers run on fake tensors: ``step.plan``, the pipeline's stage
  boundaries), nothing moves: :func:`collective` (or :func:`record`) appends an :class:`Issued` (op,
  axis, input shape and dtype, phase, label) to the block's list and returns a tensor of the shape
  the run would give; :func:`size` and :func:`index` answer for the axes being predicted (index 0:
  every index issues the same).
* Otherwise the collective runs (a traced step times it where it runs: ``collectives/timing.py``),
  and these functions cost one read of the context variable.

Predicting holds every split's axis at once (a stack of splits, one per axis, predicts in one
block), so an :class:`Issued` names its axis.

>>> import torch
>>> with predicting({"tp": 4}) as issued:
...     y = collective("all_gather", "tp", torch.ones(2, 3), "mlp", run=lambda: None,
...                    predicted=lambda: torch.ones(8, 3))
...     where = size("tp"), index("tp")
>>> y.shape, where, [(i.op, i.axis, i.shape, i.label) for i in issued]
(torch.Size([8, 3]), (4, 0), [('all_gather', 'tp', (2, 3), 'mlp')])
>>> predicting_now()
False
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from ...collectives import axis_index, axis_size, current_mesh, psum
from ...collectives.function import QuickApplyFunction
from ...collectives.mesh import Mesh
from ...collectives.mesh_context import collectives_forbidden

T = TypeVar("T")

#: The collectives a layer may issue inside its compute, as the ledger names them.
OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")


@dataclass(frozen=True)
class Issued:
    """One collective a layer issues inside its compute: the ledger's op name, the mesh axis, its
    input's shape and dtype (as it travels), the phase and who issued it (the module's path)."""

    op: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    phase: str  # "forward" or "backward"
    label: str


@dataclass(frozen=True)
class _Prediction:
    """What the context variable holds while predicting: each axis's size, and the list they record into."""

    sizes: Mapping[str, int]
    issued: list[Issued] = field(default_factory=list)


_predicting: contextvars.ContextVar[_Prediction | None] = contextvars.ContextVar(
    "shardwise_in_layer_predicting", default=None
)


@contextlib.contextmanager
def predicting(sizes: Mapping[str, int]) -> Iterator[list[Issued]]:
    """A block in which the layers run on fake tensors: no collective moves anything; each appends
    what it would issue, over axes of ``sizes`` ({axis: ranks}), to the yielded list. Inside another
    such block it predicts the outer block's axes too, into a list of its own."""
    if not sizes or not all(isinstance(a, str) and isinstance(n, int) and n >= 1 for a, n in sizes.items()):
        raise ValueError(f"predicting(sizes={dict(sizes)!r}): give each predicted mesh axis its size, e.g. {{'tp': 2}}")
    outer = _predicting.get()
    prediction = _Prediction(MappingProxyType({**(outer.sizes if outer is not None else {}), **sizes}))
    token = _predicting.set(prediction)
    try:
        yield prediction.issued
    finally:
        _predicting.reset(token)


class ForwardContext:
    """The context a forward ran in, for what autograd runs of it later: its backward, a remat
    region's recomputation.

    Those read the current mesh, backend and prediction from context variables (a collective by axis
    name, one recorded while predicting). On CUDA torch runs a device's backward nodes on its own
    thread, whose context holds none of them. :meth:`run` runs a call as it is on the forward's own
    thread (where the context is the caller's: the backward's phase, the ledgers it records in), and
    inside a copy of the forward's context elsewhere (an autograd device thread)."""

    __slots__ = ("_context", "_thread")

    def __init__(self) -> None:
        self._context = contextvars.copy_context()  # cheap: the variables' mapping is shared, not copied
        self._thread = threading.get_ident()

    def run(self, call: Callable[[], T]) -> T:
        if threading.get_ident() == self._thread:
            return call()
        return self._context.run(call)


def remember_context(ctx: Any) -> None:
    """Keep on an autograd Function's ``ctx`` the context its forward ran in (:class:`ForwardContext`)."""
    ctx.forward_context = ForwardContext()


def in_forward_context(ctx: Any, backward: Callable[[], T]) -> T:
    """``backward()`` in the context :func:`remember_context` kept on ``ctx``."""
    return ctx.forward_context.run(backward)


def predicting_now() -> bool:
    """Whether the layers run inside :func:`predicting` (on fake tensors: values are not known)."""
    return _predicting.get() is not None


def predicting_sizes() -> Mapping[str, int] | None:
    """The sizes of the axes being predicted ({axis: ranks}), or None outside :func:`predicting`."""
    prediction = _predicting.get()
    return None if prediction is None else prediction.sizes


def one_device(mesh: Mesh | None = None) -> bool:
    """Whether nothing binds a mesh axis where the caller computes: no mesh given or current, not predicting,
    and not inside ``no_mesh`` (there a collective must raise, not run as if alone). A function a user's
    module calls over a split's axis (an attention over the sequence's parts, an MoE dispatch) computes
    there as on an axis of size 1, the single-device result: functionalize's example run, the step on one
    device and ``assert_equivalent``'s reference run the model with no mesh at all. Only the absence of
    any mesh counts: inside one that lacks the axis, a misspelled name is still refused."""
    return mesh is None and current_mesh() is None and _predicting.get() is None and not collectives_forbidden()


def size(axis: str, mesh: Mesh | None = None) -> int:
    """The size of mesh axis ``axis``, also while predicting (where the mesh is not running)."""
    prediction = _predicting.get()
    if prediction is None:
        return axis_size(axis, mesh=mesh)
    sizes = prediction.sizes
    if axis not in sizes:
        raise ValueError(
            f"a layer asks the size of axis {axis!r} while predicting axes {sorted(sizes)}: the split that issues "
            "collectives over it is not in the step's stack (every split's layers predict inside its step's block)"
        )
    return sizes[axis]


def index(axis: str, mesh: Mesh | None = None) -> int:
    """The calling rank's index on ``axis``; 0 while predicting (every index issues the same)."""
    if _predicting.get() is not None:
        size(axis)  # the axis must be one being predicted
        return 0
    return axis_index(axis, mesh=mesh)


def record(op: str, axis: str, shape: tuple[int, ...], dtype: torch.dtype, label: str, phase: str = "forward") -> None:
    """While predicting: note that the layer issues ``op`` over ``axis`` on an input of ``shape`` and
    ``dtype`` (a collective whose fake output the caller makes itself, such as an attention's ring)."""
    prediction = _predicting.get()
    if prediction is None:
        raise RuntimeError(f"in_layer.record({op!r}, {axis!r}, ...) outside predicting(): nothing would note it")
    if op not in OPS:
        raise ValueError(f"in_layer.record: op {op!r} is not a collective a layer issues; use one of {OPS}")
    size(axis)
    prediction.issued.append(Issued(op, axis, tuple(shape), dtype, phase, label))


def collective(
    op: str, axis: str, x: torch.Tensor, label: str, *, run: Callable[[], T], predicted: Callable[[], T],
    phase: str = "forward", dtype: torch.dtype | None = None,
) -> T:
    """One collective a layer issues on ``x``: ``run()``, or while predicting, recorded (``x``'s shape,
    in ``dtype`` if it travels in another) and ``predicted()``: the output the run would give, in shape."""
    if predicting_now():
        record(op, axis, tuple(x.shape), x.dtype if dtype is None else dtype, label, phase)
        return predicted()
    return run()


def grad_summed(x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None = None) -> torch.Tensor:
    """Identity forward (a view); backward, the gradient summed over ``axis`` (in ``reduce``, else its
    own dtype): a parameter every index of the axis holds whole, used on the index's own share of the
    batch or sequence, whose gradient is the sum over the shares (JAX's ``pvary``; Megatron's f)."""
    return _GradSum.apply(x, axis, label, reduce)


class _GradSum(QuickApplyFunction):
    @staticmethod
    def forward(x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis, ctx.label, ctx.reduce = inputs[1], inputs[2], inputs[3]
        remember_context(ctx)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return in_forward_context(ctx, lambda: (_GradSum._summed(ctx, g), None, None, None))

    @staticmethod
    def _summed(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        sent = g.to(ctx.reduce if ctx.reduce is not None else g.dtype).contiguous()
        if predicting_now():
            record("psum", ctx.axis, tuple(sent.shape), sent.dtype, ctx.label, "backward")
            return g.clone()
        return psum(sent, ctx.axis).to(g.dtype)


# -- the loss probe: loss_fn evaluated again, on a few rows, before the step's own call --------------

_probing_loss: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_in_layer_probing_loss", default=False)


@contextlib.contextmanager
def probing_loss() -> Iterator[None]:
    """A block in which the engine evaluates ``loss_fn`` again on a few rows of the output the run already
    computed (``engine/run/loss_rows.py``), with no collective allowed (``no_mesh``). A split's loss
    wrapper leaves what it knows of the forward as it found it (the step's own call comes next), and
    its loss functions compute without the other ranks' values, on this rank's part standing in for
    them, or raise (the probe then says nothing)."""
    token = _probing_loss.set(True)
    try:
        yield
    finally:
        _probing_loss.reset(token)


def probing_loss_now() -> bool:
    """Whether the calling code runs inside :func:`probing_loss`."""
    return _probing_loss.get()


# -- the batch's shares: a statistic over the whole batch, inside a compute -----------------------


@dataclass(frozen=True)
class BatchShares:
    """How the global batch is shared out where a compute runs: ``axes``, the mesh axes whose indices
    hold different shares of it (shard_params', a split's batch and sequence axes), and ``shares``, how
    many shares each micro-batch is cut into over them (the product of their sizes; the loss is seeded
    by 1 / (shares x micro-batches)). One device: ``BatchShares((), 1)``."""

    axes: tuple[str, ...] = ()
    shares: int = 1


_ONE_DEVICE = BatchShares()
_batch_shares: contextvars.ContextVar[BatchShares | None] = contextvars.ContextVar(
    "shardwise_in_layer_batch_shares", default=None
)


@contextlib.contextmanager
def sharing_batch(shares: BatchShares) -> Iterator[None]:
    """A block (a step's run, or its prediction) whose computes see ``shares`` (:func:`batch_shares`)."""
    token = _batch_shares.set(shares)
    try:
        yield
    finally:
        _batch_shares.reset(token)


def batch_shares() -> BatchShares:
    """How the batch is shared out where the calling compute runs (the engine says, at run and while predicting)."""
    shares = _batch_shares.get()
    return _ONE_DEVICE if shares is None else shares


def batch_sum(x: torch.Tensor, label: str) -> torch.Tensor:
    """``x`` summed over every share of the batch (a psum over each of :func:`batch_shares`' axes, in
    order; ``x`` itself on one device): a statistic of the whole batch that a layer or the loss needs
    (a router's assignment counts), computed from each share's own. The sum carries no gradient."""
    x = x.detach()
    for axis in batch_shares().axes:
        x = collective("psum", axis, x, label, run=functools.partial(psum, x, axis), predicted=x.clone)
    return x
