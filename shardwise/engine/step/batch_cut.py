"""How a step cuts the global batch into a rank's share, asked once for the run and for the Plan.

The global batch is cut over shard_params' axis, then by the split (``SplitRole.batch_cut``): over its
batch axes, then into parts of every sequence. Each share (and each part of a sequence) is a replica
of the mean: the loss is seeded by 1 / (their number). ``run_inputs.py`` takes the calling rank's
share, ``planning.py`` rank 0's (every rank's share has the same shapes): both through
:func:`rank_share`, so the Plan is made from what the run computes on.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives.mesh import Mesh
from ..model.batch_loss_terms import (
    MaskedMean,
    own_loss_float_padded,
    own_loss_masked_by,
    own_loss_per_row_mean,
    own_loss_two_means,
)
from ..model.whole_batch import called_modules
from ..plan.batches import split_batch, split_over
from ..plan.lower import microbatch_count
from ..run.loss_rows import ProbeCut
from ..run.own_loss_count import EVERY, SHIFTED, CtcHead, OwnCount, own_count_of
from ..stack.in_layer import BatchShares

if TYPE_CHECKING:
    from .step import Step

# train_step(tokens=PER_SHARD_MEAN): a mean loss per share of the batch, the mean of those means taken
# knowingly even where padding gives the shares different token counts (see refuse_padded_mean).
PER_SHARD_MEAN = "per_shard_mean"


def batch_cuts(step: Step, mesh: Mesh | None) -> list[tuple[str, int, str]]:
    """The axes the global batch is cut over, with their sizes and the words naming the cut:
    shard_params' (under HSDP its replicas' axis, then its shards'), then each split's batch axes (in the
    stack's order), each rank taking its share."""
    if mesh is None:
        return []
    zero = step.sharding_spec
    named = [] if zero is None else [(zero.axis, "shard_params")]
    if zero is not None and zero.replicate is not None:
        named.insert(0, (zero.replicate, "shard_params(replicate=...)"))
    named += [(a, part.name) for part in step.split.parts for a in part.batch_cut(mesh).axes]
    return [(a, mesh.axis_size(a), f"{who} over axis {a!r} of size {mesh.axis_size(a)}") for a, who in named]


def batch_multiple(step: Step, mesh: Mesh | None) -> tuple[int, str]:
    """What the global batch size must be a multiple of: it is cut per data-parallel rank (and per
    rank of a split that cuts the batch), then per micro-batch; and the words that say so."""
    k = microbatch_count(step)
    cuts = batch_cuts(step, mesh)
    ranks = math.prod(n for _, n, _ in cuts)
    if not cuts or (k == 1 and len(cuts) == 1):
        return ranks * k, ""
    words = " x ".join(f"{n} ranks of axis {a!r}" for a, n, _ in cuts)
    return ranks * k, f" ({words}{f' x {k} micro-batches' if k > 1 else ''})"


def rank_share(step: Step, mesh: Mesh | None, batch: Any, rank: int | None) -> tuple[tuple[Any, Any], int]:
    """(``rank``'s share of the global ``batch`` as an (inputs, targets) pair, the replicas of the mean
    it was cut into: 0 when not cut); ``rank`` None: the calling rank. Not yet cut into micro-batches."""
    pair = split_batch(batch)
    whole = batch_multiple(step, mesh)
    cuts = batch_cuts(step, mesh)
    for axis, n, what in cuts:
        assert mesh is not None
        index = mesh.axis_index(axis) if rank is None else mesh.coords_of(rank)[axis]
        pair = split_over(pair, n, index, what, whole)
    cut = step.split.batch_cut(mesh)
    pair = cut.sequence(pair, rank)
    replicas = math.prod(n for _, n, _ in cuts) * cut.sequence_parts if cuts or cut.sequence_parts > 1 else 0
    return pair, replicas


def batch_shares(step: Step, mesh: Mesh | None) -> BatchShares:
    """The axes whose indices hold different shares of the batch (the cuts above, then a split's
    sequence axis), and how many shares each micro-batch is cut into over them (the run seeds each
    micro-batch's loss by 1 / (that x the micro-batches))."""
    axes = [a for a, _, _ in batch_cuts(step, mesh)]
    if mesh is not None:
        axes += [p.axis for p in step.split.parts if p.batch_cut(mesh).sequence_parts > 1]
    shares = math.prod(mesh.axis_size(a) for a in axes) if mesh is not None and axes else 1
    return BatchShares(tuple(axes), shares)


def cut_words(step: Step, mesh: Mesh | None) -> list[str]:
    """Each cut of the global batch into the shares a compute sees, in words (``"shard_params over axis 'dp'
    of size 2"``, ``"2 micro-batches"``); empty where every compute sees the whole batch. An axis of size 1
    cuts nothing."""
    cuts = [what for _, n, what in batch_cuts(step, mesh) if n > 1]
    if mesh is not None:
        cuts += [f"{p.name} over axis {p.axis!r}" for p in step.split.parts if p.batch_cut(mesh).sequence_parts > 1]
    k = microbatch_count(step)
    if k > 1:
        cuts.append(f"{k} micro-batches")
    return cuts


def refuse_padded_mean(step: Step, mesh: Mesh | None, batch: Any) -> None:
    """Refuse a mean loss (``train_step(tokens=None)``) on a batch the step cuts (data parallel, context
    parallel, expert parallel, micro-batches) whose integer tensors hold a negative value: padded labels
    (-100, cross_entropy's ignore_index), so the shares' means count different numbers of tokens and
    their mean is not the mean over the global batch, which the single-device step computes.

    Only where labels can be (:func:`_label_tensors`): an (inputs, targets) batch's targets, so a negative
    integer input (a relative offset, a categorical feature) is no padding. Every rank holds the global
    batch and finds the same: no collective, one small reduction per integer tensor. An ignore value
    that is not negative (a pad token id) is not seen. Not refused: the ``labels`` of a Hugging Face CTC model
    whose own loss is the mean over the rows of each row's per-target-token loss (``ctc_loss_reduction="mean"``).
    """
    cuts = cut_words(step, mesh)
    if not cuts:
        return
    if _refuse_two_means(step, mesh, batch, cuts) or step.tokens is not None:
        return
    _refuse_uneven_masked_mean(step, mesh, batch, cuts)
    floats = _own_losses(step.base_chain).float_padded
    found = next(((prefix + where, t) for prefix, scanned in _label_tensors(batch).items()
                  if (hit := _negative_integers(scanned, prefix, floats)) is not None for where, t in (hit,)), None)
    if found is None:
        return
    where, padded = found
    if where in ("['labels']", "[0]['labels']") and \
            any(own_loss_per_row_mean(m) for _, m in called_modules(step.base_chain)):
        return  # the labels a CTC model's own loss reads: a mean over the rows of per-row terms, padded or not
    pad = -100 if where.endswith(_FLOAT) else int(padded[padded < 0].reshape(-1)[0])
    held = ("-100.0 (padded float labels, as SpeechT5's spectrograms: the model's own loss leaves them out)"
            if where.endswith(_FLOAT) else f"negative integers ({pad}: padded labels, as cross_entropy's ignore_index "
            "-100 or nanoGPT's -1)")
    where = where.removesuffix(_FLOAT)
    raise ValueError(
        f"train_step(tokens=None) on a batch the step cuts ({' x '.join(cuts)}): batch{where} holds {held}, "
        "so each share's mean loss counts its own "
        "number of tokens and the mean of those means is not the single-device step's mean over the whole "
        "batch. Pass tokens= to train_step: a count function, e.g. tokens=lambda inputs, targets: "
        f"(targets != {pad}).sum() ({_own_loss_count(step, pad)}), "
        "with loss_fn the mean over those tokens; or tokens='sum' with loss_fn returning (sum of the token "
        f"losses, token count); or tokens={PER_SHARD_MEAN!r} to train on the mean of the shares' means knowingly"
    )


def _refuse_uneven_masked_mean(step: Step, mesh: Mesh | None, batch: Any, cuts: list[str]) -> None:
    """Refuse a batch whose shares mask different numbers of elements where the model's own loss is the mean over
    the masked ones (batch_loss_terms.own_loss_masked_by: SimMIM's ``bool_masked_pos``): each share's mean counts
    its own, and their mean is not the whole batch's (ViTForMaskedImageModeling under ZeRO-3 dp 2: 6.2e-4 in the
    loss, 0.67 of the update, no error). Looked for only where the batch's inputs hold such a key."""
    inputs = _model_inputs(batch)
    if inputs is None:
        return
    present = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_meta]
    if not present or not any(k in ("bool_masked_pos", "attention_mask") for k in present):
        return
    mean = next((found for found in _own_losses(step.base_chain).masked
                 if found.key in present and (found.needs is None or found.needs in inputs)), None)
    if mean is None:
        return
    counts = _share_counts(step, mesh, mean.counted(inputs))
    if counts is None:
        return
    raise ValueError(
        f"train_step(tokens=None) on a batch the step cuts ({' x '.join(cuts)}): the model's own loss is the mean "
        f"over the elements batch[{mean.key!r}] keeps{' with labels other than -100' if mean.labelled else ''}, and "
        f"the shares count different numbers of them ({_in_order(counts)}), so the mean of the shares' means "
        "is not the single-device step's mean over the whole batch. Pass train_step(tokens=lambda inputs, targets: "
        f"{mean.count_words()}), which weighs each share's mean by its count; or mask the same number in every "
        f"share (a fixed mask ratio per row); or tokens={PER_SHARD_MEAN!r} to train on the mean of the shares' means "
        "knowingly"
    )


