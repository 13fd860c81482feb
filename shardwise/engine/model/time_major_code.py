"""Whether a chain's code may call a torch functional that is time-major by contract, read from the code alone.

The sequence-first check (``sequence_first.py``) hears such calls (``F.multi_head_attention_forward``,
``F.ctc_loss``) on a run on fake tensors. A model that calls none of them would pay that run for nothing at its
first call per layout and rank (half a second for a small GPT-2, seconds in a process that never ran on fake
tensors before), so the run is made only where the code can reach one: a function of a module's class (its
own or a base's outside torch) or of the Python module defining it names one (``F.ctc_loss``, an import of
the function under another name), or the chain holds an ``nn.CTCLoss``. A layer's plain function (a chain
built by hand) is read with its module's functions the same way. Code in another Python module than the
class's, reached through a helper, is not read (see the guide's limits).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .chain import Chain
from .whole_batch import called_modules

# The names a call of a time-major functional shows in code (an attribute, a global), and the functions.
NAMES = frozenset({"multi_head_attention_forward", "ctc_loss", "CTCLoss"})
FUNCTIONS = (torch.nn.functional.multi_head_attention_forward, torch.nn.functional.ctc_loss, torch.ctc_loss)


def may_call_time_major(chain: Chain) -> bool:
    """Whether ``chain``'s code names a time-major functional (see the module's docstring)."""
    for _, module in called_modules(chain):
        if isinstance(module, nn.CTCLoss) or _class_names_one(type(module)):
            return True
    for layer in chain:
        fn: Any = layer.fn
        for _ in range(8):  # a plain function inside the split wrappers (their ``fn``)
            if isinstance(fn, types.FunctionType):
                if _names_one(fn.__code__) or _module_names_one(fn.__module__):
                    return True
                break
            fn = getattr(fn, "fn", None)
    return False


def _class_names_one(cls: type) -> bool:
    """Whether a function of ``cls`` or of a base outside torch, or of a Python module defining one, names one
    (kept per class)."""
    found = _CLASSES.get(cls)
    if found is None:
        found = _CLASSES[cls] = _scan_class(cls)
    return found


_CLASSES: dict[type, bool] = {}


def _scan_class(cls: type) -> bool:
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        if any(_names_one(code) for code in _codes(vars(base).values())) or _module_names_one(base.__module__):
            return True
    return False


@functools.cache
def _module_names_one(name: str) -> bool:
    """Whether a function of Python module ``name`` (module-level, or a class's defined there) names one, or
    the module holds one under another name."""
    found = sys.modules.get(name)
    if found is None or name.split(".")[0] == "torch":
        return False
    values = list(vars(found).values())
    if any(any(v is f for f in FUNCTIONS) for v in values):
        return True
    classes = [v for v in values if isinstance(v, type) and v.__module__ == name]
    return any(_names_one(code) for code in _codes([*values, *(m for c in classes for m in vars(c).values())]))


def _codes(values: Any) -> Iterator[types.CodeType]:
    for value in values:
        value = getattr(value, "__func__", value)  # a staticmethod's, classmethod's function
        value = getattr(value, "fget", value)  # a property's getter
        code = getattr(value, "__code__", None)
        if isinstance(value, types.FunctionType) and isinstance(code, types.CodeType):
            yield code


def _names_one(code: types.CodeType) -> bool:
    """Whether ``code`` or a function nested in it names a time-major functional."""
    if NAMES.intersection(code.co_names):
        return True
    return any(_names_one(c) for c in code.co_consts if isinstance(c, types.CodeType))
