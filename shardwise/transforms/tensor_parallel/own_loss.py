"""Refusing a model that computes its own loss on the logits a head leaves split over the vocabulary.

With the head's logits left split (``Colwise(output="sharded")``, the ready plans'
``vocab_parallel=True``), the cross-entropy has to be computed from the slices,
by ``vocab_parallel_cross_entropy`` in ``loss_fn`` (loss.py guards what reaches
``loss_fn``). A Hugging Face model given ``labels`` computes its loss itself,
inside its forward, right after the head: on one rank's slice of the vocabulary,
where loss.py's guard cannot see. That loss would be wrong (or fail in torch with
a shape error that names nothing of the cause), so every layer that calls the
whole model holding such a head (functionalize's ``embed``, the first layer, and
``head``) refuses it: before the model's forward, when it is given ``labels``
(``embed`` does, before anything computes); after it, when the model's output
carries a loss all the same (one made from other arguments). The check runs in
the Plan's prediction as in the step, so ``step.plan(mesh, params, batch)``
refuses it too.

Another model computing its loss in its forward (nanoGPT's ``F.cross_entropy(logits.view(-1,
logits.size(-1)), targets.view(-1))``) is watched instead (:class:`OwnLossWatch`, around a layer's
first call on each rank): the split logits are followed through reshapes, casts, slices and
arithmetic with numbers, and a cross-entropy (or NLL loss) on them is refused by name. Left to torch
it failed with a bare ``IndexError: Target 43 is out of bounds`` (a target outside the rank's slice),
or computed each rank's part of the loss.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

# The losses a model computes on its logits: refused on split ones.
_LOSSES = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
# What carries the logits on to such a loss, the vocabulary dim untouched (nanoGPT's view(-1, V), Hugging
# Face's float() and shift, a soft cap's tanh): followed. Anything else ends the watch there.
_CARRY = {
    Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten, Tensor.contiguous, Tensor.to,
    Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type, Tensor.clone, torch.clone,
    Tensor.__getitem__, Tensor.__mul__, Tensor.__rmul__, Tensor.__truediv__, Tensor.__add__, Tensor.__radd__,
    Tensor.__sub__, Tensor.mul, Tensor.div, torch.mul, torch.div, torch.tanh, Tensor.tanh,
}


def refuse_own_loss(module: nn.Module, axis: str, heads: tuple[str, ...]) -> None:
    """Make ``module`` (a copy of the layer's module, whose ``heads`` leave the logits split over
    ``axis``) refuse a call in which it would compute its own loss: a Hugging Face model's. Another
    model's ``labels`` argument may mean anything, and its own loss is its author's to write."""
    if not _is_hugging_face(module):
        return
    guard = _OwnLossGuard(axis, heads)
    module.register_forward_pre_hook(guard.before, with_kwargs=True)
    module.register_forward_hook(guard.after)


@dataclass(frozen=True)
class OwnLossCheck:
    """What a layer calling ``model`` (whose ``heads`` leave the logits split over ``axis``) watches for."""

    axis: str
    heads: tuple[str, ...]
    model: str  # its class's name, for errors
    hugging_face: bool  # the fix then names out.logits and labels

    @staticmethod
    def of(module: nn.Module, axis: str, heads: tuple[str, ...]) -> OwnLossCheck:
        return OwnLossCheck(axis, heads, type(module).__name__, _is_hugging_face(module))

    def watch(self) -> OwnLossWatch:
        return OwnLossWatch(self)


class OwnLossWatch(TorchFunctionMode):
    """Refuses a cross-entropy on the logits a head of ``check.heads`` left split (see the module docstring)."""

    def __init__(self, check: OwnLossCheck) -> None:
        super().__init__()
        self.check, self.heads = check, check.heads
        self.watched: dict[int, weakref.ref[Tensor]] = {}

    def watch(self, logits: Tensor) -> None:
        self.watched[id(logits)] = weakref.ref(logits)

    def _holds(self, t: Any) -> bool:
        ref = self.watched.get(id(t)) if isinstance(t, Tensor) else None
        return ref is not None and ref() is t

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        loss = _LOSSES.get(func)
        if loss is not None and any(self._holds(a) for a in (*args, *kwargs.values())):
            c = self.check
            raise ValueError(_refusal(
                c.axis, c.heads, f"{c.model} computes {loss} in its forward", _HF_FIX if c.hugging_face else
                "compute it in loss_fn instead, from the logits the model returns (its forward given no "
                "targets): sw.tp.vocab_parallel_cross_entropy(logits, targets) there, shifted as the model shifts "
                "them, is plain cross-entropy on one device; or gather the head's output (its "
                "Colwise(output='replicated'), the ready plans' vocab_parallel=False), and the model's own loss is "
                "right",
            ))
        out = func(*args, **kwargs)
        if func in _CARRY and args and self._holds(args[0]) and isinstance(out, Tensor):
            self.watch(out)
        return out


def _is_hugging_face(obj: Any) -> bool:
    """Whether ``obj`` is a transformers model or model output (by its classes' names: shardwise does
    not import transformers)."""
    return any(c.__name__ in ("PreTrainedModel", "ModelOutput") for c in type(obj).__mro__)


class _OwnLossGuard:
    """The hooks (a plain object: it pickles and deep-copies with the module, as TPForward does)."""

    def __init__(self, axis: str, heads: tuple[str, ...]) -> None:
        self.axis, self.heads = axis, heads

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        labels = kwargs.get("labels")
        if labels is None and args:
            try:
                labels = inspect.signature(type(module).forward).bind_partial(module, *args).arguments.get("labels")
            except TypeError:
                labels = None
        if labels is not None:
            raise ValueError(self._refusal(f"{type(module).__name__} is given `labels`, so it computes its own loss"))

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(getattr(output, "loss", None), Tensor):
            raise ValueError(self._refusal(f"{type(module).__name__} returned a loss it computed itself"))

    def _refusal(self, what: str) -> str:
        return _refusal(self.axis, self.heads, what, _HF_FIX)


_HF_FIX = (
    "compute the loss in loss_fn from the logits instead: leave `labels` out of the batch's inputs, give "
    "the token ids as the targets, and use loss_fn = lambda out, ids: "
    "sw.tp.vocab_parallel_cross_entropy(out.logits[:, :-1], ids[:, 1:]) (the model's own shift: each "
    "position predicts the next token; plain cross-entropy on one device); or gather the logits with the "
    "plan's vocab_parallel=False (e.g. sw.tp.gpt2_plan(vocab_parallel=False): the head's "
    "Colwise(output='replicated')), and the model's own loss is right"
)


def _refusal(axis: str, heads: tuple[str, ...], what: str, fix: str) -> str:
    named = ", ".join(repr(h) for h in heads)
    return (
        f"tensor_parallel: {what}, on the logits that Colwise(output='sharded') on {named} leaves split over "
        f"{axis!r} (the ready plans' vocab_parallel=True): each rank holds a slice of the vocabulary, so that loss "
        f"would be each rank's part, not the whole. {fix[0].upper()}{fix[1:]}"
    )
