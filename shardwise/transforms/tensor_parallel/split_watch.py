"""Whether a Region's module cuts a plain Colwise output into parts along its features.

``Colwise()`` gives each rank a contiguous 1/tp of a projection's output features. A projection
that computes several blocks side by side (q, k and v in one Linear, nanoGPT's and GPT-2's
``c_attn``; gate and up in one) is cut by its module into those blocks (``.split(n_embd, -1)``,
``.chunk(3, -1)``); on a rank's contiguous slice the parts are pieces of other blocks (all of q and
part of k at tp 2), and the model computes another attention without an error. ``Colwise(fused=3)``
cuts each block instead. :class:`SplitWatch` runs around a Region's first forward: a plain
Colwise's output cut along its last dim into a number of parts the module fixes (``chunk(3)``,
``tensor_split(2)``) is refused, naming the module and the fix. A cut by a size (``split(n_embd)``,
which on a rank's slice makes pieces of the wrong width and fails there, or ``split(head_dim)``, a
rank's whole heads) and a ``view`` that splits the blocks (``view(b, t, 3, heads, -1)``, which looks
like one into heads) go unseen.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

# Cuts into a number of parts fixed by the module (chunk(3), tensor_split(2)): the blocks of a fused
# projection. A cut into parts of a size (split(head_dim)) makes as many parts as the slice holds, so
# per-head pieces of a rank's whole heads are its heads: not watched.
_CUTS = {
    torch.chunk: "chunk", Tensor.chunk: "chunk", torch.tensor_split: "tensor_split",
    Tensor.tensor_split: "tensor_split",
}


class SplitWatch(TorchFunctionMode):
    """Refuses a cut along the features of a watched tensor (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, tuple[weakref.ref[Tensor], str]] = {}

    def watch(self, t: Tensor, label: str) -> None:
        self.watched[id(t)] = (weakref.ref(t), label)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _CUTS.get(func)
        if name is not None and args and isinstance(args[0], Tensor):
            entry = self.watched.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                _check(args[0], name, args, kwargs, entry[1])
        return func(*args, **kwargs)


def _check(t: Tensor, name: str, args: Sequence[Any], kwargs: dict[str, Any], label: str) -> None:
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    parts = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("sections"))
    if not isinstance(dim, int) or not isinstance(parts, int) or t.dim() == 0 or dim % t.dim() != t.dim() - 1:
        return  # another dim, or sections given by their indices
    raise ValueError(
        f"tensor_parallel: Colwise() on {label!r} gives each rank a contiguous 1/tp of its output features, and the "
        f"module cuts that output into parts along them ({name}): on a rank the parts are pieces of other blocks "
        "(all of q and part of k, for q, k and v computed in one projection). If it computes several blocks side "
        "by side (q, k and v; gate and up), give it Colwise(fused=<the number of blocks>), and name the width the "
        "module cuts at in the Region's local=(...) (GPT-2's split_size, nanoGPT's n_embd)"
    )