@dataclass(frozen=True)
class _OwnLosses:
    """What the modules a chain calls say of their own losses (by class: batch_loss_terms.py), read once per chain:
    the step asks on every call, and a walk of a large model's modules costs more than the rest of the asking."""

    masked: tuple[MaskedMean, ...]  # own losses that are means over what an input masks
    two_means: tuple[tuple[str, str], ...]  # (class name, rows' labels key): BERT-style pre-training's two means
    float_padded: bool  # an own loss that leaves out float labels of -100.0 (SpeechT5)


_OWN_LOSSES: weakref.WeakKeyDictionary[Any, _OwnLosses] = weakref.WeakKeyDictionary()


def _own_losses(chain: Any) -> _OwnLosses:
    found = _OWN_LOSSES.get(chain)
    if found is None:
        modules = [m for _, m in called_modules(chain)]
        found = _OWN_LOSSES[chain] = _OwnLosses(
            tuple(mean for m in modules if (mean := own_loss_masked_by(m)) is not None),
            tuple((type(m).__name__, key) for m in modules if (key := own_loss_two_means(m)) is not None),
            any(own_loss_float_padded(m) for m in modules),
        )
    return found


def _refuse_two_means(step: Step, mesh: Mesh | None, batch: Any, cuts: list[str]) -> bool:
    """Refuse a cut batch where the model's own loss adds a masked LM's mean over its labels and a mean over the
    rows (BertForPreTraining: next-sentence prediction), unless each share counts as many masked tokens under
    tokens=None: a count function weighs the rows' mean by each share's masked tokens, and with uneven counts the
    shares' masked LM means average to another loss (BertForPreTraining under ZeRO-3 dp 2 with the count the
    padded-labels refusal advised: 2.9e-2 in the loss, no error). True where such a loss on even shares trains
    under tokens=None as it is (its padded labels are no reason to refuse)."""
    inputs = _model_inputs(batch)
    if inputs is None or not isinstance(inputs.get("labels"), torch.Tensor):
        return False
    found = next(((model, key) for model, key in _own_losses(step.base_chain).two_means if key in inputs), None)
    if found is None or step.tokens == PER_SHARD_MEAN:
        return False
    model, rows = found
    if step.tokens is None:
        counts = _share_counts(step, mesh, inputs["labels"] != -100)
        if counts is None:
            return True
        why = (f"the shares count different numbers of masked tokens ({_in_order(counts)}), so the mean of "
               "their masked LM means is not the whole batch's")
    else:
        why = ("train_step(tokens=...) weighs each share's loss by its count, and the mean over the rows would be "
               "weighed so too")
    raise ValueError(
        f"{model}'s own loss on a batch the step cuts ({' x '.join(cuts)}) adds the masked LM's mean over the "
        f"labels other than -100 and the mean over the rows of batch[{rows!r}]'s prediction: two means of "
        f"different counts, which no one count weighs right, and {why}. Mask the same number of tokens in every "
        "row (a fixed count per row) and pass train_step(tokens=None), under which the shares' means average to "
        f"the single-device step's loss; or tokens={PER_SHARD_MEAN!r} to train on the mean of the shares' losses "
        "knowingly"
    )


