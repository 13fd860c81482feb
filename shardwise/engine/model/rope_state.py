"""Hugging Face dynamic RoPE's frequencies, kept from call to call as torch keeps them.

transformers' ``dynamic_rope_update`` (modeling_rope_utils.py) rebinds a rotary embedding's
``inv_freq`` buffer when a batch is longer than ``max_seq_len_cached`` (growth: frequencies for the
new length) or shorter than the original length after a growth (reset: ``original_inv_freq``), and
sets ``max_seq_len_cached`` (a Python attribute, which the layer's copy of the module keeps). In
torch the rebound buffer persists too, and a later call that neither grows nor resets reads it. A
layer hands its buffers in anew on every call (:class:`~shardwise.engine.model.module_call.ModuleCall`),
which would read the captured ``inv_freq`` there instead. So the rebound tensor is kept in the module
copy itself (beside ``max_seq_len_cached``: a thread's or process's copy of the module carries both)
and swapped in on the module's later calls in place of the handed-in one.

Each rank's copy sees the lengths one device sees (data, tensor and expert parallel and accumulation
cut rows, not the sequence), and a recompute under remat reads what its first run left, which gives
the first run's frequencies again (after a growth to L, L neither grows nor resets; after a reset, a
short length does neither). Context parallel, where a rank sees its part's positions, refuses
dynamic RoPE (context_parallel/attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

# The module's own attribute holding {buffer name: the tensor its forward last bound there}.
KEPT = "_shardwise_rope_kept"

# (the rotary module, its _buffers dict, the buffer's name, its key in the tensors a call hands in)
RopeSlot = tuple[nn.Module, dict[str, Any], str, str]


def is_dynamic_rope(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face rotary embedding with dynamic RoPE (``rope_type`` ``dynamic``,
    per layer type a dict of them)."""
    return "dynamic" in str(getattr(module, "rope_type", "")) and hasattr(module, "max_seq_len_cached")


def rewritten_each_call(module: nn.Module) -> list[str]:
    """The buffers a Hugging Face longrope rotary embedding overwrites on every call before reading them.

    transformers' ``longrope_frequency_update`` copies into ``inv_freq`` (per layer type,
    ``{type}_inv_freq``) the long or the short frequencies, picked by this call's largest position, before
    the forward reads it: nothing carries from one call to the next. A layer hands the same buffer tensor
    to every call (every rank's, on the threads backend), which that in-place copy would write into; a
    call writes into a copy of its own instead (module_call.py)."""
    kind = getattr(module, "rope_type", None)
    if isinstance(kind, dict):
        names = [f"{layer_type}_inv_freq" for layer_type, k in kind.items() if k == "longrope"]
    else:
        names = ["inv_freq"] if kind == "longrope" else []
    return [n for n in names if isinstance(module._buffers.get(n), Tensor)]


def swap_in_kept(slots: Sequence[RopeSlot]) -> None:
    """Put each kept ``inv_freq`` in its slot, over the handed-in tensor just swapped there."""
    for owner, container, attr, _ in slots:
        kept = owner.__dict__.get(KEPT)
        if kept is not None and attr in kept:
            container[attr] = kept[attr]


def keep_rebound(slots: Sequence[RopeSlot], tensors: dict[str, Tensor]) -> None:
    """Keep what each slot holds after forward where it is not the handed-in tensor (rebound now, or
    kept from before)."""
    for owner, container, attr, key in slots:
        now = container.get(attr)
        if now is not tensors[key] and isinstance(now, Tensor):
            owner.__dict__.setdefault(KEPT, {})[attr] = now


def cache_lengths(modules: Sequence[nn.Module]) -> list[dict[str, Any]]:
    """Each module's ``*max_seq_len_cached`` attributes (per layer type, ``{type}_max_seq_len_cached``)."""
    return [{k: int(v) for k, v in vars(m).items() if k.endswith("max_seq_len_cached")} for m in modules]


def refuse_moved_cache(modules: Sequence[nn.Module], before: list[dict[str, Any]]) -> None:
    """Refuse a call through ``functional_call`` (which swaps the buffers back, dropping a rebound
    ``inv_freq`` that cannot be kept there) that moved a dynamic RoPE's cache length (a growth or a
    reset), or any call after one was kept: a later call would read other frequencies than torch's."""
    for module, was, lengths in zip(modules, before, cache_lengths(modules), strict=True):
        if lengths != was or module.__dict__.get(KEPT):
            raise ValueError(
                f"{type(module).__name__} (rope_type {getattr(module, 'rope_type', None)!r}) changed its cache "
                f"length {was} -> {lengths} and rebound inv_freq from the input's length, in a call whose "
                "buffers are swapped by torch.func.functional_call (the tensors given do not name the module's "
                "own buffers one to one), which drops the new frequencies that torch's loop keeps for the next "
                "call; use a rope type of fixed frequencies (default, linear, yarn, llama3), or batches of one "
                "length (no longer than max_position_embeddings, or all the same)"
            )
