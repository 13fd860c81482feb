"""The base of shardwise's autograd Functions: ``apply`` without rebuilding ``forward``'s signature.

torch's ``Function.apply`` binds every call's arguments to ``inspect.signature(cls.forward)`` where the
Function defines ``setup_context`` (torch.func's transforms need it, and every Function of ours defines
it). Building that signature costs about 8 us a call, more than the rest of a small collective's Python,
and a step applies one per collective, per cast and per gradient sum. ``inspect.signature`` returns what a
function's ``__signature__`` holds where it has one: set once, as the class is made, a call's signature
costs 1.5 us. The binding (defaults applied) is torch's, unchanged. ``tests/collectives/test_function.py``
checks that every Function of the package derives from this one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class QuickApplyFunction(torch.autograd.Function):
    """``torch.autograd.Function`` with ``forward``'s signature computed once, as the subclass is made."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        function = getattr(forward, "__func__", forward)  # a staticmethod's function
        if inspect.isfunction(function):
            function.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
