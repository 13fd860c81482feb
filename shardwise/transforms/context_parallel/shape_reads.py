"""The watched call's shape reads along the dims that hold positions, and the torch calls given what they read.

``unsplit.Unsplit`` (a TorchFunctionMode) sees ``Tensor.shape``, ``size``, ``len`` and ``numel``: of a tensor
whose dims hold the part's positions, :func:`read_shape` returns those dims' sizes as
:class:`~.part_length.PartLength` (``len`` of one whose dim 0 holds them is refused by ``Unsplit``: CPython
makes what ``__len__`` returns a plain ``int``). A new tensor sized by the part's length (``torch.ones(t)``,
``x.new_ones(x.shape)``) holds the part's positions along those dims (:func:`sized_dims`): ``Unsplit`` tags them,
so a sum or cumsum of it along them is refused as one of the hidden states would be. :func:`judge_numbers`
says, for a torch call given a marked number, whether it is used as a size (passed) or as a value (why it is
refused); see ``part_length.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from .part_length import Part, PartLength

_SHAPE_GET = torch.Tensor.shape.__get__  # type: ignore[attr-defined]
SHAPE_READS = frozenset({"__get__", "size", "__len__", "numel"})
TagsOf = Callable[[Any], dict[int, tuple[int, int]]]

# Calls whose number arguments are only sizes of their output or of its pieces: the values they make do not
# depend on them (a view, a new tensor of zeros, a repeat, a split into pieces, a pad by zeros).
_SIZES = frozenset({
    "view", "reshape", "_reshape_alias", "expand", "broadcast_to", "unflatten", "repeat", "tile", "new_empty",
    "new_zeros", "new_ones", "empty", "zeros", "ones", "rand", "randn", "empty_strided", "new_empty_strided",
    "split", "split_with_sizes", "tensor_split", "chunk", "pad", "constant_pad_nd", "resize_", "unfold",
})
_FILLED = {"full": 0, "new_full": 1}  # (their size argument's place; the fill value is a value)
# Calls that make a new tensor of the size their arguments give (after the tensor a ``new_*`` method is called on).
# Calls that grow a tensor's dims to the sizes given (``torch.ones(1).expand(t)``, ``broadcast_to(x.shape)``,
# ``repeat(1, t, 1)`` of a dim of one): a dim grown to the part's length holds its positions as a new one does.
_GROWN = frozenset({"expand", "broadcast_to", "repeat", "tile"})
_NEW = frozenset({"empty", "zeros", "ones", "rand", "randn", "full", "empty_strided", "randint", "new_empty",
                  "new_zeros", "new_ones", "new_full", "new_empty_strided"})


def sized_dims(name: str, args: Any, kwargs: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """The dims of a new tensor (``torch.ones(t)``, ``x.new_ones(x.shape)``; or one grown to it, ``expand(t)``)
    sized by the part's length as read:
    they hold the part's positions (their values are made for them: a count, a mask, a cumulated sum of ones),
    so the rules on such dims apply to them. Rows folded with it by a product with plain ints, in the order
    written, hold them too (``torch.ones(b * t)``: (batch, sequence); ``torch.ones(t * h)``: ``h`` inside each
    position); another size computed from it (``t // 2``, ``t + 1``) is not followed."""
    if name not in _NEW and not (name in _GROWN and args and isinstance(args[0], torch.Tensor)):
        return {}
    given = list(args[1:] if name.startswith("new_") or name in _GROWN else args)
    if name in _FILLED or name in ("empty_strided", "new_empty_strided"):
        given = given[:1]
    elif name == "randint":
        given = [a for a in given if isinstance(a, (list, tuple))][:1]
    if "size" in kwargs:
        given = [kwargs["size"]]
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = list(given[0])
    if name in ("repeat", "tile"):  # (a count of copies: the part's positions only where a dim of one is repeated)
        shape = [1] * (len(given) - args[0].dim()) + list(args[0].shape)
        given = [v if d < len(shape) and shape[d] == 1 else None for d, v in enumerate(given)]
    return {d: _counted_in(v) for d, v in enumerate(given) if isinstance(v, PartLength) and _counted_in(v)[1] > 1}


def _counted_in(size: PartLength) -> tuple[int, int]:
    """The stride range of the positions along a new dim of ``size``: ``(1, t)`` for the length as read,
    ``size.rows`` for rows folded with it in the order written (``b * t``, ``t * h``); none for any other."""
    if size.rows is not None:
        return size.rows
    if size.length is not None and int.__int__(size) == size.length:
        return 1, size.length
    return 0, 0


def is_shape_read(func: Any, name: str) -> bool:
    return name in SHAPE_READS and (name != "__get__" or func == _SHAPE_GET)


def read_shape(func: Any, name: str, args: Any, kwargs: dict[str, Any], tags_of: TagsOf, parts: int | None) -> Any:
    """``func(*args, **kwargs)``, a shape read, with the sizes of the dims that hold positions marked; each
    knows what one device reads in its place (``whole``: ``parts`` times as many positions, None: not known)."""
    out = func(*args, **kwargs)
    t = args[0]
    tags = tags_of(t)
    dims = {d for d in tags if d >= 0}
    if not dims:
        return out

    def whole(v: int, k: int = 1) -> int | None:
        return None if parts is None else v * parts ** k

    if name == "numel":
        return PartLength(out, _origin(t, f"{{}}.numel() ({out})"), whole=whole(out, len(dims)))
    if name == "__len__":
        if 0 not in dims:
            return out
        return PartLength(out, _origin(t, f"len({{}}) ({out})"), _length(tags, 0, out), whole=whole(out))
    if isinstance(out, int):  # size(d)
        d = (args[1] if len(args) > 1 else kwargs["dim"]) % t.dim()
        if d not in dims:
            return out
        read = f"{{}}.size({args[1] if len(args) > 1 else d}) ({out})"
        return PartLength(out, _origin(t, read), _length(tags, d, out), whole=whole(out))
    how = "shape" if name == "__get__" else "size()"
    return torch.Size([PartLength(v, _origin(t, f"{{}}.{how}[{d}] ({v})"), _length(tags, d, v), whole=whole(v))
                       if d in dims else v for d, v in enumerate(out)])


def _length(tags: dict[int, tuple[int, int]], d: int, v: int) -> int | None:
    """``v``, where dim ``d`` is the sequence itself (not rows of (batch, sequence) folded)."""
    return v if tags.get(d, (0, 0))[0] == 1 else None


FIRST_ROWS = "first rows"  # judge_numbers: x[:t] of a dim that holds no positions (see counted.py)


def judge_numbers(func: Any, name: str, args: Any, kwargs: dict[str, Any], where: Any, tags_of: TagsOf) -> str | None:
    """Why ``func`` uses a part's length found in ``where`` (an argument, a list or a slice) as a value; None
    where it is a size; :data:`FIRST_ROWS` for ``x[.., :t]`` along a dim of ``x`` that holds no positions."""
    if name in _SIZES:
        return None
    if name in _FILLED:
        size = args[_FILLED[name]] if len(args) > _FILLED[name] else kwargs.get("size")
        if where is size or (isinstance(size, (list, tuple)) and any(where is s for s in size)):
            return None
        return f"fills a tensor with it ({_qualified(func)})"
    if name == "__getitem__":
        return _indexing(args[0], args[1], tags_of)
    if name == "narrow":
        x, dim, start, length = (*args, *kwargs.values())[:4]
        d = dim % x.dim()
        if d in tags_of(x) and start == 0 and length >= x.shape[d]:
            return None
        return f"narrows a {list(x.shape)} tensor by it along dim {d}, {_not_whole(d, tags_of(x))}"
    return f"passes it to {_qualified(func)} as a value"


def _indexing(x: torch.Tensor, index: Any, tags_of: TagsOf) -> str | None:
    """``x[index]``: a part's length in a slice passes where the slice takes the whole of a dim that holds the
    positions (``h[:, :t]``); elsewhere it picks by a count of the part's positions (``table[:t]``: the first
    ``t`` rows, not this rank's)."""
    items = index if isinstance(index, tuple) else (index,)
    tags = tags_of(x)
    ellipsis = next((i for i, e in enumerate(items) if e is Ellipsis), None)
    d = 0
    for i, e in enumerate(items):
        if e is Ellipsis:
            d = x.dim() - sum(1 for f in items[i + 1:] if f is not None)
            continue
        if e is None:
            continue
        if isinstance(e, slice) and any(isinstance(b, Part) for b in (e.start, e.stop, e.step)):
            size = x.shape[d]
            first = e.start in (None, 0) and e.step in (None, 1) and not isinstance(e.start, Part)
            if first and d not in tags and isinstance(e.stop, PartLength) and e.stop.length == e.stop:
                return FIRST_ROWS + f" {d}"
            starts = e.start in (None, 0) or (e.start is not None and e.start <= -size)
            if not (starts and e.step in (None, 1) and (e.stop is None or e.stop >= size) and d in tags):
                return f"slices a {list(x.shape)} tensor by it along dim {d}, {_not_whole(d, tags)}"
        elif isinstance(e, Part):
            return f"indexes a {list(x.shape)} tensor at it along dim {d}"
        d += 1
    del ellipsis
    return None


def _not_whole(d: int, tags: dict[int, tuple[int, int]]) -> str:
    if d in tags:
        return "which holds the part's positions: not the whole dim"
    return ("which does not hold the part's positions: it takes the first rows of a table by the part's count, "
            "not this rank's positions")


def _qualified(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", repr(func))
    if isinstance(owner, type) or (owner is None and getattr(func, "__objclass__", None) is not None):
        return f"Tensor.{name}" if "Tensor" in repr(func) else f"torch.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{name}" if not module.startswith("torch._C") else f"torch.{name}"


_SKIP = ("torch.", "shardwise.transforms.context_parallel.")


def _origin(t: torch.Tensor, how: str) -> str:
    """``how`` with the name the reading code gives ``t`` (``h.shape[1] (4)``): found among its frame's locals."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(_SKIP):
        frame = frame.f_back
    name = None
    if frame is not None:
        name = next((k for k, v in frame.f_locals.items() if v is t), None)
    return how.format(name or f"a {list(t.shape)} tensor's")
