"""Where a rank's heads go when a reshape factors their dim into several (head_views.py follows them there).

A rank holds a contiguous 1/tp of a per-head view's heads. A reshape of that dim, row-major, into factors
(a, b, ...) keeps them one slice along one factor where that factor is the whole's first of more than one, a
multiple of tp of which the rank holds 1/tp, and the factors after it are the whole's: each rank then holds
whole rows of the trailing factors. Falcon's grouped-query ``fused_qkv.view(b, t, num_kv_heads, -1, head_dim)``
(each key/value group's queries, then its key and value) is one: a rank holds whole groups, and a cut along a
trailing factor (``grouped[..., :-2, :]``, each group's queries) is the same cut of each group on a rank as on
one device. A cut along the factor that carries the split (``grouped[..., :1, :, :]``: the first group) is a cut
across the heads, refused as any is.

The whole's sizes are read off the sizes the reshape asked for: a count the Region divides, or one read off a
per-head view's heads dim (a HeadCount, head_numbers.py), is the rank's 1/tp of the whole's; a plain number is
the whole's; one -1 is what the others leave of the whole head count. Where the split falls inside a factor
after the first of more than one (``view(b, t, 2, -1, d)``: head h beside head h + H/2 on one device, other heads
on a rank) the view groups the heads by their place among all of them, and is refused. Where the sizes asked do
not account for the whole head count (read through plain numbers: ``int(h)``), nothing is said here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .head_numbers import HeadCount

# The reshapes that can factor a dim, by name.
FACTORING = frozenset(("view", "reshape", "unflatten"))


def factored_heads(
    name: str, t: Tensor, dim: int, args: Sequence[Any], kwargs: dict[str, Any], out: Tensor, parts: int
) -> int | str | None:
    """After ``out = t.<name>(...)`` factored ``t``'s heads dim ``dim`` (and kept its other dims), the dim of ``out``
    that holds the rank's heads; the words of a refusal where no one dim can; None where ``out`` is no such
    reshape, or the sizes asked cannot be read."""
    k = out.dim() - t.dim() + 1
    if k < 2 or out.shape[:dim] != t.shape[:dim] or out.shape[dim + k:] != t.shape[dim + 1:]:
        return None
    local = list(out.shape[dim:dim + k])
    asked = _asked(name, t, args, kwargs, dim, k, out.dim())
    heads = t.shape[dim] * parts
    whole = _whole(asked, local, heads, parts) if asked is not None else None
    if whole is None:
        return None
    lead = next(j for j, size in enumerate(whole) if size != 1) if heads > 1 else 0
    if whole[lead] == local[lead] * parts and whole[lead + 1:] == local[lead + 1:]:
        return dim + lead
    return (
        f"a {name} of its {t.shape[dim]} heads (dim {dim}) into {local}, where one device views all {heads} of them "
        f"into {whole}: this rank's contiguous 1/{parts} of the heads is not whole rows of dim {dim + lead} there, "
        "so the rank's view groups other heads together than the whole's does"
    )


def _asked(
    name: str, t: Tensor, args: Sequence[Any], kwargs: dict[str, Any], dim: int, k: int, dims: int
) -> list[Any] | None:
    """The sizes the reshape asked for the ``k`` dims it made of ``dim``, as given (a HeadCount kept, -1 where
    inferred); None where they cannot be read."""
    rest = args[1:] if args and args[0] is t else ()
    asked: list[Any] | None
    if name == "unflatten":
        at = kwargs.get("dim", rest[0] if rest else None)
        sizes = kwargs.get("sizes", rest[1] if len(rest) > 1 else None)
        if not isinstance(at, int) or at % t.dim() != dim or not isinstance(sizes, (list, tuple)):
            return None
        asked = list(sizes)
    else:
        shape = kwargs.get("shape", kwargs.get("size", rest[0] if len(rest) == 1 else rest))
        asked = list(shape) if isinstance(shape, (list, tuple)) and len(shape) == dims else None
        asked = asked[dim:dim + k] if asked is not None else None
    return asked if asked is not None and len(asked) == k and all(isinstance(a, int) for a in asked) else None


def _whole(asked: list[int], local: list[int], heads: int, parts: int) -> list[int] | None:
    """The sizes one device's reshape makes of all ``heads`` (see the module docstring); None where the sizes
    asked do not account for them."""
    whole: list[int | None] = []
    for a, size in zip(asked, local, strict=True):
        if isinstance(a, HeadCount) and int(a) == size:
            whole.append(size * parts)
        elif a == -1 and None not in whole:
            whole.append(None)
        elif a == size:
            whole.append(size)
        else:
            return None
    known = math.prod(s for s in whole if s is not None)
    if None in whole:
        if not known or heads % known:
            return None
        whole[whole.index(None)] = heads // known
    sizes = [s for s in whole if s is not None]
    return sizes if math.prod(sizes) == heads else None
