"""The tensor-parallel forward of each styled module, installed on a copy of the layer's module.

The layer code does not change: each styled module of a layer's module gets a
``forward`` attribute (a :class:`TPForward`, which pickles and deep-copies with
its module) that calls the class's own forward around the communication of
``comm.py``; the layer fn is a copy of the original one calling that module.
The original model, and the single-device step's layers, are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...engine._module_call import ThreadReplicas
from ...engine.chain import Layer
from ...engine.rng import mix
from .comm import enter, gather_invariant, leave, predicting_now, scatter, tp_index, tp_size, vary
from .match import CONV1D, EMBEDDING, LINEAR, Install, LayerPlan
from .styles import Colwise, Region, Rowwise, gathers


class TPForward:
    """A styled module's forward under tensor parallel: communication around the class's forward."""

    def __init__(
        self, module: nn.Module, axis: str, install: Install | None, block: tuple[bool, bool] | None,
        reduce: torch.dtype | None, path: str,
    ) -> None:
        self.module, self.axis, self.install, self.block, self.reduce = module, axis, install, block, reduce
        self.path = path  # in the model: what errors and the Plan call it
        self.locals = {}
        self.hidden = _first_parameter(module)  # read once: inspect.signature costs ~10 us a call
        if install is not None and isinstance(install.style, Region):
            self.locals = {attr: getattr(module, attr) for attr in install.style.local}
        # Random ops on per-rank values (a sequence-parallel block's slices, a Region's heads) draw a
        # stream of their own on each rank; elsewhere (the replicated residual stream) every rank the same.
        self.own_stream = block is not None or (install is not None and isinstance(install.style, Region))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m, install = self.module, self.install
        if self.block is not None and self.block[0]:  # the first sequence-parallel block: split the sequence
            args, kwargs = _map_hidden(m, self.hidden, args, kwargs, lambda h: scatter(h, self.axis, 1, self.path))
        with _rank_stream(self.axis, args, kwargs, sticky=self.block is not None) if self.own_stream else contextlib.nullcontext():
            out = type(m).forward(m, *args, **kwargs) if install is None else self._styled(install, args, kwargs)
        if self.block is not None and self.block[1]:  # the last one: the whole sequence again
            out = _map_first(out, lambda h: gather_invariant(h, self.axis, 1, self.path))
        return out

    def _styled(self, install: Install, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m, style, axis, label = self.module, install.style, self.axis, install.path
        weight, bias = _tensor(m, "weight"), _tensor(m, "bias")
        if isinstance(style, Region):
            n = tp_size(axis)
            for attr, value in self.locals.items():
                setattr(m, attr, value // n)
            args, kwargs = _map_hidden(m, self.hidden, args, kwargs, lambda h: enter(h, axis, install.seq_dim, label, self.reduce))
            return type(m).forward(m, *args, **kwargs)
        (x,) = args
        if isinstance(style, Colwise):
            if install.enters and install.kind != EMBEDDING:
                x = enter(x, axis, install.seq_dim, label, self.reduce)
            y = _conv1d(x, _require(weight), bias) if install.kind == CONV1D else type(m).forward(m, x)
            return gather_invariant(y, axis, y.dim() - 1, label) if gathers(style, install.kind == EMBEDDING) else y
        assert isinstance(style, Rowwise)
        if install.kind == EMBEDDING:
            return leave(_vocab_lookup(m, x, axis), axis, None, label, self.reduce)
        assert weight is not None
        width = weight.shape[1] if install.kind == LINEAR else weight.shape[0]
        if x.shape[-1] != width:
            raise ValueError(
                f"tensor_parallel: Rowwise() on {label!r} takes its input split on the features ({width} of "
                f"{width * tp_size(axis)} on each rank), but got {x.shape[-1]}: give the module before it "
                "Colwise() (its output stays split), inside the same Region"
            )
        y = F.linear(x, weight) if install.kind == LINEAR else _conv1d(x, weight, None)
        y = leave(y, axis, install.seq_dim, label, self.reduce)
        _back_to_shared()  # the summed output is every rank's: so are the random ops on it
        return y if bias is None else y + bias


# -- random streams: per rank on per-rank values, shared on replicated ones ------------------------
_streams = threading.local()  # .saved: the shared streams' state while this rank draws its own


def _generators(device: torch.device) -> list[torch.Generator]:
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()])
    return gens


@contextlib.contextmanager
def _rank_stream(axis: str, args: tuple[Any, ...], kwargs: dict[str, Any], sticky: bool) -> Iterator[None]:
    """Inside the block the default generators draw this rank's own stream, seeded from one draw of
    the shared one, until a Rowwise sums the region's output (then the shared stream goes on, as on
    every rank: dropout on the replicated residual stream agrees); ``sticky`` (a sequence-parallel
    block, whose values are all per-rank) keeps the rank's stream to the end. A recomputation
    replays both, from the state torch's checkpoint restores."""
    if predicting_now() or getattr(_streams, "saved", None) is not None:
        yield
        return
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    gens = _generators(tensors[0].device if tensors else torch.device("cpu"))
    base = int(torch.empty((), dtype=torch.int64).random_().item())
    saved = [g.get_state() for g in gens]
    for i, g in enumerate(gens):
        g.manual_seed(mix(base, tp_index(axis), i))
    _streams.saved, _streams.gens, _streams.sticky = saved, gens, sticky
    try:
        yield
    finally:
        _back_to_shared(force=True)