def _in_order(counts: list[int]) -> str:
    """Each share's count, in the order of the shares (the first rank's first micro-batch first), in words."""
    shown = ", ".join(map(str, counts[:8])) + (f", ... ({len(counts)} shares)" if len(counts) > 8 else "")
    return f"per share, in order: {shown}"


def _model_inputs(batch: Any) -> Mapping[str, Any] | None:
    """The dict a Hugging Face model is called with: an (inputs, targets) pair's inputs, or the batch itself."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
    return inputs if isinstance(inputs, Mapping) else None


def _share_counts(step: Step, mesh: Mesh | None, flags: torch.Tensor) -> list[int] | None:
    """Each share's count of ``flags`` (per element of a batch tensor), where the shares' counts differ; None
    where they agree (or the batch does not divide: the cut refuses it itself)."""
    shares = batch_multiple(step, mesh)[0]
    if flags.dim() == 0 or flags.shape[0] % shares:
        return None
    counts = flags.reshape(shares, -1).sum(dim=1)
    return None if bool((counts == counts[0]).all()) else [int(c) for c in counts.tolist()]


def _own_loss_count(step: Step, pad: int = -100) -> str:
    """The count of labels a Hugging Face model's own loss averages over, in words (``pad``: the padding found, which
    transformers' loss leaves out only as -100): a causal LM (and a decoder-only ``*ForConditionalGeneration``,
    LLaVA's: transformers' causal-LM loss) shifts its labels, the first of each row counting nothing; an
    encoder-decoder, a masked LM or a token classifier counts all; a CTC head is no count."""
    shifted, every = (SHIFTED, EVERY) if pad == -100 else (
        SHIFTED.replace("-100", str(pad)), EVERY.replace("-100", str(pad)))
    either = (f"a Hugging Face model's own loss: {shifted} for a causal LM, which shifts its labels, {every} for an "
              "encoder-decoder, a masked LM or a token classifier")
    masked = next((found for found in _own_losses(step.base_chain).masked if found.labelled), None)
    if masked is not None:  # a token classifier leaving out the labels its attention mask leaves out
        counted = masked.count_words().replace("-100", str(pad))
        return f"its own loss counts the labels its attention mask keeps: {counted}"
    own = own_count_of(m for _, m in called_modules(step.base_chain))
    if isinstance(own, CtcHead):
        return (f"not for {own.model}'s own CTC loss: set config.ctc_loss_reduction = 'mean' before functionalize, "
                "and its padded labels train with tokens=None")
    if isinstance(own, OwnCount):
        return (f"{own.model}'s own loss, which shifts its labels: {shifted}" if own.shifted else
                f"{own.model}'s own loss, which counts every label it is given: {every}")
    return either


def loss_probe_cut(step: Step, mesh: Mesh | None) -> ProbeCut | None:
    """What cuts the batch, in words, where the step's first call probes that ``loss_fn`` keeps its
    contract over what the step cuts (``engine/run/loss_rows.py``): its rows (shard_params' shares, a
    split's batch axes, micro-batches), and each sequence (a split's sequence parts: context parallel),
    along the dim the split cuts. With ``tokens=None`` a mean; with ``tokens="sum"`` a (sum, count) pair
    that adds up over the parts; with a count function the mean over the tokens it counts. None where it
    does not probe: the step cuts nothing; ``tokens="per_shard_mean"`` (the step takes the parts' means
    knowingly); a loss term of the whole batch sums its statistics over the parts (router_aux_loss: the
    probe would issue collectives); a loss_fn that torch.compile made (it would compile again for each of
    the probe's shapes). Under a split the probe runs too: it evaluates the loss where no collective may
    run (a split's loss functions compute on the rank's own part there, or raise: then it says nothing)."""
    batch_loss = any(getattr(s, "adds_batch_loss", False) for s in step.transforms)
    compiled = hasattr(step.loss_fn, "_torchdynamo_orig_callable")
    per_shard_mean = isinstance(step.tokens, str) and step.tokens == PER_SHARD_MEAN
    if per_shard_mean or batch_loss or compiled:
        return None
    rows = [what for _, n, what in batch_cuts(step, mesh) if n > 1]
    k = microbatch_count(step)
    if k > 1:
        rows.append(f"{k} micro-batches")
    sequences = [] if mesh is None else [
        f"{p.name} over axis {p.axis!r} of size {mesh.axis_size(p.axis)}" for p in step.split.parts
        if p.batch_cut(mesh).sequence_parts > 1
    ]
    if not rows and not sequences:
        return None
    dim = step.split.batch_cut(mesh).sequence_dim if sequences else 1
    return ProbeCut(" x ".join(rows) or None, " x ".join(sequences) or None, dim, step.tokens)


def _label_tensors(batch: Any) -> dict[str, Any]:
    """Where ``batch``'s labels can be, by the keypath prefix that names each place in ``batch``: an
    (inputs, targets) pair's targets (loss_fn takes the labels from there; the inputs' integers are
    features), and its inputs' entries named as labels (``labels``, ``targets``, ``start_label``: a
    model computing its own loss reads them, whatever the targets are); else the whole batch (a dict
    batch, or targets None: the model's own loss reads ``labels``, or nanoGPT's ``targets``)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and batch[1] is not None:
        inputs = batch[0]
        named = {} if not isinstance(inputs, Mapping) else {
            f"[0][{key!r}]": value for key, value in inputs.items()
            if isinstance(key, str) and ("label" in key.lower() or "target" in key.lower())
        }
        return {"[1]": batch[1], **named}
    return {"": batch}


