"""Micro-batches' weight gradients summed in the precision policy's reduce dtype, not in the compute copies'.

Under ``mixed_precision`` the leaves a backward writes are the compute copies (bf16, f16), so torch sums a
second micro-batch's gradient into the first's ``.grad`` in that dtype: rounded once per micro-batch. With
``accumulation=16`` in bf16 a gradient came out 7.7e-3 (relative to its largest element) from the one summed
in float32, where one device's backward of the whole batch rounds once (FSDP2's ``reduce_dtype``, DeepSpeed's
and Megatron's fp32 gradient accumulation sum in float32 too). After each micro-batch's weight gradients the
executor moves them into a sum in the policy's ``reduce`` dtype (:meth:`WideGrads.take`); what reads a leaf's
gradient gets that sum rounded once to the leaf's dtype (:meth:`WideGrads.fold`), as one backward makes it, so
that a gradient overflowing f16 there overflows here too (a step skipped where one device skips it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

Key = tuple[str, str]  # (owner layer, local name)


def overflowing_as(total: torch.Tensor, made_in: torch.dtype) -> torch.Tensor:
    """``total`` (a sum in a wider dtype), infinite where it overflows ``made_in``: a sum of f16 gradients that one
    device's backward of the whole batch would make infinite (a step skipped) is infinite here too."""
    if not narrower(made_in, total.dtype):
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
        """Move the gradients a backward just wrote into ``leaves`` into their sums."""
        for key, leaf in leaves:
            grad, want = leaf.grad, self.dtypes.get(key[0])
            if grad is None or want is None or not narrower(grad.dtype, want):
                continue
            total = self.sums.get(key)
            if total is None:
                self.sums[key] = grad.to(want)
            else:
                total.add_(grad)
            leaf.grad = None

    def fold(self, key: Key, leaf: torch.Tensor | None) -> None:
        """Put ``key``'s sum back into its leaf's ``.grad``, rounded once to the leaf's dtype."""
        total = self.sums.pop(key, None)
        if total is None or leaf is None:
            return
        grad = total.to(leaf.dtype)
        leaf.grad = grad if leaf.grad is None else leaf.grad.add_(grad)
