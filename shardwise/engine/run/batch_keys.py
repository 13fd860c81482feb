"""A dict batch whose keys the model's forward does not take (a misspelled ``input_ids``).

Such a dict is not spread into ``forward(**batch)``: it is passed whole as the first argument,
and the model fails far inside (``'dict' object has no attribute 'size'``), or, where it also names
some of forward's arguments, ``call_arguments`` refuses it. When a layer fails on a dict input because its
code took the dict for a tensor (the error names the dict's type), this names the keys it has and the ones the
forward takes, after the error and where it was raised. A forward that takes the dict whole
(``forward(self, batch)``) and fails on something else (a shape mismatch in a Linear) fails with that error
itself: the keys were not the cause.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import traceback
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_TORCH = os.path.dirname(torch.__file__) + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def unknown_keys_message(layer: str, fn: Any, x: Any, err: BaseException) -> str | None:
    """Why layer ``layer`` (calling ``fn``) failed with ``err`` on the dict ``x``, or None where the keys fit or
    were not the cause (``err`` does not name the dict's type: the model's code took the dict as it is)."""
    module = _module_of(fn)
    if module is None or not isinstance(x, Mapping) or not all(isinstance(k, str) for k in x):
        return None
    if not re.search(rf"\b{re.escape(type(x).__name__)}\b", str(err)):
        return None
    takes = _arguments(module)
    if takes is None:
        return None
    unknown = [k for k in x if k not in takes]
    if not unknown:
        return None
    close = {k: difflib.get_close_matches(k, takes, n=1) for k in unknown}
    hint = "; ".join(f"{k!r} -> {m[0]!r}?" for k, m in close.items() if m)
    return (
        f"layer {layer!r} failed: {type(err).__name__}: {err}{_raised_at(err)}. Its input (the batch) is a dict with "
        f"keys {sorted(x)}, but {type(module).__name__}.forward takes {takes}, not {unknown}, so the dict is not "
        "taken as its keyword arguments: it went in whole as the first one; name the keys as the forward's arguments"
        + (f" ({hint})" if hint else "")
    )


def _raised_at(err: BaseException) -> str:
    """`` (at file:line in function)``: the last frame of ``err``'s traceback in the model's code (outside torch
    and shardwise's engine, shardwise.testing's models included), where it was raised or made the call that
    raised; empty where there is none."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_TORCH)
              and (not f.filename.startswith(_OURS) or f.filename.startswith(_OURS + "testing"))]
    return f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


def _module_of(fn: Any) -> nn.Module | None:
    """The module a layer fn calls, through the wrappers transforms put around it (their ``fn``)."""
    for _ in range(8):
        module = getattr(getattr(fn, "replicas", None), "module", None)
        if isinstance(module, nn.Module):
            return module
        fn = getattr(fn, "fn", None)
        if fn is None:
            return None
    return None


def _arguments(module: nn.Module) -> list[str] | None:
    """The forward's named arguments; None where it takes ``**kwargs`` (any key is taken)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
