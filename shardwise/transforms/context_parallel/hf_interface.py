"""Any Hugging Face attention that calls transformers' ``AttentionInterface``, split by its own forward.

Most transformers attention modules (Mistral's, Phi-3's, OLMo-2's, Cohere's, StarCoder2's, ...) do their
projections, norms and rotary embedding themselves, then call ``ALL_ATTENTION_FUNCTIONS.get_interface(
self.config._attn_implementation, ...)(self, query, key, value, attention_mask, dropout=..., scaling=...,
**kwargs)``. context_parallel registers one function there (:data:`NAME`, :func:`split_attention_forward`)
and points each such module it takes over at it: the module's copy in the rewritten layer gets a copy of
its config whose implementation is :data:`NAME` (:func:`point_at_split_attention`). Nothing shared
changes: the model's mask creation, the other modules, the single-device step and the other thread
ranks each read their own config. The module's own forward runs as written on the rank's tokens (its
rotary embedding already fed the rank's global positions: ``GlobalPositions``), and the function
attends over the whole sequence (``ring_attention`` / ``ulysses_attention``: grouped-query heads,
the module's ``scaling``, causal as the module's ``is_causal``), under the padding / packed-sequence
mask the layer reading the batch made (a ``TokenMask`` in the mask's place).

The function refuses, naming the module, the setting and the fix, what it cannot compute exactly: an
argument it does not know (each is listed: none is ignored unread), a sliding window shorter than the
sequence, a layer of another kind (Llama-4's chunked attention), a soft cap of the scores (Gemma-2),
attention sinks (GPT-OSS's ``s_aux``), a head mask, a position bias, attention dropout in training, a
cross-attention, a mask it did not make, a model not built on ``sdpa`` (whose masks are not the ones it
reads); and, when the transform is applied, a forward that reads the layer's position ids itself
(Ministral-3 scales its queries by them), which count the rank's own tokens, or that branches on the
``sdpa`` implementation (a branch the single-device step takes and the split one would not). A module
whose config names :data:`NAME` without being taken over by context_parallel is computed as
transformers' ``sdpa``.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.model.calls import forward_uses
from ...engine.stack import in_layer
from .comm import attend
from .masks import TokenMask, is_carried

NAME = "shardwise_context_parallel"
_SETTINGS = "_context_parallel_split"  # the attribute of a taken-over module that holds its SplitAttention

# What sdpa does not read either, here as there: the positions (the rotary embedding has used them;
# packed sequences come as the TokenMask) and the cache (a pure layer keeps none).
_UNREAD = frozenset({"position_ids", "use_cache", "cache_position",
                     # a flag a MoE model's layers hand on to every module (OLMoE's, GPT-OSS's): of outputs
                     # collected elsewhere (refused where they would be a part's: compose.py), not attention's
                     "output_router_logits",
                     # flash-attention's choice of a deterministic backward (ModernBERT's): not what is computed
                     "deterministic"})
# Handed on as None by a self-attention (BERT's layer passes its encoder states down to every attention,
# none to an encoder's): unread when None, as sdpa leaves them; any value is refused as unknown.
_UNREAD_WHEN_NONE = frozenset({"encoder_hidden_states", "encoder_attention_mask"})
# Each read below; anything else a forward passes is refused.
_READ = frozenset({"dropout", "scaling", "is_causal", "sliding_window", "softcap", "s_aux", "sinks", "head_mask",
                   "position_bias", "output_attentions"})
# Settings that change what attention computes, and why the split one cannot.
_UNSUPPORTED = {
    "softcap": "a soft cap of the scores (tanh), which ring and Ulysses attention do not apply",
    "s_aux": "attention sinks (a per-head logit every query sees), which ring and Ulysses attention do not add",
    "sinks": "attention sinks (a per-head logit every query sees), which ring and Ulysses attention do not add",
    "head_mask": "a mask of the heads, which ring and Ulysses attention do not apply",
    "position_bias": "a bias added to the scores (relative positions), which ring and Ulysses attention do not add",
}


@dataclass(frozen=True)
class SplitAttention:
    """How a taken-over module attends: over ``axis`` by ``attention`` (ring or ulysses) in the ``balanced``
    layout or not; ``where`` names it in errors; ``implementation`` is the model's own (which made its masks)."""

    axis: str
    attention: str
    balanced: bool
    where: str
    implementation: str | None

    def __setstate__(self, state: dict[str, Any]) -> None:
        register()  # a module unpickled in another process: the name must resolve there too
        for k, v in state.items():
            object.__setattr__(self, k, v)


