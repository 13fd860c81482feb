"""A model whose loss adds a term of the whole batch it is called on: a Hugging Face mixture of experts
that adds its routers' load-balancing loss.

Mixtral, Qwen2-MoE and their kin, configured with ``output_router_logits=True`` and a nonzero
``router_aux_loss_coef``, add ``coef * aux`` to the ``loss`` they return, with ``aux`` computed over
the batch the model is called on. A step that calls it on a part of the batch (each data-parallel
or expert-parallel rank's share, each micro-batch of a pipeline or of accumulation, each part of a
context-parallel sequence) trains on the mean of the parts' aux losses. The aux loss is not linear
in the batch, so that is another loss than the single-device step's, and nothing would say so: the
difference is small (1e-4 of the loss on a tiny Mixtral) and every rank computes it alike.
:func:`batch_loss_coef` tells such a module (``whole_batch.py`` finds it in a chain), so that the step
can refuse it and point to ``sw.router_aux_loss``, which counts the aux loss over the whole batch.
Such a model split into units cannot compute its aux loss at all (:func:`refuse_split_batch_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fx_split import FunctionalizeError

# Hugging Face's config fields (Mixtral, Qwen2-MoE): the loss adds coef x the aux loss of the batch.
_ADDS, _COEF = "output_router_logits", "router_aux_loss_coef"


def batch_loss_coef(module: nn.Module) -> float:
    """The coefficient of the routers' aux loss that ``module``'s config adds to its loss
    (``output_router_logits=True``); 0 when it adds none."""
    config = getattr(module, "config", None)
    if getattr(config, _ADDS, False) is not True:
        return 0.0
    coef = getattr(config, _COEF, 0)
    return float(coef) if isinstance(coef, (int, float)) else 0.0


def own_loss_per_row_mean(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face CTC model whose own loss is the mean over the rows of each row's loss
    divided by its target length (``config.ctc_loss_reduction="mean"``): its padded labels (-100) count each row's
    targets within the row, so the shares' means of equal rows average to the whole batch's."""
    config = getattr(module, "config", None)
    return type(module).__name__.endswith("ForCTC") and getattr(config, "ctc_loss_reduction", None) == "mean"


