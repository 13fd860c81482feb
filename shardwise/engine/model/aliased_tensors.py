"""Refusing a module whose trainable parameters would train otherwise than torch's: sharing memory with
another of its tensors, or carrying a gradient hook of their own.

Tied the old way, two Parameters can be one storage (``self.out.weight.data = self.emb.weight.data``, a
transposed view of another weight, a buffer registered on a parameter's ``.data``): torch's optimizer
updates each in place into that memory, so every use reads the one tensor, updated by the sum of the
updates. ``functionalize`` finds ties by identity (the same ``Parameter`` under two names), and the step
trains copies: such a pair would train as two independent weights (and a buffer on a weight stay at the
weight's first value) without an error. So a trainable parameter whose memory overlaps another tensor of
the module is refused, naming both, with the real tie to write instead. Tensors that do not train (frozen
parameters, buffers) may share memory among themselves: nothing updates them.

Likewise a hook on a parameter itself (``emb.weight.register_hook(lambda g: g * mask)``, to train only the
rows of new tokens; ``register_post_accumulate_grad_hook``): the step computes the gradient of its own copy,
which carries no hook, so the hook would never run. Refused, naming the parameter and a forward that does
the same.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .fx_split import FunctionalizeError


def refuse_aliased(module: nn.Module) -> None:
    """Refuse ``module`` where a trainable parameter's memory overlaps another of its tensors'."""
    spans: dict[int, list[tuple[int, int, str, bool]]] = {}
    named = [(n, t, True) for n, t in module.named_parameters()] + [(n, t, False) for n, t in module.named_buffers()]
    tensors = {n: t for n, t, _ in named}
    for name, t, is_param in named:
        if t.is_meta or t.numel() == 0 or t.layout is not _STRIDED:
            continue
        trains = is_param and t.requires_grad
        start = int(t.storage_offset())
        extent = sum((int(size) - 1) * abs(int(stride)) for size, stride in zip(t.shape, t.stride(), strict=True))
        stop = start + extent + 1
        item = t.element_size()
        spans.setdefault(t.untyped_storage().data_ptr(), []).append((start * item, stop * item, name, trains))
    for found in spans.values():
        if len(found) < 2:
            continue
        found.sort()
        for i, (_, stop, name, trains) in enumerate(found):
            for other_start, _, other, other_trains in found[i + 1:]:
                if other_start >= stop:
                    break
                if (trains or other_trains) and _overlap(tensors[name], tensors[other]):  # (trainable first)
                    pair = (name, other) if trains else (other, name)
                    raise FunctionalizeError(_message(module, *pair))


_STRIDED = Tensor().layout
_MARKED_AT_MOST = 1 << 28  # elements of memory marked to tell two interleaved views apart; beyond, taken as one


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two strided tensors on one storage share an element (their spans overlap: they may still
    interleave, as q and k cut by columns from one fused weight, or even and odd elements)."""
    if a.dtype != b.dtype:
        return True
    lo = min(int(a.storage_offset()), int(b.storage_offset()))
    hi = max(int(t.storage_offset()) + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride(), strict=True))
             for t in (a, b)) + 1
    if hi - lo > _MARKED_AT_MOST:
        return True
    marks = torch.zeros(hi - lo, dtype=torch.bool)
    marks.as_strided(a.shape, a.stride(), int(a.storage_offset()) - lo).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), int(b.storage_offset()) - lo).any())


def refuse_param_hooks(module: nn.Module) -> None:
    """Refuse ``module`` where a parameter carries a gradient hook of its own (it would never run)."""
    for name, p in module.named_parameters():
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
            raise FunctionalizeError(
                f"functionalize: parameter {name!r} of {type(module).__name__} carries a gradient hook "
                "(register_hook or register_post_accumulate_grad_hook). The step trains a copy of each parameter, "
                "and computes its gradient there, so the hook would never run (a gradient mask that keeps some "
                "rows fixed would not). Do it in the forward instead: for a mask, read the weight as "
                "torch.where(mask, w, w.detach()) (the masked rows get no gradient); to freeze it whole, "
                "requires_grad_(False) or sw.optim.group(..., frozen=True). Then remove the hook."
            )


def _message(module: nn.Module, a: str, b: str) -> str:
    kinds = {n: "parameter" for n, _ in module.named_parameters()}
    return (
        f"functionalize: {kinds.get(a, 'buffer')} {a!r} and {kinds.get(b, 'buffer')} {b!r} of "
        f"{type(module).__name__} share memory (one was set to the other's .data, or to a view of it, or both "
        "are views of one tensor; load_state_dict(assign=True) of a tied checkpoint makes such views). torch's "
        "optimizer updates each in place into that memory, so what one writes the other reads; functionalize "
        "finds ties by identity and the step trains copies, so they would train apart without an error. Tie "
        "them as one "
        f"Parameter (model.{b} = model.{a}; for a transposed use, read the one weight transposed in forward), or "
        f"give each its own memory (.data = ....clone())."
    )