def register() -> None:
    """Register :func:`split_attention_forward` in transformers' ``AttentionInterface`` as :data:`NAME`."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, split_attention_forward)


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a transformers model's (defined in ``transformers.models.*``) that
    calls an ``AttentionInterface`` (read from its code: ``engine/model/calls.py``)."""
    defining = next((c for c in type(module).__mro__ if "forward" in vars(c)), None)
    if defining is None or not defining.__module__.startswith("transformers.models."):
        return False
    from transformers import AttentionInterface

    return forward_uses(module, lambda obj: isinstance(obj, AttentionInterface))


# Per-token positions a layer receives: under context_parallel they count the rank's own tokens (unless the
# batch gave them), which only the rotary embeddings are fed as global positions (GlobalPositions).
_POSITIONS = ("position_ids", "cache_position")


def refuse_unsplittable_forward(module: nn.Module, where: str) -> None:
    """Refuse, from its code, an attention whose forward branches on the sdpa implementation (the
    single-device step takes that branch; the split one, under another name, would not), or reads the
    layer's position ids itself (Ministral-3 scales its queries by them, Llama-4 style): they count the
    rank's own tokens, not their place in the sequence, and the module would compute another model without
    an error. Passing them on to the attention function it fetched (``position_ids=position_ids``, for
    flash attention) is not reading them."""
    forward = inspect.unwrap(type(module).forward)
    config: Any = getattr(module, "config", None)
    if getattr(config, "alibi", False) is True:
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) adds ALiBi position biases (config.alibi), which "
            "the model builds from the batch's 2-D mask for the rank's part of the sequence and ring and Ulysses "
            "attention do not add; leave context_parallel out for this model"
        )
    if _names_sdpa(forward):
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) branches on attn_implementation 'sdpa' in its "
            "forward, a branch the single-device step takes and the split one (another implementation's name) "
            "would not. Leave context_parallel out for this model"
        )
    if _counts_positions(forward):
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) makes positions with arange in its forward "
            "(Llama-4's query temperature by position), from the length of the rank's part of the sequence: they "
            "would count the rank's own tokens, not their place in the sequence, so it would compute another "
            "model. Leave context_parallel out for this model"
        )
    read = _positions_read(forward)
    if read is not None:
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) reads {read} in its forward (beyond passing "
            "them to its attention function); under context_parallel they count the rank's own tokens, not "
            "their place in the sequence, so it would compute another model. Leave context_parallel out for "
            "this model"
        )


@functools.cache
def _names_sdpa(forward: Any) -> bool:
    """Whether ``forward``'s code holds a string naming sdpa (``config._attn_implementation == "sdpa"``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "sdpa" in n.value for n in ast.walk(tree))


@functools.cache
def _counts_positions(forward: Any) -> bool:
    """Whether ``forward``'s code calls ``arange`` (``torch.arange(hidden_states.shape[1])``: positions made
    from the length of what it is given); its source unread counts as calling it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) == "arange"
                                            or getattr(n.func, "id", None) == "arange") for n in ast.walk(tree))


