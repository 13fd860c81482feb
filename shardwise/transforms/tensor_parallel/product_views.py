"""The per-head views a Colwise Linear subclass's own forward makes of its product (weight_reads.py follows them).

Its forward runs on the rank's slice of the output features. With ``Colwise()`` that slice is a contiguous
1/tp of them, the rank's whole heads where the features are laid out per head: a view that splits them
into (heads, ...) by sizes it fixes after the heads (``view(*x.shape[:-1], -1, head_dim)``; a head-major
fused q, k, v: ``view(b, t, -1, 3, head_dim)``, q, k and v of each head side by side) makes the rank's
heads, each whole. With ``Colwise(fused=N)`` the slice is the rank's 1/tp of each of N equal blocks, side
by side (q, k and v: ``[q_r; k_r; v_r]``): a view with the N blocks outermost, given as N, then the heads
(``view(b, t, 3, -1, head_dim)``), makes the rank's heads of each block, the same heads of q, k and v.

Either view may then have its dims moved (``transpose``, ``permute``): its heads dim is followed. A view
that leaves the head width to -1 (by a whole head count: the rank's 1/tp of the width), gives its heads
beside a size read off the rank's width, mixes the features with other dims, or, fused, does not put its
N blocks outermost (a head-major layout split as blocks: pieces of other heads) is refused, saying why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class HeadView:
    """A per-head view of a Colwise product: its ``lead`` leading dims (the input's, kept), then the features
    factored into ``sizes`` on this rank (outermost first), ``sizes[heads]`` the rank's heads; ``order`` is
    for each dim of the view the dim of that unmoved view it holds (None: unmoved)."""

    lead: int
    sizes: tuple[int, ...]
    heads: int = 0
    order: tuple[int, ...] | None = None
    block: int | None = None  # a view of one of a fused product's blocks, cut apart by the forward (stacked_blocks)

    @property
    def width(self) -> int:
        """The rank's features."""
        return math.prod(self.sizes)

    @property
    def dims(self) -> tuple[int, ...]:
        return self.order if self.order is not None else tuple(range(self.lead + len(self.sizes)))

    @property
    def heads_dim(self) -> int:
        """The dim of the view holding the rank's heads."""
        return self.dims.index(self.lead + self.heads)

    @property
    def counted(self) -> list[int]:
        """Its sizes, the heads first (what a whole head count is checked against: head_views.py)."""
        return [self.sizes[self.heads], *(s for k, s in enumerate(self.sizes) if k != self.heads)]

    def moved(self, name: str, t: Tensor, args: Sequence[Any]) -> HeadView | None:
        """The view after ``t.<name>(*args)`` moved its dims (a transpose, a permute); None for another op."""
        n = t.dim()
        order: list[int] | None = None
        if name in ("transpose", "swapaxes", "swapdims") and len(args) >= 2 and all(
            isinstance(a, int) for a in args[:2]
        ):
            a, b = args[0] % n, args[1] % n
            order = list(range(n))
            order[a], order[b] = b, a
        elif name == "permute":
            given = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
            if len(given) == n and all(isinstance(a, int) for a in given):
                order = [a % n for a in given]
        if order is None or sorted(order) != list(range(n)):
            return None
        dims = self.dims
        new = tuple(dims[k] for k in order)
        return replace(self, order=None if new == tuple(range(n)) else new)


MOVES = frozenset(("transpose", "swapaxes", "swapdims", "permute"))
CUTS = frozenset(("chunk", "split", "tensor_split"))


def cut_into_blocks(t: Tensor, args: Sequence[Any], kwargs: dict[str, Any], out: Any, fused: int) -> bool:
    """Whether ``out``, a cut (chunk, split, tensor_split) of a Colwise(fused=N) product ``t``, is its N blocks:
    N equal parts along its features, the rank's 1/tp of each block (``q, k, v = y.chunk(3, -1)``)."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return (
        fused > 1 and isinstance(dim, int) and t.dim() > 0 and dim % t.dim() == t.dim() - 1
        and isinstance(out, (tuple, list)) and len(out) == fused
        and all(isinstance(p, Tensor) and p.shape[-1] * fused == t.shape[-1] for p in out)
    )


def cut_refused(name: str, t: Tensor, args: Sequence[Any], kwargs: dict[str, Any], out: Any, fused: int) -> str | None:
    """What a cut of a Colwise product along its features that is not its fused blocks did (the words for
    check_product's refusal); None for a cut along another dim."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(dim, int) or not t.dim() or dim % t.dim() != t.dim() - 1 or not isinstance(out, (tuple, list)):
        return None
    sizes = [p.shape[-1] for p in out if isinstance(p, Tensor)]
    cut = f"{name} of its {list(t.shape)} into {sizes} along its features"
    if fused == 1:
        return (
            f"{cut}: blocks side by side (q, k and v), which a plain Colwise() cuts across (all of q and part of k on "
            f"a rank); give it Colwise(fused={len(sizes)}) if they are {len(sizes)} equal blocks"
        )
    return f"{cut}, not its {fused} blocks of {t.shape[-1] // fused}"


def stacked_blocks(views: Sequence[HeadView | None], dim: Any, fused: int) -> HeadView | None:
    """The view ``torch.stack(blocks, dim)`` makes of per-head views of a fused product's N blocks, each once, alike
    (the blocks then outermost, before the heads: ``view(b, t, N, -1, head_dim)``'s); None otherwise."""
    first = views[0] if views else None
    if first is None or len(views) != fused or not isinstance(dim, int) or first.order is not None:
        return None
    if any(v is None or replace(v, block=None) != replace(first, block=None) for v in views) or sorted(
        v.block for v in views if v is not None and v.block is not None
    ) != list(range(fused)):
        return None  # (in any order: every rank holds its heads of every block, so k, q, v stack alike)
    if dim % (first.lead + len(first.sizes) + 1) != first.lead:
        return None
    return HeadView(first.lead, (fused, *first.sizes), 1 + first.heads)


def reshaped(
    name: str, t: Tensor, viewed: HeadView | None, rest: Sequence[Any], kwargs: dict[str, Any], out: Tensor,
    fused: int, width_read: bool,
) -> HeadView | str | None:
    """What ``out``, a reshape (``name``) of a Colwise product ``t`` (or of its per-head view ``viewed``), is: its
    per-head view; None where it holds the features last again (merged back, or the leading dims moved); or,
    refused, the words saying what it did (see the module docstring)."""
    shapes = f"{name} of its {list(t.shape)} to {list(out.shape)}"
    if viewed is not None and viewed.order is not None:
        return f"{shapes}, after moving the dims of its per-head view: its heads and features mixed otherwise"
    width = viewed.width if viewed is not None else (t.shape[-1] if t.dim() else 0)
    lead = viewed.lead if viewed is not None else t.dim() - 1
    factors = _trailing(list(out.shape), width, list(t.shape[:lead]))
    if factors is not None and len(factors) == 1:
        return None
    asked = None if factors is None else _asked(name, rest, kwargs, out.dim(), len(factors))
    if factors is None or asked is None:
        return f"{shapes}, its features mixed with other dims"
    heads = 0
    if fused > 1:
        if asked[0] != fused or len(asked) < 3:
            return (
                f"{shapes}, not its {fused} fused blocks outermost, given as {fused}, then its heads: each rank "
                f"holds its 1/tp of each of the {fused} blocks side by side (q_r, k_r, v_r), so only view(*x.shape"
                f"[:-1], {fused}, -1, head_dim) makes whole heads of them; a product laid out per head (q, k and v "
                "of each head side by side) takes a plain Colwise() instead"
            )
        heads = 1
    per_head = asked[heads:]
    if -1 in per_head[1:]:
        blocks = fused == 1 and heads == 0 and len(asked) >= 3 and asked[0] != -1 and asked[1] == -1
        return f"{shapes}, " + (
            f"its first {asked[0]} given as a number and the heads inferred after it: {asked[0]} fused blocks "
            f"outermost (q, k and v side by side), which a plain Colwise() cuts across (all of q and part of k "
            f"on a rank); give it Colwise(fused={asked[0]})" if blocks else
            "the head width left to -1 (the rank's 1/tp of it where the heads are a whole count)"
        )
    if per_head[0] != -1 and width_read:
        return (
            f"{shapes}, its heads given with the rank's width read off the output (y.shape[-1] // heads: 1/tp of the "
            "head width where the count is whole)"
        )
    return HeadView(lead, tuple(factors), heads)


def _trailing(shape: list[int], width: int, lead: list[int]) -> list[int] | None:
    """The trailing dims of ``shape`` that hold ``width`` features after the leading dims ``lead`` (kept as they
    were: the product's dims follow its input's, which tensor parallel reads them by), or None."""
    product = 1
    for k in range(len(shape) - 1, -1, -1):
        product *= shape[k]
        if product == width:
            return shape[k:] if shape[:k] == lead else None
        if product > width:
            return None
    return None


def _asked(name: str, rest: Sequence[Any], kwargs: dict[str, Any], dims: int, parts: int) -> list[Any] | None:
    """The sizes the reshape asked for its last ``parts`` dims, as given (-1 where inferred); None where they
    cannot be read."""
    if name == "unflatten":
        sizes = kwargs.get("sizes", rest[1] if len(rest) > 1 else None)
        asked = list(sizes) if isinstance(sizes, (list, tuple)) else None
    else:
        shape = kwargs.get("shape", kwargs.get("size", rest[0] if len(rest) == 1 else rest))
        asked = list(shape) if isinstance(shape, (list, tuple)) else None
        asked = asked if asked is not None and len(asked) == dims else None
    if asked is None or len(asked) < parts or not all(isinstance(a, int) for a in asked[len(asked) - parts:]):
        return None
    return asked[len(asked) - parts:]
