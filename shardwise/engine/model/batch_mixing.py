"""A module known to compute each token's output from other rows of the batch it is called on.

Transformers' Doge mixture of experts (``DogeCDMoE``, ``DogeConfig(is_moe=True)``) views its router's
logits, shaped ``(batch, seq, 2 * keys)``, as ``(2, batch * seq, keys)``: the first half of the batch's
tokens give every token's x-keys and the second half its y-keys (transformers says so in a comment, and
keeps it for its checkpoints). A token's expert choice reads a token of another row, so a step that
calls the model on a part of the batch (a data-parallel share, a micro-batch, a part of the sequence)
routes every token differently than the single-device step: another model, trained without an error
(a tiny Doge: the logits of a batch's halves differ from the whole batch's by 0.18). A tracer cannot
tell such a reshape from a harmless one in general, so the known modules are named here, with why.
"""

from __future__ import annotations

from torch import nn

# transformers class name -> how it mixes the batch's rows, in words for the refusal.
_KNOWN = {
    "DogeCDMoE": "its router's logits are viewed as (2, batch * seq, keys), so each token is routed with the "
    "logits of a token of another row (the first half of the batch's tokens pairs with the second); Doge with "
    "is_moe=False routes each token alone",
}

# The time-series models' mean scalers (TimeSeriesTransformer, Informer, Autoformer, PatchTST, PatchTSMixer, under
# their default scaling="mean"): a series with no observed value in its context gets the batch's mean scale
# (``batch_sum = ts_sum.sum(dim=0)``), a statistic over the rows as BatchNorm's, unless the config sets
# ``default_scale`` (the review: TimeSeriesTransformerForPrediction 4.3e-4 off under ZeRO-3, 2e-3 under
# accumulation, without an error).
_MEAN_SCALERS = frozenset({"TimeSeriesMeanScaler", "InformerMeanScaler", "AutoformerMeanScaler",
                           "PatchTSTMeanScaler", "PatchTSMixerMeanScaler"})
_MEAN_SCALE = ("a series with no observed value in its context gets the mean scale of the whole batch (a statistic "
               "over the rows, as BatchNorm's): set config.default_scale (the scale such a series gets) before "
               "building the model, or use scaling='std' or None")


def mixes_rows(module: nn.Module) -> str | None:
    """How ``module`` itself (not its children) mixes the rows of its batch, when it is one of the known
    transformers modules that do; None otherwise (a class of the same name outside transformers too)."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    if cls.__name__ in _MEAN_SCALERS:
        return _MEAN_SCALE if getattr(module, "default_scale", None) is None else None
    return _KNOWN.get(cls.__name__)
