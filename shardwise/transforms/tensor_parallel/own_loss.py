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
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn


def refuse_own_loss(module: nn.Module, axis: str, heads: tuple[str, ...]) -> None:
    """Make ``module`` (a copy of the layer's module, whose ``heads`` leave the logits split over
    ``axis``) refuse a call in which it would compute its own loss: a Hugging Face model's. Another
    model's ``labels`` argument may mean anything, and its own loss is its author's to write."""
    if not _is_hugging_face(module):
        return
    guard = _OwnLossGuard(axis, heads)
    module.register_forward_pre_hook(guard.before, with_kwargs=True)
    module.register_forward_hook(guard.after)


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
        heads = ", ".join(repr(h) for h in self.heads)
        return (
            f"tensor_parallel: {what}, on the logits that Colwise(output='sharded') on {heads} leaves split over "
            f"{self.axis!r} (the ready plans' vocab_parallel=True): each rank holds a slice of the vocabulary, so "
            "that loss would be each rank's part, not the whole. Compute the loss in loss_fn from the logits "
            "instead: leave `labels` out of the batch's inputs, give the token ids as the targets, and use "
            "loss_fn = lambda out, ids: sw.tp.vocab_parallel_cross_entropy(out.logits[:, :-1], ids[:, 1:]) "
            "(the model's own shift: each position predicts the next token; plain cross-entropy on one device); "
            "or gather the logits with the plan's vocab_parallel=False (e.g. sw.tp.gpt2_plan(vocab_parallel=False): "
            "the head's Colwise(output='replicated')), and the model's own loss is right"
        )
