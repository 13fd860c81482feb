"""Hugging Face dynamic and longrope RoPE on a batch the step cuts, whose rows reach different positions: refused.

transformers' ``dynamic_rope_update`` (modeling_rope_utils.py) sets a rotary embedding's frequencies from
``position_ids.max() + 1`` over the batch it is called on: scaled once that length passes the original
one, reset below it (engine/model/rope_state.py keeps them as torch does). The single-device step takes the
max over the global batch; a step that cuts the rows (data parallel, accumulation, a pipeline's
micro-batches) takes it over each share. Where the rows reach different positions (left padding, packed
sequences: ``position_ids`` given per row), one share's max is another's: a rank scales where one device
does not, and the step trains another model without an error (Qwen3, ZeRO-3 over 2 ranks: 4.2e-6 to 1.7e-5
relative in the first step's loss, 2.4e-5 in float32 with left padding). Two cases decide the same on every
share as on one device, and pass: every share's rows reach the batch's largest position, and a batch shorter
than the embedding's original length (``original_max_seq_len``: then no share grows, and every share resets
where one device does: fine-tuning a long-context model on sequences shorter than its context).

Longrope (Phi-3 128k, Phi-3.5, Phi-4-mini) picks, on every call and keeping nothing, the long frequencies where
``position_ids.max() + 1`` passes ``original_max_position_embeddings`` and the short ones otherwise: a share
decides as one device does exactly where its largest position is on the same side of that length as the
batch's, and only a share on the other side is refused (Phi-3, ZeRO-3 over 2 ranks, one share's rows left-padded
below the length: 6.7e-6 relative in the first loss, float64).

Seen in the batch as the step is called (every rank holds the global batch: no collective): a tensor under a
``position_ids`` key, one max per share (the shares are runs of rows). Not seen: positions given otherwise (a
positional argument, another name), or computed by the model from its other inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives.mesh import Mesh
from ..model.rope_state import is_dynamic_rope, rewritten_each_call
from ..model.whole_batch import called_modules
from .batch_cut import batch_multiple, cut_words

if TYPE_CHECKING:
    from ..layout.state_layout import StateLayout
    from .step import Step

_KEY = "position_ids"
_CACHED = "length-dependent rope modules"  # the layout's cache: such rotary embeddings of the chain, by path


def refuse_dynamic_rope_rows(step: Step, layout: StateLayout, mesh: Mesh | None, batch: Any) -> None:
    """Refuse a batch the step cuts into shares whose ``position_ids`` reach different largest positions where a
    rotary embedding of the model picks its frequencies by that position (see the module docstring)."""
    rope = layout.cache.get(_CACHED)  # (asked first: once per layout, so a step of another model pays nothing)
    if rope is None:
        rope = layout.cache[_CACHED] = _length_dependent(step)
    if not rope:
        return
    positions = _position_ids(batch)
    cuts = cut_words(step, mesh) if positions else []
    if not cuts:
        return
    shares = batch_multiple(step, mesh)[0]
    for where, t in positions:
        if t.dim() < 2 or t.shape[0] < 2 or t.shape[0] % shares:
            continue  # (one row, or a batch the cut refuses itself)
        reached = t.reshape(shares, -1).amax(dim=1)  # each share's largest position (shares are runs of rows)
        if bool((reached == reached[0]).all()):
            continue
        length = int(reached.max()) + 1
        for path, kind, original in rope:
            if kind == "longrope":  # long frequencies past the original length, short ones up to it: call by call
                if original is None or all((int(r) + 1 > original) == (length > original) for r in reached):
                    continue
                decides = ("picks long or short frequencies by whether the largest position of the batch it is "
                           f"called on passes its original length ({original})")
            else:  # dynamic: grows past the cached length, resets below the original one, kept from call to call
                if original is not None and length < original:
                    continue
                decides = ("sets its frequencies from the largest position of the batch it is called on once "
                           f"that reaches its original length ({original})")
            raise ValueError(
                f"{path} is a rotary embedding of rope_type {kind!r}, which {decides}, and the shares of "
                f"batch{where} reach different largest positions ({sorted(set(reached.tolist()))[:6]}, the batch "
                f"{length - 1}): this step cuts the batch ({' x '.join(cuts)}), so each share would take its own "
                "where the single-device step takes the whole batch's, and rotate by other frequencies: another "
                "model, trained without an error. Give every share a row of the batch's largest position (pad on "
                "the right, with positions that go on counting), or use a rope type of fixed frequencies "
                "(default, linear, yarn, llama3), or train without cutting the batch"
            )


def _length_dependent(step: Step) -> list[tuple[str, str, int | None]]:
    """(path, rope type, original length) of each rotary embedding of the chain whose frequencies follow the
    largest position of a call: dynamic (its ``original_max_seq_len``: below it no share grows, and each resets
    as one device does) and longrope (the ``original_max_position_embeddings`` it compares with)."""
    found: list[tuple[str, str, int | None]] = []
    for path, m in called_modules(step.base_chain):
        if is_dynamic_rope(m):
            found.append((path, "dynamic", getattr(m, "original_max_seq_len", None)))
        elif rewritten_each_call(m):
            found.append((path, "longrope", _longrope_original(m)))
    return found


def _longrope_original(module: Any) -> int | None:
    """The original length a longrope embedding compares a call's positions with (``longrope_frequency_update``:
    ``config.rope_parameters[...]["original_max_position_embeddings"]``, per layer type where it has several)."""
    parameters = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
    kinds = module.rope_type if isinstance(module.rope_type, dict) else None
    entries = [parameters.get(t, {}) for t, k in kinds.items() if k == "longrope"] if kinds else [parameters]
    lengths = {e.get("original_max_position_embeddings") for e in entries if isinstance(e, dict)}
    return lengths.pop() if len(lengths) == 1 and isinstance(next(iter(lengths)), int) else None


def _position_ids(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """(keypath, tensor) of each integer tensor of ``batch`` under a ``position_ids`` key."""
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    return [("".join(f"[{k!r}]" for k in path), t) for path, t in zip(paths, leaves, strict=True)
            if path and path[-1] == _KEY and isinstance(t, torch.Tensor) and not t.is_meta
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)]
