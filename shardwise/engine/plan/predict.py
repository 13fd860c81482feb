"""What a pipeline's stage boundaries carry, and what the chain returns, predicted on fake tensors.

The chain runs on fake tensors (shapes and dtypes, no data, no arithmetic), so every rank knows what
it will receive before anything is sent: transfers go without counts or headers, and the Plan sizes
them.

A model may leave a value out on some inputs: a Hugging Face attention mask is None for a batch
without a padded row (sdpa attention, BERT's eager one). Fake tensors cannot read the data that
decides it, so the fake run follows functionalize's example there (``model/carry.py``): it predicts
the structure of a batch like the example. :func:`first_output` runs the chain's first layer on a
real micro-batch with fake parameters: what reads the batch alone (the mask code) runs for real and
decides as the run will, what reads a parameter runs on fake tensors. Where that output differs from
the fake run's only in which values are left out, the later layers are predicted from it
(``start=``), so the boundaries follow the batch, not the example (``step/layouts.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..layout.state_layout import Placement
from ..model.carry import is_absent_layout
from ..model.chain import Chain
from ..model.reuse import LayerMemo
from ..model.tensor_reads import tensors_in
from ..torch_api import fake_tensors, is_fake, real_ops
from .actions import Boundary

Shapes = Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]]
DtypeOf = Callable[[str, torch.dtype], torch.dtype]


class Output(NamedTuple):
    """A layer's output without its values: its pytree structure, and per tensor its shape, dtype and
    whether it requires grad (depends on a parameter). Hashable: a cache key."""

    spec: Any  # optree.PyTreeSpec
    leaves: tuple[tuple[torch.Size, torch.dtype, bool], ...]

    @staticmethod
    def of(value: Any) -> Output | None:
        """``value``'s description; None if a leaf is not a tensor."""
        leaves, spec = optree.tree_flatten(value)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            return None
        return Output(spec, tuple((t.shape, t.dtype, t.requires_grad) for t in leaves))

    def rebuild(self) -> Any:
        """Tensors of these layouts in this structure (fake ones, inside a :func:`fake_tensors` block)."""
        return optree.tree_unflatten(
            self.spec,
            [torch.empty(shape, dtype=dtype).requires_grad_(grad) for shape, dtype, grad in self.leaves],
        )

    def differs_only_in_left_out(self, other: Output) -> bool:
        """Whether this differs from ``other``, and only by values left out in one and present in the other."""
        if self.spec != other.spec or len(self.leaves) != len(other.leaves):
            return False
        changed = [(a, b) for a, b in zip(self.leaves, other.leaves, strict=True) if a != b]
        return bool(changed) and all(is_absent_layout(*a[:2]) != is_absent_layout(*b[:2]) for a, b in changed)


def predict_boundaries(
    chain: Chain,
    placement: Placement,
    shapes: Shapes,
    compute_dtype: DtypeOf,
    inputs: Any,
    start: Output | None = None,
) -> tuple[Boundary, ...] | None:
    """The (shape, dtype) of every tensor each stage boundary carries, their pytree structure and
    which of them a gradient comes back for (those that depend on a parameter), for micro-batch
    ``inputs``; ``start``: the first layer's output on it (:func:`first_output`), the later layers
    predicted from there.

    Predicted by running the chain on fake tensors (no data, no arithmetic), so every rank knows
    what it will receive and transfers go without counts or headers. Every rank predicts the same
    for the same micro-batch; if the chain cannot run on fake tensors, all fall back to announced
    transfers.
    """
    found = []

    def boundary(x: Any) -> None:
        leaves, spec = optree.tree_flatten(x)
        grads = tuple(t.is_floating_point() and t.requires_grad for t in leaves)
        found.append(Boundary(tuple((t.shape, t.dtype) for t in leaves), spec, grads))

    ran = _run_fake(chain, placement.stages[:-1], shapes, compute_dtype, inputs, boundary, start)
    return None if ran is None else tuple(found)


def predict_output(chain: Chain, shapes: Shapes, compute_dtype: DtypeOf, inputs: Any) -> list[torch.Size | None] | None:
    """The shape of each leaf of the chain's output on ``inputs`` (None for a leaf that is no tensor), in
    optree's order, run on fake tensors as :func:`predict_boundaries` runs it; None if the chain cannot
    run on them."""
    out = _run_fake(chain, [chain.names], shapes, compute_dtype, inputs, lambda _: None)
    if out is None:
        return None
    return [t.shape if isinstance(t, torch.Tensor) else None for t in optree.tree_leaves(out)]


class FirstOutput(NamedTuple):
    """The first layer's output on a micro-batch (None where it cannot run so), and whether the code
    read the batch's values to make it: if not, any micro-batch of these shapes gives the same."""

    output: Output | None
    reads_batch: bool