_FLOAT = " (float)"  # the mark _negative_integers puts after the keypath of float labels padded with -100.0


def _negative_integers(batch: Any, prefix: str = "", floats: bool = False) -> tuple[str, torch.Tensor] | None:
    """The keypath (``[0]``, ``['labels']``) of the first integer tensor of ``batch`` holding a negative
    value, or with ``floats`` (a model whose own loss leaves them out: SpeechT5) of a float tensor named as labels (in
    ``batch``, or by its ``prefix``) holding -100.0 (padded spectrogram frames; marked with :data:`_FLOAT`): one
    reduction per such tensor, read back once per device (a GPU batch costs one sync); with the tensor."""
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    found: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for path, t in zip(paths, leaves, strict=True):
        if not isinstance(t, torch.Tensor) or t.is_meta or t.numel() == 0 or t.dtype.is_complex or \
                t.dtype == torch.bool:
            continue
        where = "".join(f"[{k!r}]" for k in path)
        if t.dtype.is_floating_point:
            if floats and "label" in (prefix + where).lower():
                found.setdefault(t.device, []).append((where + _FLOAT, t, (t == -100).any()))
            continue
        found.setdefault(t.device, []).append((where, t, (t < 0).any()))
    for flagged in found.values():
        flags = torch.stack([f for _, _, f in flagged]).tolist()
        for (where, t, _), negative in zip(flagged, flags, strict=True):
            if negative:
                return where, t
    return None