@dataclass(frozen=True)
class MaskedMean:
    """What a Hugging Face model's own loss is a mean over: the elements equal to 1 of input ``key``, given input
    ``needs`` (without which it computes no loss), and with ``labelled`` only those whose label is not -100."""

    key: str
    needs: str | None = None
    labelled: bool = False

    def counted(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Per element of ``inputs[key]``: whether the loss counts it."""
        flags = inputs[self.key] == 1
        if self.labelled:
            flags = flags & (inputs["labels"].reshape(flags.shape) != -100)
        return flags

    def count_words(self) -> str:
        """The count function that weighs each share's mean by its count, in words."""
        if self.labelled:
            return f"((inputs[{self.key!r}] == 1) & (inputs['labels'] != -100)).sum()"
        return f"(inputs[{self.key!r}] == 1).sum()"


# What a Hugging Face model's own loss averages over, by the model's class name's end: masked image modeling
# (SimMIM: ViT, DeiT, Swin, BEiT) divides the masked pixels' loss by the masked count; ELECTRA's and Funnel's
# replaced-token detection is a mean over the tokens the attention mask keeps; a few token classifiers set the
# labels the attention mask leaves out to -100 (their ``active_loss``) and average over the rest.
_MASKED_MEAN = {
    "ForMaskedImageModeling": MaskedMean("bool_masked_pos"),
    **{name: MaskedMean("attention_mask", "labels") for name in ("ElectraForPreTraining", "FunnelForPreTraining")},
    **{name: MaskedMean("attention_mask", "labels", labelled=True) for name in (
        "BioGptForTokenClassification", "XLMRobertaXLForTokenClassification", "YosoForTokenClassification",
        "MraForTokenClassification")},
}


def own_loss_masked_by(module: nn.Module) -> MaskedMean | None:
    """What ``module``'s own loss is a mean over, where it is the mean over elements an input masks (a Hugging
    Face model of masked image modeling: ``bool_masked_pos``; ELECTRA: ``attention_mask``), or None."""
    name = type(module).__name__
    return next((mean for end, mean in _MASKED_MEAN.items() if name.endswith(end)), None)


# A Hugging Face pre-training model whose own loss, given both labels, adds the masked LM's mean over its labels
# (-100 left out) and a mean over the rows (next-sentence, sentence-order or sentence-image prediction): by class
# name, the rows' labels' key.
_TWO_MEANS = {
    **{name: "next_sentence_label" for name in (
        "BertForPreTraining", "ErnieForPreTraining", "FNetForPreTraining", "MobileBertForPreTraining",
        "MegatronBertForPreTraining")},
    "AlbertForPreTraining": "sentence_order_label",
    "VisualBertForPreTraining": "sentence_image_label",
}


def own_loss_two_means(module: nn.Module) -> str | None:
    """The key of the rows' labels where ``module``'s own loss adds a masked LM's mean over its tokens and a mean
    over the rows (BERT's pre-training: masked LM + next-sentence prediction), or None."""
    return _TWO_MEANS.get(type(module).__name__)


def own_loss_refused(module: nn.Module, counted: bool) -> tuple[str, str] | None:
    """Where ``module`` (itself, not its children) is a Hugging Face CTC model whose own loss a step that cuts the
    batch cannot take as it is: what the loss is and the fix, in words; None otherwise. ``counted``: the step weighs
    each part's loss by a count of tokens (``train_step(tokens=count_fn)``), else takes the parts' mean.

    ``config.ctc_loss_reduction="sum"`` (Wav2Vec2Config's default) sums over the rows: the parts' mean is not the
    sum. ``"mean"`` is the mean over the rows of each row's loss per target token: the parts' mean is that exactly,
    their weighing by counted tokens is not."""
    reduction = getattr(getattr(module, "config", None), "ctc_loss_reduction", None)
    if not type(module).__name__.endswith("ForCTC"):
        return None
    name = type(module).__name__
    if reduction == "sum":
        return (f"{name}'s own CTC loss sums over the rows (config.ctc_loss_reduction='sum')",
                "set config.ctc_loss_reduction = 'mean' before functionalize (the mean over the rows of each row's "
                "loss per target token, which a cut batch computes exactly with tokens=None)")
    if reduction == "mean" and counted:
        return (f"{name}'s own CTC loss is the mean over the rows of each row's loss per target token "
                "(config.ctc_loss_reduction='mean'), which train_step(tokens=count_fn) would weigh by the counted "
                "tokens of each part as if it were a mean over them",
                "pass train_step(tokens=None), under which a cut batch computes that loss exactly, padded labels "
                "(-100) or not")
    return None


def _adding_batch_loss(module: nn.Module) -> tuple[str, nn.Module, float] | None:
    """The first module (path, module, ``router_aux_loss_coef``) of ``module`` whose config has
    ``output_router_logits=True``; None when there is none."""
    for path, sub in module.named_modules():
        if getattr(getattr(sub, "config", None), _ADDS, False) is True:
            return path, sub, batch_loss_coef(sub)
    return None


def refuse_split_batch_loss(module: nn.Module) -> None:
    """Refuse to split into units a model that records its routers' logits inside its own forward."""
    found = _adding_batch_loss(module)
    if found is None:
        return
    path, sub, coef = found
    where = repr(path) if path else "the module itself"
    raise FunctionalizeError(
        f"functionalize: {where} ({type(sub).__name__}) has output_router_logits=True: its forward computes the "
        "routers' load-balancing loss from the logits each decoder layer records while the model's own forward "
        "calls it, but split into units the layers are called one by one and record nothing (transformers then "
        "fails with an IndexError). Set config.output_router_logits = False before functionalize and add the aux "
        f"loss with sw.router_aux_loss(step, {coef or 'coef'}), which counts it over the whole batch on every mesh"
    )


# Hugging Face models whose own loss leaves out the label frames padded with the float -100.0 (SpeechT5's
# spectrogram labels), by class name: elsewhere a float label of -100.0 is a value (a level floored at -100 dB).
_FLOAT_PADDED = frozenset({"SpeechT5ForTextToSpeech", "SpeechT5ForSpeechToSpeech"})


def own_loss_float_padded(module: nn.Module) -> bool:
    """Whether ``module``'s own loss leaves out float labels of -100.0 (padded spectrogram frames)."""
    return type(module).__name__ in _FLOAT_PADDED
