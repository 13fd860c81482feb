"""The one place that touches torch's private ``torch._foreach_*`` kernels.

The functional optimizers need a handful of multi-tensor ops. torch exposes them only as
private API (``torch._foreach_add`` and friends), which may change or vanish between
releases, so every one we use is wrapped here, once:

- each wrapper is out-of-place: it returns new tensors and never writes to its inputs;
- each has a per-tensor fallback with the same math, used when the private attribute is
  missing (``tests/engine/test_foreach.py`` checks that the two agree bitwise, so a torch
  upgrade that changes a kernel fails loudly there instead of silently in training);
- lists are grouped by (device, dtype) of their first argument before the call, as torch's
  own optimizers do, so mixed lists still reach the fused fast path on accelerators. On
  CPU every foreach kernel is a per-tensor loop over the ordinary ATen op, which is why
  the optimizers agree bitwise with ``torch.optim``'s single-tensor implementations there.

Scalars are Python numbers shared by every tensor in the list: nothing here depends on a
tensor's shape, so running an op on 1-D shards of tensors gives the shards of the result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from operator import attrgetter, methodcaller

import torch
from torch import Tensor

__all__ = [
    "add",
    "add_scalar",
    "addcdiv_scalar",
    "addcmul_scalar",
    "bounded_groups",
    "div_scalar",
    "foreach_op",
    "kind_groups",
    "lerp_scalar",
    "mul_scalar",
    "mul_tensor",
    "norm",
    "sqrt",
]

TensorList = Sequence[Tensor]
MIN_GROUP_BYTES = 4 << 20  # bounded_groups: smaller tensors share a range up to this many bytes

# Name of the private op -> the per-tensor op it must agree with, called with the same
# arguments per tensor (scalars are passed by the keyword both accept). The test suite
# iterates over this table, so adding an op here puts it under test automatically.
FALLBACKS: dict[str, Callable[..., Tensor]] = {
    "_foreach_add": torch.add,  # list + list (alpha) and list + scalar
    "_foreach_mul": torch.mul,
    "_foreach_div": torch.div,
    "_foreach_lerp": torch.lerp,
    "_foreach_addcmul": torch.addcmul,
    "_foreach_addcdiv": torch.addcdiv,
    "_foreach_sqrt": torch.sqrt,
    "_foreach_norm": torch.linalg.vector_norm,
}


def foreach_op(name: str) -> Callable[..., list[Tensor]] | None:
    """The private ``torch.<name>`` multi-tensor kernel, or None if this torch lacks it."""
    return getattr(torch, name, None)


def _loop(name: str, lists: Sequence[TensorList], *args: object, **kwargs: object) -> list[Tensor]:
    op = FALLBACKS[name]
    return [op(*tensors, *args, **kwargs) for tensors in zip(*lists, strict=True)]


_DTYPE, _IS_CPU, _NBYTES = attrgetter("dtype"), attrgetter("is_cpu"), attrgetter("nbytes")
_DEVICE_INDEX = methodcaller("get_device")  # an int: the index, -1 on the CPU and on meta


def _kernel_groups(first: TensorList) -> list[list[int]] | None:
    """Indices of ``first`` per (device, dtype), or None when all share one (the usual case,
    checked without building the groups: an optimizer makes several calls per group of tensors)."""
    # get_device() (an int: the index, -1 on the CPU and on meta) and is_cpu spare making a
    # torch.device per tensor, a visible cost on a step of small tensors.
    # Read with map (C-level loops): a generator's resumptions cost more than the reads themselves,
    # nine times a step per range of an AdamW update.
    if len(set(map(_DTYPE, first))) == 1 and len(set(map(_DEVICE_INDEX, first))) == 1 \
            and len(set(map(_IS_CPU, first))) == 1:
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, tensor in enumerate(first):
        groups[(tensor.device, tensor.dtype)].append(i)
    return list(groups.values())


def _apply_inplace(
    name: str, lists: Sequence[TensorList], *args: object, uniform: bool = False, **kwargs: object
) -> list[Tensor]:
    """``torch.<name>_`` on the first list (written in place, then returned), or the per-tensor method."""
    op = foreach_op(name + "_")
    if op is None:
        method = name.removeprefix("_foreach_") + "_"
        for first, *rest in zip(*lists, strict=True):
            getattr(first, method)(*rest, *args, **kwargs)
        return list(lists[0])
    groups = None if uniform else _kernel_groups(lists[0])
    if groups is None:
        op(*lists, *args, **kwargs)
    else:
        for indices in groups:
            op(*([tensors[i] for i in indices] for tensors in lists), *args, **kwargs)
    return list(lists[0])


def _apply(
    name: str, lists: Sequence[TensorList], *args: object, inplace: bool = False, uniform: bool = False,
    **kwargs: object,
) -> list[Tensor]:
    """Runs ``torch.<name>(*lists, *args, **kwargs)``, grouped by (device, dtype), or the loop.

    ``inplace=True`` writes the result into the first list's tensors instead (the kernels are
    the same, so the values are bitwise those of the out-of-place call). ``uniform=True``: the
    caller knows the first list is of one device and dtype (see :func:`bounded_groups`), so it
    is not read again. A wrong word costs speed, not values: torch's kernel takes a mixed list
    one tensor at a time.
    """
    lengths = {len(tensors) for tensors in lists}
    if len(lengths) != 1:
        raise ValueError(
            f"{name}: tensor lists differ in length ({sorted(lengths)}); pass one tensor per leaf in each"
        )
    if not lists[0]:
        return []
    if inplace:
        return _apply_inplace(name, lists, *args, uniform=uniform, **kwargs)
    op = foreach_op(name)
    if op is None:
        return _loop(name, lists, *args, **kwargs)
    groups = None if uniform else _kernel_groups(lists[0])
    if groups is None:
        return list(op(*lists, *args, **kwargs))
    out: list[Tensor | None] = [None] * len(lists[0])
    for indices in groups:
        results = op(*([tensors[i] for i in indices] for tensors in lists), *args, **kwargs)
        for i, result in zip(indices, results, strict=True):
            out[i] = result
    return out  # type: ignore[return-value]  # every index is filled by exactly one group


def add(
    xs: TensorList, ys: TensorList, alpha: float = 1.0, *, inplace: bool = False, uniform: bool = False
) -> list[Tensor]:
    """``x + alpha * y`` per pair."""
    return _apply("_foreach_add", [xs, ys], alpha=alpha, inplace=inplace, uniform=uniform)


def add_scalar(xs: TensorList, scalar: float, *, inplace: bool = False, uniform: bool = False) -> list[Tensor]:
    """``x + scalar`` per tensor."""
    return _apply("_foreach_add", [xs], scalar, inplace=inplace, uniform=uniform)


def mul_scalar(xs: TensorList, scalar: float, *, inplace: bool = False, uniform: bool = False) -> list[Tensor]:
    """``x * scalar`` per tensor."""
    return _apply("_foreach_mul", [xs], scalar, inplace=inplace, uniform=uniform)


def mul_tensor(xs: TensorList, factor: Tensor, *, inplace: bool = False) -> list[Tensor]:
    """``x * factor.to(x.dtype)`` per tensor, ``factor`` a 0-d tensor (a gradient-clipping
    coefficient, say) that never leaves its device for a Python number: it is cast once per
    (device, dtype) of ``xs``, so each product rounds once, in the tensor's own dtype."""
    if not xs:
        return []
    groups = _kernel_groups(xs)
    if groups is None:  # one device and dtype: one cast, one call
        return _apply("_foreach_mul", [xs], factor.to(device=xs[0].device, dtype=xs[0].dtype), inplace=inplace)
    out: list[Tensor | None] = [None] * len(xs)
    for indices in groups:
        part = [xs[i] for i in indices]
        cast = factor.to(device=part[0].device, dtype=part[0].dtype)
        for i, result in zip(indices, _apply("_foreach_mul", [part], cast, inplace=inplace), strict=True):
            out[i] = result
    return out  # type: ignore[return-value]  # every index is filled by exactly one group


