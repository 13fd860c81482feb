"""Refusals of state a layer keeps across its calls, which a step's several calls would advance
more than once or lose (the version-counter check in ``Executor._run_layers`` sees in-place writes
only).

A layer's module may keep state of two kinds that its forward changes:

* its buffers' contents, written through ``.data`` (an EMA codebook's ``embed_avg.data.mul_``):
  ``.data`` is a tensor of its own with its own version counter, so the in-place check misses it.
  Under ZeRO-3 each rank, under accumulation each micro-batch and under remat each recompute
  writes once more (on the threads backend two ranks even write one storage).
* its Python attributes (``self.calls += 1`` feeding the output): they live on the layer's copy of
  the module and advance once per call, which equals torch's loop only while the layer runs once
  per step. A second micro-batch, a pipeline's micro-batches or a recompute call it again.

Both are checked on a layer's watched calls only (its first step on each thread), so later steps
cost nothing: the buffers' contents are compared around the layer's first call; its Python state
after that call is compared with the state at the end of the step (before the update), which a
recompute in backward or a second micro-batch would have changed. State a call sets from its input
(a cache length set again to the same value) is the same after every call and passes.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import nn

from ..model import hf_collecting
from ..model.module_call import module_fn
from ..model.predicted_state import state_holder
from ..torch_api import is_fake, version_of
from .thread_token import thread_token

# (layer -> the threads (thread_token.py) that ran its watched step): a rank thread's copy of the module is its own.
_WATCHED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()

# What nn.Module keeps in its __dict__ for itself (containers, hooks, flags torch sets), and transformers' mark
# that its output-capturing hooks are on (set at a model's first call): not state a forward advances.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"} | hf_collecting.BOOKKEEPING

_SCALARS = (bool, int, float, complex, str, bytes, type(None))

# nn.LSTM's (GRU's, RNN's) list of its weights, which each call's swapped-in parameters replace: not state.
_RNN_WEIGHTS = "_flat_weights"


class ForwardStateWatch:
    """One rank's step's watch: the layers it watches this step and their Python state after their
    first call."""

    def __init__(self) -> None:
        self._after_first: dict[str, tuple[nn.Module, dict[str, Any]]] = {}
        self._seen: set[str] = set()  # the layers this step has called (asked of every call: a set lookup)

    def first_call(self, name: str, chain: Any) -> bool:
        """Whether this is the first call of layer ``name`` on this thread (then marks it watched)."""
        if name in self._seen:
            return False
        self._seen.add(name)
        layer = chain[name]
        me = thread_token()
        # Every later step asks once per layer: read without the lock (a dict's and a set's lookups are
        # atomic, and only this thread adds itself), which cost more than the rest of the question.
        watched = _WATCHED.get(layer)
        if watched is not None and me in watched:
            return False
        with _LOCK:
            threads = _WATCHED.setdefault(layer, set())
            if me in threads:
                return False
            threads.add(me)
            return True

    def snapshot(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
        """The buffers' version counters and contents before the watched call."""
        return {k: (version_of(b), b.detach().clone()) for k, b in buffers.items() if not b.is_meta}

    def after_first(self, name: str, layer: Any, buffers: Mapping[str, torch.Tensor],
                    before: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Refuse a ``.data`` write into the buffers in the watched call (an in-place write, which
        moves the version counter, is left to the caller's check); keep the module's Python state for
        :meth:`check_end`."""
        written = [k for k, (version, b) in before.items()
                   if version_of(buffers[k]) == version and not same_state(b, buffers[k])]
        if written:
            raise ValueError(
                f"layer {name!r} wrote into its buffers {written} during forward (through .data or "
                "another alias, which the in-place check cannot see): a pure layer keeps no state, so the "
                "update would be lost between steps, applied once per micro-batch or recompute, or leak "
                "across ranks; make it a parameter, compute it from the input, or leave the module in eval mode"
            )
        module = _module_of(layer)
        if module is not None:
            self._after_first[name] = (module, python_state(module))

    def check_end(self) -> None:
        """Refuse a layer whose Python state changed after its first call in this step (a second
        micro-batch, a pipeline's later micro-batch, a recompute in backward)."""
        pending, self._after_first = self._after_first, {}
        for name, (module, first) in pending.items():
            now = python_state(module)
            changed = sorted(k for k in first.keys() | now.keys() if k not in first or k not in now
                             or not same_state(first[k], now[k]))
            if changed:
                raise ValueError(
                    f"layer {name!r} changed its module's attributes {changed} again on a second call within "
                    "one step (a second micro-batch, a pipeline micro-batch or a recompute): state advanced in "
                    "forward advances once per call, not once per step as in torch's loop, so the step would "
                    "compute another model; keep the state outside the model (pass it in with the batch), "
                    "compute it from the input, or train without accumulation, pipelining and remat"
                )


def watched(key: str, value: Any) -> bool:
    """Whether :func:`python_state` watches a module's attribute ``key`` holding ``value``."""
    return key not in _MODULE_INTERNALS and _kept_kind(value)


def _kept_kind(value: Any) -> bool:
    return isinstance(value, (*_SCALARS, torch.Tensor, list, tuple, dict, collections.deque)) or state_holder(value)




def python_state(module: nn.Module) -> dict[str, Any]:
    """Every submodule's plain attributes a forward could advance: numbers, strings, tuples of them,
    tensors kept as plain attributes (by value), and lists, tuples and dicts of those (their entries
    and length), by qualified name; an RNN's list of its weights is not state."""
    state: dict[str, Any] = {}
    for path, sub in module.named_modules(remove_duplicate=True):
        for key, value in vars(sub).items():
            if key in _MODULE_INTERNALS or (key == _RNN_WEIGHTS and isinstance(sub, nn.RNNBase)):
                continue
            kept = _kept(value)
            if kept is not _SKIP:
                state[f"{path}.{key}" if path else key] = kept
    return state


_SKIP = object()
_MAX_ITEMS = 256  # a container longer than this: its tensors compared by identity, not copied (a memory bank)


class _Items(dict):
    """A list's or dict's watched entries (by index or key), with the container's type: state kept in
    ``self.state["calls"]`` or a list a forward appends to advances as an attribute does."""

    def __init__(self, kind: type, items: dict[Any, Any]) -> None:
        super().__init__(items)
        self.kind = kind


@dataclass(frozen=True)
class _Unreadable:
    """A tensor attribute whose storage no longer holds it (a view of a ZeRO-3 unit's gathered parameters, kept by
    a forward as ``self.wt = self.lin.weight.t()``, after the unit's storage was freed): reading it would read
    freed memory (a segmentation fault), so it is compared by shape and dtype alone (the state it views is the
    parameters', not the module's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def readable(t: torch.Tensor) -> bool:
    """Whether every element ``t`` views lies inside its storage (a freed one holds none)."""
    if t.numel() == 0:
        return True
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + extent) * t.element_size() <= t.untyped_storage().nbytes()


@dataclass(frozen=True, eq=False)
class _Same:
    """A tensor compared by identity: a sparse one (a graph's adjacency: no storage to read, no elementwise ==),
    or one entry of a container too long to copy (a memory bank of every batch's features)."""

    tensor: torch.Tensor


def _kept(value: Any, depth: int = 0, whole: bool = True) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return value
        if value.layout != torch.strided or not whole:
            return _Same(value)
        return value.detach().clone() if readable(value) else _Unreadable(tuple(value.shape), value.dtype)
    if isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value):
        return value
    if state_holder(value) and depth < 3:
        return _Items(type(value), {k: v for k, v in ((k, _kept(v, depth + 1, whole)) for k, v in vars(value).items())
                                    if v is not _SKIP})
    if isinstance(value, (list, tuple, dict, collections.deque)) and depth < 3:
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        # A tensor in a container is state as a plain tensor attribute is (a truncated-BPTT (h, c) tuple, a
        # list of batch statistics, a dict of running means); in one longer than _MAX_ITEMS each tensor is
        # compared by identity (a slot replaced shows), not copied. Objects and modules are left out; a change
        # in length still shows.
        short = whole and len(value) <= _MAX_ITEMS
        kept = {k: _kept(v, depth + 1, short) for k, v in pairs}
        return _Items(type(value), {"<len>": len(value), **{k: v for k, v in kept.items() if v is not _SKIP}})
    return _SKIP


def same_state(a: Any, b: Any) -> bool:
    """Whether two values python_state kept are the same state (tensors by value, a NaN equal to itself)."""
    if isinstance(a, _Items) or isinstance(b, _Items):
        return (isinstance(a, _Items) and isinstance(b, _Items) and a.kind is b.kind and a.keys() == b.keys()
                and all(same_state(a[k], b[k]) for k in a))
    if isinstance(a, _Same) or isinstance(b, _Same):
        return isinstance(a, _Same) and isinstance(b, _Same) and a.tensor is b.tensor
    if isinstance(a, _Unreadable) or isinstance(b, _Unreadable):  # a view of freed parameters: by shape and dtype
        return all(isinstance(v, (_Unreadable, torch.Tensor)) for v in (a, b)) and \
            (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.is_meta or b.is_meta:
            return a is b or (a.is_meta and b.is_meta and a.shape == b.shape and a.dtype == b.dtype)
        if is_fake(a) or is_fake(b):  # (values unknown: reading them raises) the same only as one tensor
            return a is b
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():  # a NaN kept in a buffer is no write
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return bool(torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and bool(a == b)


def _module_of(layer: Any) -> nn.Module | None:
    """This thread's copy of the module ``layer`` calls; None for a layer of a plain function."""
    fn = module_fn(layer.fn)
    return None if fn is None else fn.replicas.get().module


def same_output(a: Any, b: Any) -> bool:
    """Whether two calls' outputs are the same (tensors by value, bit for bit, a NaN equal to itself)."""
    leaves_a, spec_a = optree.tree_flatten(a, none_is_leaf=True)
    leaves_b, spec_b = optree.tree_flatten(b, none_is_leaf=True)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if not same_state(x.detach(), y.detach()):
                return False
        elif not same_state(x, y):
            return False
    return True
