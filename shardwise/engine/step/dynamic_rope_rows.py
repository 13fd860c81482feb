"""Hugging Face dynamic RoPE on a batch the step cuts, whose rows reach different positions: refused.

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

Seen in the batch as the step is called (every rank holds the global batch: no collective): a tensor under a
``position_ids`` key, one max per share (the shares are runs of rows). Not seen: positions given otherwise (a
positional argument, another name), or computed by the model from its other inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives.mesh import Mesh
from ..model.rope_state import is_dynamic_rope
from ..model.whole_batch import called_modules
from .batch_cut import batch_multiple, cut_words

if TYPE_CHECKING:
    from ..layout.state_layout import StateLayout
    from .step import Step

_KEY = "position_ids"
_CACHED = "dynamic rope modules"  # the layout's cache: the chain's dynamic rotary embeddings, by path


def refuse_dynamic_rope_rows(step: Step, layout: StateLayout, mesh: Mesh | None, batch: Any) -> None:
    """Refuse a batch the step cuts into shares whose ``position_ids`` reach different largest positions, the
    batch reaching the original length of a dynamic rotary embedding of the model (see the module docstring)."""
    rope = layout.cache.get(_CACHED)  # (asked first: once per layout, so a step of another model pays nothing)
    if rope is None:  # (path, original length: below it no share grows, and each resets as one device does)
        rope = layout.cache[_CACHED] = [(path, getattr(m, "original_max_seq_len", None))
                                        for path, m in called_modules(step.base_chain) if is_dynamic_rope(m)]
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
        length = int(reached.max()) + 1
        if bool((reached == reached[0]).all()) or all(o is not None and length < o for _, o in rope):
            continue
        path, original = next((p, o) for p, o in rope if o is None or length >= o)
        raise ValueError(
            f"{path} is a dynamic rotary embedding (rope_type 'dynamic'), which sets its frequencies from the "
            f"largest position of the batch it is called on once that reaches its original length ({original}), "
            f"and the shares of batch{where} reach different largest positions ({sorted(set(reached.tolist()))[:6]}, "
            f"the batch {length - 1}): this step cuts the batch ({' x '.join(cuts)}), so each share would take its "
            "own where the single-device step takes the whole batch's, and scale (or reset) otherwise: another "
            "model, trained without an error. Give every share a row of the batch's largest position (pad on the "
            "right, with positions that go on counting), or use a rope type of fixed frequencies (default, linear, "
            "yarn, llama3), or train without cutting the batch"
        )


def _position_ids(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """(keypath, tensor) of each integer tensor of ``batch`` under a ``position_ids`` key."""
    paths, leaves, _ = optree.tree_flatten_with_path(batch)
    return [("".join(f"[{k!r}]" for k in path), t) for path, t in zip(paths, leaves, strict=True)
            if path and path[-1] == _KEY and isinstance(t, torch.Tensor) and not t.is_meta
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)]
