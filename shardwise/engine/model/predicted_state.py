"""A prediction on fake tensors leaves no fake tensor in a module's attributes.

The Plan's predictions (a pipeline's stage boundaries, the output's shapes, what the forward keeps) run the
layers' own modules on fake tensors. A forward that sets a plain attribute from its input there (an
ActNorm-style ``if self.scale is None: self.scale = x.std(0)``, a cache of the input's length kept as a
tensor) would leave a fake tensor in the module, which the step's real call then reads: torch fails with a
raw error from inside its fake-tensor machinery, or the lazy initialization is skipped. So a module call on
fake tensors puts back every attribute (of the module and its submodules) that it left holding a fake tensor,
as the attribute was: the real call then sets it from real values (and engine/run/first_call_state.py judges
that). Attributes it set to anything else are left as they are (a split's modules note what they ran).

A forward may also memoize a tensor outside the module, in a cache its class's method holds (transformers'
``compile_compatible_method_lru_cache``: BEiT's relative position index, keyed by the window size): made on fake
tensors, the cached fake tensor was then read by the step's real call, and by any real model of that class in the
process (torch's raw ``DataDependentOutputException``). :func:`clear_method_caches` empties those caches after a
fake run: they are memos, and the next real call fills them again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..torch_api import is_fake

_FAKE = torch._C._TorchDispatchModeKey.FAKE
_MODULE_DICTS = frozenset({"_parameters", "_buffers", "_modules"})
_ABSENT = object()


def predicting_on_fake_tensors() -> bool:
    """Whether a fake-tensor mode is in force (about 0.15 us: asked once per module call)."""
    return torch._C._get_dispatch_mode(_FAKE) is not None


def clear_method_caches(module: nn.Module) -> None:
    """Empty every ``functools.lru_cache`` a method of a class of ``module``'s modules holds (directly, or inside
    the wrapper transformers puts around it), where it holds anything: what a run on fake tensors may have left."""
    for cls in {type(m) for m in module.modules()}:
        for cache in _method_caches(cls):
            if cache.cache_info().currsize:
                cache.cache_clear()


_CACHES: dict[type, tuple[Any, ...]] = {}  # a class -> the lru caches its methods hold (found once per class)


def _method_caches(cls: type) -> tuple[Any, ...]:
    found = _CACHES.get(cls)
    if found is None:
        caches: dict[int, Any] = {}
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                continue
            for attribute in vars(klass).values():
                value = getattr(attribute, "__func__", attribute)  # (a staticmethod's, BEiT's: one cache for all)
                cells = getattr(value, "__closure__", None) or ()
                for cache in (value, *(c.cell_contents for c in cells if _has_contents(c))):
                    if callable(getattr(cache, "cache_clear", None)) and callable(getattr(cache, "cache_info", None)):
                        caches[id(cache)] = cache
        found = _CACHES[cls] = tuple(caches.values())
    return found


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def no_fake_state_left(module: nn.Module) -> Iterator[None]:
    """The block (a call of ``module`` on fake tensors) leaves no attribute of ``module``'s modules holding a
    fake tensor: such an attribute is set back to what it was (removed if it was not there), and a list or
    dict attribute changed in place gets its entries back."""
    before = [(sub, {k: (v, _entries(v)) for k, v in vars(sub).items() if k not in _MODULE_DICTS})
              for sub in module.modules()]
    try:
        yield
    finally:
        clear_method_caches(module)
        for sub, kept in before:
            for key, value in list(vars(sub).items()):
                if key in _MODULE_DICTS or not _holds_fake(value):
                    continue
                was, entries = kept.get(key, (_ABSENT, None))
                if was is _ABSENT:
                    delattr(sub, key)
                    continue
                if was is not value:
                    vars(sub)[key] = was
                elif isinstance(value, dict):  # changed in place: its entries back
                    value.clear()
                    value.update(entries)
                elif isinstance(value, list):
                    value[:] = entries
                elif isinstance(value, collections.deque):
                    value.clear()
                    value.extend(entries)
                elif entries is not None:  # an object holding state by attribute (a SimpleNamespace)
                    vars(value).clear()
                    vars(value).update(entries)


def _entries(value: Any) -> Any:
    """A shallow copy of a list's, deque's or dict's entries (to restore one changed in place), else None."""
    if isinstance(value, (list, collections.deque)):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if state_holder(value):
        return dict(vars(value))
    return None


def state_holder(value: Any) -> bool:
    """A plain object a forward keeps state in by attribute (``self.stats.centre``: a SimpleNamespace, or an instance
    of a dataclass of one's own), watched as a dict of its attributes is. Not a library's dataclass: a Hugging Face
    config (every module of a model holds it, and forwards only read it) or model output, shardwise's own records."""
    if isinstance(value, types.SimpleNamespace):
        return True
    # (a slots dataclass has no __dict__ to hold state in: a read-only config, torchtitan's ModelArgs)
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__dict__") and \
        type(value).__module__.partition(".")[0] not in _LIBRARIES


_LIBRARIES = frozenset({"transformers", "torch", "shardwise", "diffusers", "timm", "peft", "accelerate"})


def _holds_fake(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return is_fake(value)
    if depth < 3 and isinstance(value, (list, tuple, collections.deque)):
        return any(_holds_fake(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return any(_holds_fake(v, depth + 1) for v in value.values())
    if depth < 3 and state_holder(value):
        return any(_holds_fake(v, depth + 1) for v in vars(value).values())
    return False
