"""A user's optimizer run on meta tensors without torch's Python references of the ``*_like`` factories.

The state's layout and the Plan size the optimizer's state, and what its update holds, by running
its ``init`` and ``update`` on meta tensors, at every ``init`` on every rank. On a meta tensor
torch's ``zeros_like`` (``empty_like``, ``ones_like``, ``full_like``, ``rand_like``, ``randn_like``)
runs a Python reference, and importing those imports sympy and torch.fx's symbolic shapes: about
0.36 s of CPU and 36 MiB of resident memory in every process, once. The built-in optimizers size their state with
``torch.zeros``; a user's optimizer usually calls ``torch.zeros_like``. Inside :func:`meta_like`
such a call on a contiguous meta tensor is served by ``torch.empty`` of its shape, dtype and
``requires_grad``: what torch's own call gives there (a meta tensor has no values, and a contiguous
input's strides are preserved as contiguous ones). Any other call (another memory format, device or
layout, a non-contiguous input) runs as it would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LIKE: dict[Callable[..., Any], int] = {  # each factory, and how many positional arguments it takes
    torch.empty_like: 1, torch.zeros_like: 1, torch.ones_like: 1, torch.full_like: 2,
    torch.rand_like: 1, torch.randn_like: 1,
}
_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


class meta_like(TorchFunctionMode):
    """Serve the ``*_like`` factories on contiguous meta tensors with ``torch.empty`` (see above)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        positional = _LIKE.get(func)
        if positional is not None and len(args) == positional and _served(args[0], kwargs):
            like = args[0]
            return torch.empty(like.shape, dtype=kwargs.get("dtype") or like.dtype, device="meta",
                               requires_grad=bool(kwargs.get("requires_grad", False)))
        return func(*args, **kwargs)


def _served(like: Any, kwargs: dict[str, Any]) -> bool:
    return (
        isinstance(like, torch.Tensor) and like.is_meta and like.layout == torch.strided and like.is_contiguous()
        and set(kwargs) <= {"dtype", "device", "layout", "requires_grad", "memory_format", "pin_memory"}
        and kwargs.get("device") in (None, "meta", torch.device("meta"))
        and kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory")
        and kwargs.get("memory_format") in _FORMATS
    )