def _back_to_shared(force: bool = False) -> None:
    """The shared streams again, where this rank left them (after a Rowwise sums a region's output)."""
    saved = getattr(_streams, "saved", None)
    if saved is None or (_streams.sticky and not force):
        return
    for g, state in zip(_streams.gens, saved, strict=True):
        g.set_state(state)
    _streams.saved = None


def _tensor(m: nn.Module, name: str) -> Tensor | None:
    t = getattr(m, name, None)
    return t if isinstance(t, Tensor) else None


def _require(t: Tensor | None) -> Tensor:
    assert t is not None, "a styled Linear / Conv1D / Embedding has a weight"
    return t


def _conv1d(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Hugging Face's Conv1D (``x @ weight + bias``, weight ``(in, out)``) on a weight slice."""
    flat = x.reshape(-1, x.size(-1))
    y = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


def _vocab_lookup(m: nn.Module, ids: Tensor, axis: str) -> Tensor:
    """This rank's rows of a vocabulary-split embedding: ids outside them look up zeros."""
    weight = _tensor(m, "weight")
    assert weight is not None
    rows = weight.shape[0]
    start = tp_index(axis) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    padding = getattr(m, "padding_idx", None)
    local_padding = padding - start if isinstance(padding, int) and start <= padding < start + rows else None
    y = F.embedding(local, weight, local_padding)
    return y.masked_fill(outside.unsqueeze(-1), 0.0)


def _first_parameter(m: nn.Module) -> str | None:
    params = list(inspect.signature(type(m).forward).parameters)
    return params[1] if len(params) > 1 else None


def _map_hidden(
    m: nn.Module, name: str | None, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``fn`` to the module's first argument (the hidden states, ``name``), positional or by name."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if name is None or name not in kwargs:
        raise ValueError(f"tensor_parallel: {type(m).__name__} was called without its hidden states {name!r}")
    return args, {**kwargs, name: fn(kwargs[name])}


def _map_first(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out)
    if type(out) is tuple and out and isinstance(out[0], Tensor):
        return (fn(out[0]), *out[1:])
    raise ValueError(f"tensor_parallel: a sequence-parallel block returned {type(out).__name__}, not its hidden states")


class VaryFn:
    """A layer fn whose replicated parameters used on per-rank values have their gradients summed
    over the axis (``vary``), around the layer fn calling the tensor-parallel module."""

    def __init__(
        self, fn: Callable[[dict[str, Tensor], Any], Any], axis: str, names: frozenset[str], reduce: torch.dtype | None
    ) -> None:
        self.fn, self.axis, self.names, self.reduce = fn, axis, names, reduce

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        if self.names:
            tensors = {k: vary(t, self.axis, k, self.reduce) if k in self.names else t for k, t in tensors.items()}
        return self.fn(tensors, x)

    def __repr__(self) -> str:
        return f"tensor_parallel({self.fn!r})"


def rewrite_layer(layer: Layer, plan: LayerPlan, axis: str, reduce: torch.dtype | None) -> Layer:
    """``layer`` calling a copy of its module with the tensor-parallel forwards installed; sums
    travel in ``reduce`` (None: the values' own dtype)."""
    fn = layer.fn
    replicas = fn.replicas  # type: ignore[attr-defined]
    module = replicas.module
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    copied = copy.deepcopy(module, memo={id(t): t for _, t in named})
    blocks = {sub: (first, last) for sub, _path, first, last in plan.blocks}
    installs = {i.subpath: i for i in plan.installs}
    for subpath in sorted(set(blocks) | set(installs)):
        target = copied.get_submodule(subpath)
        path = installs[subpath].path if subpath in installs else next(p for sub, p, _, _ in plan.blocks if sub == subpath)
        target.forward = TPForward(target, axis, installs.get(subpath), blocks.get(subpath), reduce, path)
    new_fn = copy.copy(fn)
    new_fn.replicas = ThreadReplicas(copied, replicas.prefix)  # type: ignore[attr-defined]
    return Layer(layer.name, VaryFn(new_fn, axis, frozenset(plan.vary), reduce), layer.param_names, layer.buffers, layer.ties)
