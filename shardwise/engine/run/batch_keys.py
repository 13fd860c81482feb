"""A dict batch whose keys the model's forward does not take (a misspelled ``input_ids``).

Such a dict is not spread into ``forward(**batch)``: it is passed whole as the first argument,
and the model fails far inside (``'dict' object has no attribute 'size'``), or, where it also names
some of forward's arguments, ``call_arguments`` refuses it. When a layer fails on a dict input, this
names the keys it has and the ones the forward takes.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn


def unknown_keys_message(layer: str, fn: Any, x: Any) -> str | None:
    """Why layer ``layer`` (calling ``fn``) failed on the dict ``x``, or None if the keys fit."""
    module = _module_of(fn)
    if module is None or not isinstance(x, Mapping) or not all(isinstance(k, str) for k in x):
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
        f"layer {layer!r}: its input (the batch) is a dict with keys {sorted(x)}, but "
        f"{type(module).__name__}.forward takes {takes}, not {unknown}, so the dict is not taken as its "
        "keyword arguments; name the keys as the forward's arguments"
        + (f" ({hint})" if hint else "")
    )


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
