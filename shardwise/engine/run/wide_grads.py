"""Micro-batches' weight gradients summed in the precision policy's reduce dtype, not in the compute copies'.

Under ``mixed_precision`` the leaves a backward writes are the compute copies (bf16, f16), so torch sums a
second micro-batch's gradient into the first's ``.grad`` in that dtype: rounded once per micro-batch. With
``accumulation=16`` in bf16 a gradient came out 7.7e-3 (relative to its largest element) from the one summed
in float32, where one device's backward of the whole batch rounds once (FSDP2's ``reduce_dtype``, DeepSpeed's
and Megatron's fp32 gradient accumulation sum in float32 too). Before a backward that would add to a gradient a
leaf holds (an earlier micro-batch's), the executor moves that gradient into a sum in the policy's ``reduce``
dtype (:meth:`WideGrads.take`); what reads a leaf's gradient gets the sum with the leaf's own added in, in that
dtype (:meth:`WideGrads.fold`): what the reduction sends and the update reads, in it anyway. Infinite where the
leaf's dtype overflows: a sum of f16 gradients that one device's backward of the whole batch makes infinite (a
step skipped) is infinite here too. A gradient reduced before the next micro-batch's backward (ZeRO-3's share of
each micro-batch) is never moved: no copy, no bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

Key = tuple[str, str]  # (owner layer, local name)


# Elements added at a time where the dtypes differ: torch casts the narrower operand of an in-place add whole first
# (a float32 copy of a bf16 gradient, 16 MiB for a Linear(2048)'s, beside the sum), a piece at a time here.
_PIECE = 1 << 18


def add_into(total: torch.Tensor, grad: torch.Tensor) -> None:
    """``total += grad`` in ``total``'s dtype, with no whole copy of ``grad`` cast to it."""
    if grad.dtype == total.dtype or total.numel() <= _PIECE or not (total.is_contiguous() and grad.is_contiguous()):
        total.add_(grad)
        return
    flat, more = total.view(-1), grad.reshape(-1)
    for start in range(0, flat.numel(), _PIECE):
        flat[start:start + _PIECE].add_(more[start:start + _PIECE])


def summed_in(precision: Any, layer: str) -> torch.dtype | None:
    """The dtype ``layer``'s micro-batch gradients are summed in under ``precision`` (a ``Precision`` or None):
    its policy's reduce dtype where it is wider than the compute dtype; None where torch's own sum is it."""
    if precision is None:
        return None
    policy = precision.for_layer(layer)
    return policy.reduce if narrower(policy.compute, policy.reduce) else None


def overflowing_as(total: torch.Tensor, made_in: torch.dtype) -> torch.Tensor:
    """``total`` (a sum in a wider dtype), infinite where it overflows ``made_in``: a sum of f16 gradients that one
    device's backward of the whole batch would make infinite (a step skipped) is infinite here too."""
    if not narrower(made_in, total.dtype) or total.numel() == 0:
        return total
    if torch.finfo(made_in).max * 2 > torch.finfo(total.dtype).max:
        return total  # bf16's range is float32's: nothing a float32 sum holds overflows it (no pass, no sync)
    low, high = torch.aminmax(total)  # (two numbers: no copy of the sum where nothing comes near overflowing)
    limit = torch.finfo(made_in).max
    if -limit <= float(low) and float(high) <= limit:
        return total
    as_made = total.to(made_in)
    return torch.where(as_made.isinf() & total.isfinite(), as_made.to(total.dtype), total)


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` holds fewer mantissa bits than ``than`` (bf16 and f16 than f32)."""
    return dtype.is_floating_point and than.is_floating_point and torch.finfo(dtype).eps > torch.finfo(than).eps


class WideGrads:
    """The sums of the step's micro-batches' weight gradients, per leaf, in each layer's reduce dtype."""

    def __init__(self, dtypes: Mapping[str, torch.dtype]) -> None:
        self.dtypes = dtypes  # per owner layer: the dtype its gradients are summed in
        self.sums: dict[Key, torch.Tensor] = {}

    def take(self, leaves: Iterable[tuple[Key, torch.Tensor]]) -> None:
        """Before a backward into ``leaves``: move the gradients they hold into their sums."""
        for key, leaf in leaves:
            grad, want = leaf.grad, self.dtypes.get(key[0])
            if grad is None or want is None or not narrower(grad.dtype, want):
                continue
            total = self.sums.get(key)
            if total is None:
                self.sums[key] = grad.to(want)
            else:
                add_into(total, grad)
            leaf.grad = None

    def fold(self, key: Key, leaf: torch.Tensor | None) -> torch.Tensor | None:
        """``key``'s gradient: its sum with the gradient its leaf holds added in (the leaf's emptied), infinite
        where the leaf's dtype overflows; the leaf's own where it has no sum."""
        total = self.sums.pop(key, None)
        if leaf is None:
            return total
        if total is None:
            return leaf.grad
        if leaf.grad is not None:
            add_into(total, leaf.grad)
            leaf.grad = None
        return overflowing_as(total, leaf.dtype)

    def keep(self, key: Key, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """Give ``leaf`` the gradient ``grad`` (a tied weight's copies summed): in its sum where it is wider."""
        if grad.dtype == leaf.dtype:
            leaf.grad = grad
        else:
            self.sums[key], leaf.grad = grad, None