@functools.cache
def _positions_read(forward: Any) -> str | None:
    """The first of :data:`_POSITIONS` ``forward``'s code reads other than as a keyword passed to a function
    it holds in a local variable (the attention function it fetched); its source unread counts as reading."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return _POSITIONS[0]
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    passed = {id(k.value) for call in ast.walk(tree) if isinstance(call, ast.Call)
              and isinstance(call.func, ast.Name) and call.func.id in local for k in call.keywords
              if k.arg in _POSITIONS and isinstance(k.value, ast.Name) and k.value.id == k.arg}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _POSITIONS and isinstance(node.ctx, ast.Load) \
                and id(node) not in passed:
            return node.id
        if isinstance(node, ast.Constant) and node.value in _POSITIONS:  # kwargs["position_ids"], .get(...)
            return str(node.value)
    return None


def point_at_split_attention(module: nn.Module, settings: SplitAttention) -> None:
    """Point ``module`` (a copy the rewritten layer owns) at :data:`NAME`, with a config of its own."""
    register()
    config: Any = copy.copy(module.config)  # shallow: its sub-configs are shared, so the setter is bypassed
    config._attn_implementation_internal = NAME
    module.config = config
    setattr(module, _SETTINGS, settings)


def split_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function, split over the sequence: ``query`` [batch, heads, t, head_dim],
    ``key`` and ``value`` [batch, kv_heads, t, head_dim] on the rank's tokens; returns [batch, t, heads,
    head_dim] over the whole sequence and no weights."""
    split: SplitAttention | None = getattr(module, _SETTINGS, None)
    if split is None:  # not one context_parallel took over: what the single-device step computes
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    who = f"context_parallel: {split.where} ({type(module).__name__})"
    parts = 1 if in_layer.one_device() else in_layer.size(split.axis)  # no mesh at all: the whole sequence here
    _refuse_settings(who, module, kwargs, query.shape[2] * parts)
    if getattr(module, "is_cross_attention", False) or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{who} is a cross-attention (its keys are another sequence, {key.shape[2]} tokens to its queries' "
            f"{query.shape[2]}), which context_parallel does not cut; leave context_parallel out of this model"
        )
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"{who} attends with values of head dim {value.shape[-1]} to queries and keys of {query.shape[-1]} "
            "(DeepSeek-V3's multi-head latent attention), which context_parallel's ring and Ulysses attention do "
            "not take; leave context_parallel out for this model"
        )
    if split.implementation != "sdpa":
        raise ValueError(
            f"{who} runs attn_implementation={split.implementation!r}; context_parallel computes sdpa attention "
            f"and reads the masks the model makes for sdpa{sdpa_way_out(module)}"
        )
    mask = _mask(who, attention_mask)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True)) if causal is None else bool(causal)
    scale = kwargs.get("scaling")
    y = attend(query, key, value, split.axis, split.attention, split.balanced, split.where,
               scale=None if scale is None else float(scale), mask=mask, causal=causal)
    return y.transpose(1, 2).contiguous(), None


def _dropout_setting(module: nn.Module, dropout: float) -> str:
    """The config's name for the attention dropout the module applies (BERT's ``attention_probs_dropout_prob``);
    ``attention_dropout``, most families' name, where none of the config's matches."""
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    settings: dict[str, Any] = to_dict() if callable(to_dict) else {}
    named = sorted(k for k, v in settings.items() if "dropout" in k and "att" in k and v == dropout)
    return named[0] if named else "attention_dropout"