def div_scalar(xs: TensorList, scalar: float, *, inplace: bool = False, uniform: bool = False) -> list[Tensor]:
    """``x / scalar`` per tensor (a true division, not a multiplication by the reciprocal)."""
    return _apply("_foreach_div", [xs], scalar, inplace=inplace, uniform=uniform)


def lerp_scalar(
    xs: TensorList, ys: TensorList, weight: float, *, inplace: bool = False, uniform: bool = False
) -> list[Tensor]:
    """``x + weight * (y - x)`` per pair, with torch.lerp's rounding."""
    return _apply("_foreach_lerp", [xs, ys], weight=weight, inplace=inplace, uniform=uniform)


def addcmul_scalar(
    xs: TensorList, ys: TensorList, zs: TensorList, value: float, *, inplace: bool = False, uniform: bool = False
) -> list[Tensor]:
    """``x + value * y * z`` per triple."""
    return _apply("_foreach_addcmul", [xs, ys, zs], value=value, inplace=inplace, uniform=uniform)


def addcdiv_scalar(
    xs: TensorList, ys: TensorList, zs: TensorList, value: float, *, inplace: bool = False, uniform: bool = False
) -> list[Tensor]:
    """``x + value * y / z`` per triple."""
    return _apply("_foreach_addcdiv", [xs, ys, zs], value=value, inplace=inplace, uniform=uniform)


