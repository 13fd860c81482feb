"""Ops that take a per-head tensor's heads by an index or a mask (head_views.py follows the tensor).

A rank holds 1/tp of the heads, numbered from 0 on each, so an index of the heads dim names other heads on
each rank than on one device: ``q.index_fill_(1, torch.tensor([0]), 0)`` zeroes head 0 of all of them on one
device and each rank's first head under tensor parallel, another model trained without an error (1e-4 relative
in the loss after one step of the tests' tiny attention). The same holds for ``index_copy_``, ``index_add_``,
``index_reduce_``, ``index_put_`` (and their out-of-place forms), a ``scatter_`` along the heads and an
``index_select`` of them, and for a mask or a condition that differs between heads without being computed from
their values (``masked_fill_(torch.arange(q.size(1)).view(1, -1, 1, 1) == 0, 0)``, ``torch.where(...)``).

An index read on this call decides (it is the watched first call's): the rank's heads each in their place
(``torch.arange(q.size(1))``) compute what one device computes, and pass; one head alone counts as a head
taken one at a time (a loop over all of the rank's heads passes, a fixed head is refused at the layer's end:
SplitWatch.finish); anything else (two heads of four, heads reordered) is refused here, naming the op, the
layer and the fix. A mask passes where it is one value along the heads (a causal mask of (b, 1, t, t)), is
itself followed per head (``q > 0``: computed from the heads' values), or does not differ between heads;
a mask that differs between heads and is not followed is refused, data or not (the watch cannot tell a
pattern built from head numbers from values it lost track of: ``q.sum(-1, keepdim=True) > 0`` is such a
mask; compare ``q > 0`` instead, or the whole ``q``'s reduction, which keeps its shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .model_frames import innermost_model_line
from .read_refusals import head_number_message

if TYPE_CHECKING:
    from .split_watch import SplitWatch, _Output

# Ops that take a dim and an index along it: (the dim's position, the index's), after the op's self (the tensor
# written, or read by index_select), and whether the op writes (a head it takes alone counts as written).
_BY_DIM = {
    **dict.fromkeys(("index_fill", "index_fill_"), (0, 1, True)),
    **dict.fromkeys(("index_copy", "index_copy_", "index_add", "index_add_", "index_reduce", "index_reduce_"),
                    (0, 1, True)),
    **dict.fromkeys(("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"),
                    (0, 1, True)),
    "index_select": (0, 1, False),
}
# Of those, the ops whose index sends values from a source to places: the index must keep each head in its place
# (arange), where a fill only needs all of them (any order).
_FILLS = {"index_fill", "index_fill_"}
_MASKS = {"masked_fill": 1, "masked_fill_": 1, "masked_scatter": 1, "masked_scatter_": 1, "where": 0}
_PUTS = {"index_put", "index_put_"}
NAMES = frozenset((*_BY_DIM, *_MASKS, *_PUTS))


class HeadIndexRefused(ValueError):
    """An index of the heads that takes some of them by their number (the refusal's words are its message)."""


def index_heads(index: Any, heads: int, fill: bool = False) -> str | int:
    """What an index tensor (or list) of a dim of ``heads`` heads takes: "whole" where each head in its place
    (``arange(heads)`` along one of its dims, the same along the others; any order covering them all for a
    ``fill``), the head's number where it takes one alone; raises HeadIndexRefused otherwise."""
    if isinstance(index, (list, tuple)):
        index = torch.tensor(index)
    if not isinstance(index, Tensor):
        raise HeadIndexRefused(f"an index {index!r}")
    if index.is_meta:
        raise HeadIndexRefused("an index on the meta device, whose heads the watch cannot read")
    if index.dtype == torch.bool:
        if index.dim() != 1:
            raise HeadIndexRefused(f"a mask of shape {list(index.shape)}")
        index = index.nonzero().flatten()
    values = index.detach().flatten().tolist()
    if values and len(set(v % heads for v in values)) == 1:
        return values[0] % heads
    whole = torch.arange(heads, device=index.device)
    if fill and sorted(set(v % heads for v in values)) == whole.tolist():
        return "whole"
    for axis, size in enumerate(index.shape):
        if size == heads:
            along = whole.view([heads if k == axis else 1 for k in range(index.dim())])
            if bool((index % heads == along).all()):
                return "whole"
    shown = values if len(values) <= 8 else [*values[:8], "..."]
    raise HeadIndexRefused(f"an index of heads {shown}")


def see_head_index(
    watch: SplitWatch, name: str, t: Tensor, entry: _Output, dim: int, args: Sequence[Any], kwargs: dict[str, Any],
    out: Any,
) -> bool:
    """Check an index or mask op (NAMES) that took ``t``, a rank's heads of ``entry`` along ``dim``; True where it
    took them whole with an index_select (``out`` then followed), False where see_heads goes on as before."""
    line = innermost_model_line()
    try:
        if name in _BY_DIM:
            return _by_dim(watch, name, t, entry, dim, args, kwargs, out, line)
        if name in _PUTS:
            _put(watch, name, t, entry, dim, args, kwargs, line)
        else:
            _mask(watch, name, t, dim, args, kwargs, out)
    except HeadIndexRefused as refused:
        raise ValueError(head_number_message(entry, f"{name} with {refused} along its heads (dim {dim}) at {line}",
                                             t, dim) + _FIX) from None
    return False


_FIX = (
    ". An index of the heads must be torch.arange(q.size(1)) (each of the rank's heads in its place), or one head "
    "in a loop over all of them; a mask must be computed from the heads' values (q > 0), or be the same for every "
    "head (size 1 along the heads dim)"
)


def _by_dim(
    watch: SplitWatch, name: str, t: Tensor, entry: _Output, dim: int, args: Sequence[Any], kwargs: dict[str, Any],
    out: Any, line: str,
) -> bool:
    at_dim, at_index, writes = _BY_DIM[name]
    rest = list(args[1:])
    op_dim = kwargs.get("dim", rest[at_dim] if len(rest) > at_dim else None)
    index = kwargs.get("index", rest[at_index] if len(rest) > at_index else None)
    if not isinstance(op_dim, int) or op_dim % t.dim() != dim:
        return False  # along another dim: each head's values in their place
    if name.startswith("scatter"):  # an index per element: its values name the heads, where it sits the source's
        taken = index_heads(index, t.shape[dim]) if not isinstance(index, Tensor) or index.dim() != t.dim() else (
            _scatter_heads(index, dim, t.shape[dim])
        )
    else:
        taken = index_heads(index, t.shape[dim], fill=name in _FILLS)
    if taken == "whole":
        if name == "index_select" and isinstance(out, Tensor) and args[0] is t:
            watch.follow_heads(out, entry, dim)
            return True
        return False
    if args[0] is not t:  # t is the source: its heads go where the index says, each in its place only if whole
        raise HeadIndexRefused(f"an index of one head ({taken}) for all of a source's {t.shape[dim]} heads")
    view = out if name == "index_select" else None  # one head written, or read: a loop's, or a fixed head
    watch.take_head(t, entry, dim, int(taken), f"{name}(..., [{taken}]) at {line}", write=writes, view=view)
    return name == "index_select"


def _scatter_heads(index: Tensor, dim: int, heads: int) -> str | int:
    """A scatter's index of as many dims as the tensor: each element's head; arange along ``dim`` keeps them."""
    if index.is_meta:
        raise HeadIndexRefused("an index on the meta device, whose heads the watch cannot read")
    values = set(index.detach().flatten().tolist())
    if len(values) == 1:
        return next(iter(values)) % heads
    along = torch.arange(index.shape[dim], device=index.device).view(
        [index.shape[dim] if k == dim else 1 for k in range(index.dim())]
    )
    if index.shape[dim] == heads and bool((index % heads == along).all()):
        return "whole"
    shown = sorted(values)[:8]
    raise HeadIndexRefused(f"an index of heads {shown} (not each head in its place)")


def _put(
    watch: SplitWatch, name: str, t: Tensor, entry: _Output, dim: int, args: Sequence[Any], kwargs: dict[str, Any],
    line: str,
) -> None:
    if args[0] is not t:
        return  # the values put: taken whole, each where the indices say (checked where the written tensor is followed)
    indices = kwargs.get("indices", args[1] if len(args) > 1 else ())
    indices = list(indices) if isinstance(indices, (list, tuple)) else [indices]
    if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices):
        raise HeadIndexRefused("a boolean index, whose heads the watch does not follow")
    if len(indices) <= dim or indices[dim] is None:
        return  # the heads dim taken whole
    tensors = [i for i in indices if isinstance(i, Tensor)]
    at = next(k for k, i in enumerate(tensors) if i is indices[dim])  # (by identity: == compares values)
    heads_index = torch.broadcast_tensors(*tensors)[at]
    taken = index_heads(heads_index, t.shape[dim])
    if taken != "whole":
        watch.take_head(t, entry, dim, int(taken), f"{name}(..., [{taken}]) at {line}", write=True)


def _mask(watch: SplitWatch, name: str, t: Tensor, dim: int, args: Sequence[Any], kwargs: dict[str, Any],
          out: Any) -> None:
    at = _MASKS[name]
    mask = kwargs.get("condition" if name == "where" else "mask", args[at] if len(args) > at else None)
    if not isinstance(mask, Tensor) or mask is t or watch._heads_of(mask) is not None:
        return  # no mask, or one computed from followed heads' values (q > 0)
    shape = list(out.shape) if isinstance(out, Tensor) else list(t.shape)
    heads_dim = dim + len(shape) - t.dim()  # where t's heads sit in the broadcast shape
    at_mask = heads_dim - (len(shape) - mask.dim())
    if at_mask < 0 or mask.shape[at_mask] == 1:
        return  # one value along the heads: the same for each
    if mask.is_meta:
        raise HeadIndexRefused("a mask on the meta device that differs along the heads, which the watch cannot read")
    if bool((mask == mask.narrow(at_mask, 0, 1)).all()):
        return
    raise HeadIndexRefused(
        f"a {'condition' if name == 'where' else 'mask'} of shape {list(mask.shape)} that differs between heads and "
        "is not computed from their values (built from head numbers, as torch.arange(q.size(1)) == 0 is)"
    )