def _refuse_settings(who: str, module: nn.Module, kwargs: dict[str, Any], sequence: int) -> None:
    """Refuse an argument the function does not know, and every setting it cannot compute exactly."""
    unknown = sorted(k for k in set(kwargs) - _READ - _UNREAD if not (k in _UNREAD_WHEN_NONE and kwargs[k] is None))
    if unknown:
        raise ValueError(
            f"{who} passes {', '.join(unknown)} to its attention function, which context_parallel's does not know "
            "(it refuses what it cannot tell it computes exactly); leave context_parallel out for this model"
        )
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{who} passes {name}= to its attention: {what}. Leave context_parallel out for this model"
            )
    if kwargs.get("output_attentions"):
        raise ValueError(f"{who} is asked for its attention weights (output_attentions), which context_parallel "
                         "never forms: do not ask for them")
    dropout = kwargs.get("dropout") or 0.0
    if float(dropout) > 0:
        setting = _dropout_setting(module, float(dropout))
        raise ValueError(
            f"{who} drops attention probabilities in training (dropout={dropout}, config.{setting}); ring and "
            f"Ulysses attention have no dropout: set config.{setting} = 0, or train it with model.eval()"
        )
    kind = _layer_type(module)
    if kind is not None and kind not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"{who} is a {kind!r} layer (config.layer_types), whose mask the model makes for the rank's part of "
            "the sequence alone; context_parallel splits full and sliding-window attention only: leave "
            "context_parallel out for this model"
        )
    window = _window(module, kwargs)
    if window is not None and window < sequence:
        raise ValueError(
            f"{who} uses sliding-window attention (sliding_window={window}, shorter than the sequence's {sequence} "
            "tokens), which context_parallel does not split: use sequences no longer than the window, or leave "
            "context_parallel out"
        )


def _window(module: nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The shortest attention window anything says this layer has: the argument passed, the module's own,
    or the config's where its ``layer_types`` mark the layer sliding (a window the model may apply only by
    the mask it makes, which a rank's shorter part does not need)."""
    m: Any = module
    hints = [kwargs.get("sliding_window"), getattr(m, "sliding_window", None)]
    if _layer_type(module) == "sliding_attention":
        hints.append(getattr(m.config, "sliding_window", None))
    windows = [int(w) for w in hints if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(windows) if windows else None


def _layer_type(module: nn.Module) -> str | None:
    """The layer's kind in its config's ``layer_types`` (full, sliding, chunked attention, ...), if given."""
    m: Any = module
    kinds, index = getattr(getattr(m, "config", None), "layer_types", None), getattr(m, "layer_idx", None)
    if isinstance(kinds, (list, tuple)) and isinstance(index, int) and 0 <= index < len(kinds):
        return str(kinds[index])
    return None


def _mask(who: str, attention_mask: Any) -> TokenMask | None:
    """The padding / packed-sequence mask the layer that read the batch made, or None; any other refused."""
    if attention_mask is None:
        return None
    if not is_carried(attention_mask):
        shown = (f"{type(attention_mask).__name__} {tuple(attention_mask.shape)} {attention_mask.dtype}"
                 if isinstance(attention_mask, torch.Tensor) else repr(attention_mask))
        raise ValueError(
            f"{who} got an attention mask it did not make ({shown}): it splits causal attention with padding (a 2-D "
            "attention_mask in the batch) and packed sequences (restarting position_ids in the batch), read where "
            "the model reads its batch; pass those in the batch dict, not a mask of your own. A model that makes a "
            "mask of its own where the batch gives none (Falcon's causal mask) takes the batch's attention_mask "
            "(ones where nothing is padded)"
        )
    return TokenMask.from_carried(attention_mask)


def sdpa_way_out(attention: nn.Module) -> str:
    """The end of the refusal of an attention not on sdpa: build the model on sdpa where transformers offers it
    for the model (its PreTrainedModel's ``_supports_sdpa``), else leave context_parallel out (Gemma-2, told to
    use sdpa, could not: transformers refuses sdpa for it)."""
    family = sys.modules.get(type(attention).__module__)
    offers = [] if family is None else [
        c._supports_sdpa for c in vars(family).values()
        if isinstance(c, type) and c.__name__.endswith("PreTrainedModel") and hasattr(c, "_supports_sdpa")
    ]
    if offers and not any(offers):
        return (", and transformers offers no sdpa attention for this model (it refuses attn_implementation='sdpa' "
                "there): leave context_parallel out for this model")
    return ": build the model with attn_implementation='sdpa'"