def first_output(chain: Chain, shapes: Shapes, compute_dtype: DtypeOf, inputs: Any, on_batch: bool) -> FirstOutput:
    """The chain's first layer's output on micro-batch ``inputs``, with fake parameters.

    ``on_batch``: the batch's tensors stay real (copies: the layer may change its input in place), so the
    code that reads them alone decides as the run will (which values to leave out); ops that read a
    parameter or a buffer still run on fake tensors. Otherwise every tensor is fake, as :func:`predict_boundaries`
    runs it. Each rank runs it on the micro-batches it holds; nothing is sent."""
    name = chain.names[0]
    layer = chain[name]
    needed = {name, *(owner for owner, _ in layer.ties.values())}
    if on_batch:  # copied before the block: a copy made in it would be fake
        inputs = optree.tree_map(lambda t: t.detach().clone() if _real(t) else t, inputs)
    reads = _BatchReads()
    try:
        with fake_tensors() as fake, torch.enable_grad():
            params = _fake_params({k: v for k, v in shapes.items() if k in needed}, compute_dtype)
            if not on_batch:
                tensors = {**chain.layer_params(params, name), **layer.buffers}
                return FirstOutput(Output.of(layer.fn(tensors, optree.tree_map(fake, inputs))), False)
            # Buffers fake too: what is made of them (a rotary table of every position) is no decision.
            tensors = {**chain.layer_params(params, name), **{k: fake(t) for k, t in layer.buffers.items()}}
            x = optree.tree_map(lambda t: t if _real(t) else fake(t), inputs)
            with real_ops(), reads:
                return FirstOutput(Output.of(layer.fn(tensors, x)), reads.read)
    except Exception:  # it reads data through a parameter, or cannot run on fake tensors: no prediction
        return FirstOutput(None, reads.read)


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and not is_fake(t)


# What reads a tensor's values into Python, or makes a shape of them.
_READS = frozenset({
    "__bool__", "item", "tolist", "numpy", "__int__", "__float__", "__index__", "__complex__", "equal", "allclose",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave",
})


class _BatchReads(TorchFunctionMode):
    """Notes whether code reads a real tensor's values into Python or into a shape (a boolean index). Run
    beside :func:`first_output` on a batch: where nothing is read, its output depends on shapes only. A
    read it misses (a C extension reading memory) costs no silent error: the executor checks every stage
    output against the prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.read:
            name = getattr(func, "__name__", "")
            real = [t for t in tensors_in((args, kwargs)) if _real(t)]
            by_mask = name == "__getitem__" and any(t.dtype == torch.bool for t in tensors_in(args[1:]) if _real(t))
            if real and (name in _READS or by_mask):
                self.read = True
        return func(*args, **kwargs)


def _fake_params(shapes: Shapes, compute_dtype: DtypeOf) -> dict[str, dict[str, torch.Tensor]]:
    """Fake parameters of ``shapes`` cast by ``compute_dtype`` (inside a :func:`fake_tensors` block). They
    require grad as in the run, so each output leaf's requires_grad says whether it depends on one (the
    batch does not require grad)."""
    return {
        layer: {
            k: torch.empty(shape, dtype=compute_dtype(layer, dtype)).requires_grad_(dtype.is_floating_point)
            for k, (shape, dtype) in t.items()
        }
        for layer, t in shapes.items()
    }


def _run_fake(
    chain: Chain,
    stages: Sequence[Sequence[str]],
    shapes: Shapes,
    compute_dtype: DtypeOf,
    inputs: Any,
    after_stage: Callable[[Any], None],
    start: Output | None = None,
) -> Any | None:
    """The layers of ``stages`` on fake copies of ``inputs`` and of parameters of ``shapes`` (cast by
    ``compute_dtype``), calling ``after_stage`` with each stage's fake output; the last one, or None if
    the chain cannot run on fake tensors. ``start``: the first layer's output, which it then skips."""
    try:
        with fake_tensors() as fake, torch.enable_grad():
            params = _fake_params(shapes, compute_dtype)
            x = optree.tree_map(fake, inputs) if start is None else start.rebuild()
            skip = None if start is None else chain.names[0]
            memo = LayerMemo()  # identical layers (a stack of blocks) run once
            for layers in stages:
                for name in layers:
                    if name == skip:
                        continue
                    layer = chain[name]
                    tensors = {**chain.layer_params(params, name), **layer.buffers}
                    key = memo.key(layer.fn, tensors, x, name)
                    reused = memo.lookup(key, x)
                    if reused is not None:
                        x = reused[0]
                        continue
                    y = layer.fn(tensors, x)
                    memo.store(key, x, y)
                    x = y
                after_stage(x)
            return x
    except Exception:  # data-dependent code cannot run on fake tensors: announce instead
        return None
