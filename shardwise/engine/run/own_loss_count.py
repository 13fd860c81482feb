"""The count a Hugging Face model's own loss averages over, and a count function that counts otherwise.

``train_step(tokens=count_fn)`` weighs each part's loss by what ``count_fn(inputs, targets)`` counts in it. Where
``loss_fn`` returns the model's own loss (``out.loss``: a mean over the labels it counts), the count must be the
model's: a causal LM shifts its labels (the first of each row counts nothing), an encoder-decoder, a masked LM or a
token classifier counts every label. The loss probe cannot see a scalar the model computed (halving the output
leaves it as it was), so a count of the unshifted labels for a causal LM passed, and trained on parts weighed by
one label too many in each row (the finetune review: 1.3e-4 in the loss, Llama under ZeRO-3 with padded rows).
Here the first micro-batch's count is compared with the model's own, where ``loss_fn`` returns that loss as it is:
which labels it counts is read off the batch (the cross-entropy of the logits over the labels, shifted or not,
that equals the model's loss), not guessed from the class's name (XLNet's ``LMHeadModel`` does not shift).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SHIFTED = "(inputs['labels'][:, 1:] != -100).sum()"
EVERY = "(inputs['labels'] != -100).sum()"


@dataclass(frozen=True)
class OwnCount:
    """What ``model`` (its class's name)'s own loss counts: its labels shifted (a causal LM) or every one."""

    model: str
    shifted: bool

    @property
    def expression(self) -> str:
        return SHIFTED if self.shifted else EVERY

    def count(self, inputs: Any) -> int | None:
        """The model's own count in ``inputs`` (a batch dict with ``labels``), or None where it holds none."""
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
            return None
        return int(((labels[:, 1:] if self.shifted else labels) != -100).sum())


def own_count_of(modules: Iterable[nn.Module]) -> OwnCount | CtcHead | None:
    """The own loss's count of the outermost transformers model among ``modules``; a CTC head (no count: its loss
    is per row); None where no model is known."""
    models = [m for m in modules if hasattr(m, "config") and hasattr(m, "loss_type")]
    if not models:
        return None
    model = models[0]  # the outermost: the one whose loss the output carries
    name, kind = type(model).__name__, getattr(model, "loss_type", None)
    if name.endswith("ForCTC"):
        return CtcHead(name)
    if getattr(model.config, "is_encoder_decoder", False) or kind in ("ForMaskedLM", "ForTokenClassification") \
            or name.endswith(("ForMaskedLM", "ForTokenClassification")):
        return OwnCount(name, shifted=False)
    if name.startswith(_UNSHIFTED_LM_HEADS):
        return OwnCount(name, shifted=False)
    if kind in ("ForCausalLM", "ForConditionalGeneration") or name.endswith(("ForCausalLM", "LMHeadModel")):
        return OwnCount(name, shifted=True)
    return None


# LM heads whose own loss is a cross-entropy over every label, unshifted (checked against their loss); other
# ``*LMHeadModel`` classes (GPT-2's, OpenAI GPT's, CTRL's) shift theirs. Only words: the check reads the batch.
_UNSHIFTED_LM_HEADS = ("XLNetLMHeadModel", "XLMWithLMHeadModel", "FlaubertWithLMHeadModel")


@dataclass(frozen=True)
class CtcHead:
    """A CTC head: its own loss is no mean over a count of labels."""

    model: str


def counted_by_own_loss(output: Any, model_loss: torch.Tensor, inputs: Any) -> OwnCount | None:
    """What the model's own loss counts, read off the batch: a cross-entropy of the output's ``logits`` over
    ``inputs['labels']``, shifted (a causal LM) or not, whichever equals the model's loss; None where neither does
    (a loss of another kind, logits of other positions than the labels: nothing is known)."""
    logits = output.get("logits") if isinstance(output, Mapping) else None
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor) or labels.dim() != 2 \
            or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(labels.shape) or labels.dtype.is_floating_point:
        return None
    want = float(model_loss.detach().double())
    found = []
    with torch.no_grad():
        for shifted, (x, y) in ((True, (logits[:, :-1], labels[:, 1:])), (False, (logits, labels))):
            if not bool((y != -100).any()):
                continue
            value = float(F.cross_entropy(x.detach().double().flatten(0, 1), y.flatten(), ignore_index=-100))
            if abs(value - want) <= 1e-3 * abs(want):
                found.append(shifted)
    return OwnCount("the model", found[0]) if len(found) == 1 else None


def refuse_another_count(model: str | None, loss_fn: Callable[[Any, Any], Any], count_fn: Callable[[Any, Any], Any],
                         output: Any, model_loss: torch.Tensor, inputs: Any, targets: Any) -> None:
    """Refuse ``count_fn`` where ``loss_fn`` returns the model's own loss as it is and counts otherwise than it."""
    own = counted_by_own_loss(output, model_loss, inputs)
    if own is None:
        return
    want = own.count(inputs)
    if want is None:
        return
    with torch.no_grad():
        value = loss_fn(output, targets)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or \
                not torch.equal(value.detach().reshape(()), model_loss.detach().reshape(())):
            return  # a loss of one's own, or the model's with more: its count is the user's to say
        counted = count_fn(inputs, targets)
    got = int(counted) if isinstance(counted, (int, torch.Tensor)) and torch.as_tensor(counted).numel() == 1 else None
    if got is None or got == want:
        return
    name = f"{model}'s" if model else "the model's"
    raise ValueError(
        f"train_step(tokens=count_fn) counts {got} tokens in this micro-batch, but loss_fn returns {name} own "
        f"loss, a mean over {want} ({own.expression}{': it shifts its labels' if own.shifted else ''}): the step "
        "would weigh each part's loss by another count than the one it averages over, and train another model "
        f"than one device. Count as the model does: tokens=lambda inputs, targets: {own.expression}"
    )