def sqrt(xs: TensorList, *, uniform: bool = False) -> list[Tensor]:
    """``sqrt(x)`` per tensor."""
    return _apply("_foreach_sqrt", [xs], uniform=uniform)


def norm(xs: TensorList, ord: float = 2.0) -> list[Tensor]:
    """The ``ord``-norm of each tensor's elements, one 0-d tensor per tensor."""
    return _apply("_foreach_norm", [xs], ord=ord)


def kind_groups(xs: TensorList) -> list[Sequence[int]]:
    """Index groups of ``xs``, each of one device and dtype: one range of all of them in the usual
    case. Read once, so the ops on a group may pass ``uniform=True``."""
    kinds = _kernel_groups(xs) if xs else None
    return [range(len(xs))] if kinds is None else list(kinds)


def bounded_groups(xs: TensorList) -> list[Sequence[int]]:
    """Index groups of ``xs`` to run an op that makes temporaries on, one group at a time, each of
    one device and dtype (so its ops may pass ``uniform=True``: read once here, not by each op).
    For tensors of one device and dtype (the usual case) they are consecutive ranges.

    On CPU each range holds at most as many bytes as the largest tensor or
    ``MIN_GROUP_BYTES``, whichever is more (one tensor may be a range of its own). The
    temporaries of one range are freed before the next range makes its own, so the allocator
    reuses that memory and an update's temporaries stay within one range's bytes. Made all at
    once, the temporaries of a whole model are one large free at the end, which glibc may hand
    back to the OS, so every step pays page faults to get it again (measured before
    ``run/heap.py``: about 1,300 faults, 1 to 2 ms, per AdamW update of a 4 MB stage). The
    floor keeps tensors together up to 4 MiB, since every range costs each op one call: at
    256 KiB the 8 x Linear(512) MLP's AdamW ran 16 ranges, eight calls each, and the
    single-device step cost 1.050-1.061x torch's loop; at 4 MiB (three ranges) 1.008-1.013x,
    at 8 and 32 MiB 1.014-1.023x (``one_device.py --optims adamw --paired 300``, two runs of
    each). Elsewhere (accelerators keep freed memory cached) it is one range: the fewest
    kernel launches.
    """
    if not xs:
        return []
    kinds = _kernel_groups(xs)
    if kinds is not None:  # mixed: each (device, dtype) bounded on its own, as indices into xs
        return [[kind[i] for i in group] for kind in kinds for group in bounded_groups([xs[i] for i in kind])]
    if not xs[0].is_cpu:
        return [range(len(xs))]
    sizes = list(map(_NBYTES, xs))
    budget = max(MIN_GROUP_BYTES, *sizes)
    groups: list[Sequence[int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if used + size > budget and i > start:
            groups.append(range(start, i))
            start, used = i, 0
        used += size
    groups.append(range(start, len(xs)))
    return groups
