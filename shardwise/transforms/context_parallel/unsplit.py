"""An attention context_parallel does not know, found by what it computes, and refused.

context_parallel replaces the attentions it knows (``attention.py``: by their structure; a transformers
attention calling the ``AttentionInterface`` is pointed at its split function, ``hf_interface.py``, which
runs inside :func:`installed_attention` too; any other module whose class name ends in ``Attention`` is
refused by name). An attention module named otherwise
(a user's ``MHA``, ``SelfAttn``) was left as it is: it attended over the rank's part of the sequence
only and trained another model without an error. So the first time a layer runs for an input shape (the
Plan's prediction, or the first step), a TorchFunctionMode watches its ops outside the attention the
transform installed (:func:`installed_attention`): a ``scaled_dot_product_attention``, a softmax of a
``[..., t, t]`` tensor (eager attention's scores, ``t`` the rank's part of the sequence), or a ``conv1d``
of kernel > 1 over a length-``t`` dim (a convolution over time, as Mamba-style mixers have), is refused,
naming the innermost module that runs it.

A running sum or product along a dim of the part's length (``cumsum`` and its kin: RoBERTa's position ids
counted from the padding) is refused too, and so is an op on the batch's ``attention_mask`` (which carries the
whole sequence's mask to the attentions) outside transformers' mask making, the attentions and shardwise.
What it cannot see: other ops that mix positions (a reduction over the tokens, a token shift by padding or
rolling), and code that bypasses ``__torch_function__``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .masks import is_carried

_ATTENTION = frozenset({"scaled_dot_product_attention"})
_SOFTMAX = frozenset({"softmax", "log_softmax", "_softmax"})
_state = threading.local()  # .installed: how deep this thread is in an installed attention


@contextmanager
def installed_attention() -> Iterator[None]:
    """Inside the attention context_parallel installed (ring or Ulysses over the whole sequence)."""
    _state.installed = getattr(_state, "installed", 0) + 1
    try:
        yield
    finally:
        _state.installed -= 1


class Unsplit(TorchFunctionMode):
    """Refuses attention over the rank's part of the sequence outside the installed attentions."""

    def __init__(self, layer: str, axis: str, local: int | None) -> None:
        super().__init__()
        self.layer, self.axis, self.local = layer, axis, local

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not getattr(_state, "installed", 0):
            name = getattr(func, "__name__", "")
            if name in _ATTENTION:
                self._refuse(f"calls {name}")
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            local = self.local
            if not isinstance(x, torch.Tensor) or local is None:
                pass
            elif name in _SOFTMAX and x.dim() >= 3 and x.shape[-1] == x.shape[-2] == local:
                self._refuse(f"takes {name} of a {list(x.shape)} tensor (attention scores)")
            elif name == "conv1d" and isinstance(w, torch.Tensor) and x.shape[-1] == local and w.shape[-1] > 1:
                self._refuse(f"convolves a {list(x.shape)} tensor over its last dim, the sequence, with a kernel "
                             f"of {w.shape[-1]}")
            elif name in _SCANS and _scanned_dim_is_the_sequence(x, args, kwargs, local) and not _making_a_mask():
                self._refuse(f"takes {name} of a {list(x.shape)} tensor along the sequence (RoBERTa's position ids "
                             "counted from the padding)", _SCAN_FIX)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and any(is_carried(a) for a in (*args, *kwargs.values())) and not (
                    _making_a_mask() or _caller().startswith("shardwise.")):  # (shardwise reading its own mask)
                self._refuse(f"computes {name} of the batch's attention_mask, which under context_parallel carries the "
                             "whole sequence's mask to the attentions (a [batch, 1, 2, seq] tensor, not the batch's "
                             "[batch, seq]), while the layer holds this rank's part of the tokens", _MASK_FIX)
            return out
        return func(*args, **kwargs)

    def _refuse(self, what: str, fix: str | None = None) -> None:
        module = _innermost_module(sys._getframe(2))
        where = f"{type(module).__name__} in layer {self.layer!r}" if module is not None else f"layer {self.layer!r}"
        raise ValueError(
            f"context_parallel(axis={self.axis!r}): {where} {what} outside the attentions it splits, on this "
            "rank's part of the sequence only: it would mix the part's positions alone and train another model "
            "without an error. " + (fix or _ATTENTION_FIX)
        )


_ATTENTION_FIX = (
    "context_parallel splits TinyGPT's CausalSelfAttention, Hugging Face's Llama-shaped attentions on sdpa, GPT-2's, "
    "and transformers attentions that call the AttentionInterface (inside its attention function only); rewrite an "
    "attention to call ring_attention / ulysses_attention, or leave context_parallel out"
)
_MASK_FIX = (
    "Only transformers' mask making and the attentions may read it: leave context_parallel out for this model "
    "(ESM's embeddings multiply by the mask)"
)
# A running sum or product over the sequence counts only the rank's part (each part would restart it).
_SCANS = frozenset({"cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin", "logcumsumexp"})
_SCAN_FIX = (
    "Give the batch the position ids the model would compute (a dict batch with 'position_ids', made on the whole "
    "sequence before the step), if the model then skips its own count, or leave context_parallel out"
)


def _caller() -> str:
    """The module of the code that issued the op: past torch's own frames and the modes' dispatch (another
    transform's watch may run between)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name.split(".")[0] != "torch" and name != __name__ and frame.f_code.co_name != "__torch_function__":
            return name
        frame = frame.f_back
    return ""


def _making_a_mask() -> bool:
    """Whether the op is transformers' mask making (``masking_utils``: packed sequences found by a cumsum over
    the position ids): context_parallel puts the mask of the whole sequence in the place of the mask the layer
    makes from its part, so what that computes there is never read."""
    return _caller().startswith("transformers.masking_utils")


def _scanned_dim_is_the_sequence(x: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any], local: int) -> bool:
    """Whether a scan's dim is one of the part's length: not a leading (batch) dim of a tensor of several dims."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(dim, int) or x.dim() == 0:
        return False
    dim %= x.dim()
    return x.shape[dim] == local and (dim > 0 or x.dim() == 1)


def _innermost_module(frame: FrameType | None) -> nn.Module | None:
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module):
            return obj
        frame = frame.f_back
    return None
