"""What context_parallel rewrites in a layer: the attention modules it knows and the position tables.

Three attentions are known, and their forwards replaced by the same projections around ring or Ulysses
attention: TinyGPT's ``CausalSelfAttention``, a causal self-attention with a fused ``qkv`` projection,
an output ``proj``, ``head_dim`` and a lower-triangular ``mask`` buffer (:class:`CPForward`), a
Hugging Face causal attention on ``sdpa`` with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` and
rotary ``position_embeddings`` (Llama's, and Qwen3's with its per-head ``q_norm`` and ``k_norm``:
:class:`HFForward`), and GPT-2's on ``sdpa`` with its fused
``c_attn`` and ``c_proj`` (:class:`GPT2Forward`; its learned position table ``wpe`` is listed in
``positions=``). Each is recognised by its parts, and replaced only where its class is one whose
forward was checked equal to the one installed, or a transformers class whose forward is such a class's
line for line (another model's copy: GLM-4's, ERNIE 4.5's; ``engine/model/reproduced.py``); another
class with the same parts is refused.
Each takes the padding / packed-sequence mask the layer reading the batch made
(a :class:`TokenMask` in the mask's place). Any other transformers attention (a class whose forward is
defined in ``transformers.models.*``) whose forward calls an ``AttentionInterface`` (Phi-3's, OLMo-2's,
Cohere's, ...) is kept as written and pointed at the split attention function registered there
(:attr:`LayerParts.interfaced`, ``hf_interface.py``). Any other module whose class name ends in
``Attention`` is refused, naming it: left as it is it would attend within the rank's part of the
sequence only. A module of any class whose own forward calls :func:`ring_attention` or
:func:`ulysses_attention` (``engine/model/calls.py`` reads its code) already attends over the whole
sequence: it is kept as written (:attr:`LayerParts.own`), and what it holds is its own. A Hugging Face
rotary embedding (a module whose class name ends in ``RotaryEmbedding``,
called as ``(x, position_ids)``) is fed the rank's global positions (:class:`GlobalPositions`).

A position table is a parameter (or a floating-point buffer: a fixed table) whose local name ends in one
of ``positions`` (TinyGPT's ``pos_emb``,
[1, max_len, d]; an embedding's [max_len, d] weight, GPT-2's ``wpe.weight``), read at rows
``0 .. t - 1`` by the layer (unless the batch gives position ids: then at those).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.model.calls import forward_calls
from ...engine.model.chain import Layer
from ...engine.model.module_call import module_fn
from ...engine.model.reproduced import check_reproduced, same_code
from ...engine.stack import in_layer
from .comm import attend
from .hf_interface import calls_attention_interface, refuse_unsplittable_forward, sdpa_way_out
from .layout import shard_order
from .masks import TokenMask, is_carried
from .ring import ring_attention
from .ulysses import ulysses_attention

# What a module of one's own calls to attend over the whole sequence: split as written (find_parts).
SPLIT_ATTENTIONS = (ring_attention, ulysses_attention)


@dataclass(frozen=True)
class LayerParts:
    """What a layer holds that context parallel rewrites: attention paths in its module, table names."""

    attentions: tuple[str, ...]
    tables: tuple[str, ...]
    rotaries: tuple[str, ...] = ()
    own: tuple[str, ...] = ()  # modules whose own forward calls ring_attention / ulysses_attention: kept as written
    # transformers attentions it does not reproduce, whose own forward calls an AttentionInterface: kept as
    # written, pointed at the split attention function (hf_interface.py)
    interfaced: tuple[str, ...] = ()


def find_parts(layer: Layer, positions: tuple[str, ...]) -> LayerParts | None:
    """The layer's known attentions and position tables (None: neither); an unknown attention is refused."""
    named = [*layer.param_names, *(n for n, b in layer.buffers.items() if b.is_floating_point())]
    tables = tuple(n for n in named if any(n == p or n.endswith("." + p) for p in positions))
    replicas = getattr(module_fn(layer.fn), "replicas", None)
    module = getattr(replicas, "module", None)
    if isinstance(module, nn.Module):
        _refuse_tables_read_their_own_way(layer, module, tables)
    _refuse_unlisted_position_tables(layer, tables, _rotary_buffers(layer, module))
    attentions: list[str] = []
    rotaries: list[str] = []
    own: list[str] = []
    interfaced: list[str] = []
    named_only: list[tuple[str, nn.Module]] = []  # named like an attention, neither known nor interfaced
    if isinstance(module, nn.Module):
        for path, sub in module.named_modules():
            # Inside a module that attends over the whole sequence itself, the parts are its own to call.
            inside = any(path.startswith(p + ".") for p in (*attentions, *own, *interfaced))
            if not inside and forward_calls(sub, SPLIT_ATTENTIONS):
                own.append(path)
            elif type(sub).__name__.endswith("RotaryEmbedding"):  # inside one too: it rotates by positions
                _refuse_length_dependent_rope(sub, f"{layer.name}: {path}")
                rotaries.append(path)
            elif not inside and not _reproduced(sub) and calls_attention_interface(sub):
                refuse_unsplittable_forward(sub, f"{layer.name}: {path}")
                interfaced.append(path)
            elif not inside and any(known(sub, f"{layer.name}: {path}") for known in (_known, _known_hf, _known_gpt2)):
                attentions.append(path)
            elif type(sub).__name__.endswith("Attention") and not inside:
                named_only.append((path, sub))
    handled = (*attentions, *own, *interfaced)
    for path, sub in named_only:
        # transformers' own wrapper named so around an attention split here (BERT's BertAttention: its
        # BertSelfAttention calls the interface, then a per-token output projection and norm) is kept as
        # written. One of another forward (a subclass of one's own, which might mix the sequence's positions
        # beside the attention: a mean over the tokens added) is refused by its name, as before.
        inner = [h for h in own if h.startswith(path + ".")]
        if inner and not _transformers_forward(sub):
            raise ValueError(
                f"context_parallel: layer {layer.name!r} holds the attention {path} ({type(sub).__name__}), whose "
                f"{inner[0]} calls ring_attention / ulysses_attention, but whose own forward around it is code "
                "context_parallel does not know (it could mix the sequence's positions beside the attention, which a "
                f"rank sees a part of): call ring_attention in {type(sub).__name__}.forward itself (a module whose own "
                "forward calls it is kept as written), or leave context_parallel out"
            )
        if not (_transformers_forward(sub) and any(h.startswith(path + ".") for h in handled)):
            raise ValueError(
                f"context_parallel: layer {layer.name!r} holds the attention {path} ({type(sub).__name__}), "
                "which it cannot split over the sequence (it knows causal self-attentions with qkv, proj, "
                "head_dim and a lower-triangular mask buffer: TinyGPT's CausalSelfAttention; Hugging Face "
                "causal attentions with q_proj, k_proj, v_proj, o_proj on attn_implementation='sdpa': "
                "Llama's; GPT-2's fused c_attn / c_proj self-attention on sdpa; and transformers attentions "
                "whose own forward calls the AttentionInterface); rewrite its forward to "
                "call ring_attention / ulysses_attention (over the transform's axis) in place of its "
                "attention, or leave context_parallel out"
            )
    if not attentions and not tables and not rotaries and not own and not interfaced:
        return None
    return LayerParts(tuple(attentions), tables, tuple(rotaries), tuple(own), tuple(interfaced))


def _transformers_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward is one transformers defines (not a subclass's own)."""
    return str(getattr(type(module).forward, "__module__", "")).startswith("transformers.models.")


def _reproduced(module: nn.Module) -> bool:
    """Whether ``module`` is an attention whose forward context_parallel reproduces (by its class, or a
    copy of one's code): those keep their reproduction, checked against the class's code."""
    return any(_verified(module, v) is not None for v in (_VERIFIED_HF, _VERIFIED_HF_HEAD_NORMS, _VERIFIED_GPT2))


def _refuse_length_dependent_rope(module: nn.Module, where: str) -> None:
    """A rotary embedding whose frequencies follow the longest position a call sees (Hugging Face's
    dynamic NTK and longrope types, which also keep it from call to call): a rank sees only its part's
    positions, so ranks would rotate by other frequencies than the whole sequence's, without an error."""
    kind = getattr(module, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else (kind,)
    scaled = sorted({k for k in kinds if isinstance(k, str) and ("dynamic" in k or k == "longrope")})
    if scaled:
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) is rope_type {scaled[0]!r}, whose frequencies "
            "depend on the longest position each call sees; a rank sees only its part of the sequence. Use a "
            "rope type of fixed frequencies (default, linear, yarn, llama3), or leave context_parallel out"
        )


# Names models give a learned position table (GPT-2's wpe, BERT's position_embeddings, OPT's
# embed_positions, ...): one not listed in positions= would be read at the rank's local positions.
POSITION_TABLE_NAMES = frozenset({
    "pos_emb", "pos_embed", "pos_embedding", "wpe", "position_embeddings", "position_embedding", "embed_positions",
})


# ... and any name with one of these words between its underscores (CLIP's positional_embedding, the
# position_embedding_table of Karpathy's GPT, abs_pos_emb), which the list above missed.
POSITION_WORDS = frozenset({"pos", "position", "positions", "positional"})


def _refuse_tables_read_their_own_way(layer: Layer, module: nn.Module, tables: tuple[str, ...]) -> None:
    """A position table held by an embedding with a forward of its own (OPT's reads its rows at the attention
    mask's running count plus an offset): not read at rows 0 .. t-1, so the rank's global positions cannot
    stand in for what it computes. Refused, naming it, listed in ``positions=`` or not."""
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.Embedding) or type(sub).forward is nn.Embedding.forward:
            continue
        words = {w for part in path.split(".") for w in part.split("_")}
        listed = any(t == f"{path}.weight" or t.endswith(f".{path}.weight") for t in tables)
        if listed or POSITION_TABLE_NAMES.intersection(path.split(".")) or POSITION_WORDS & words:
            raise ValueError(
                f"context_parallel: layer {layer.name!r} holds the position table {path!r} "
                f"({type(sub).__name__}), which its own forward reads at positions it computes (not rows 0 .. t-1: "
                "OPT's at the attention mask's running count plus an offset), so a rank's global positions cannot "
                "stand in for them; leave context_parallel out for this model"
            )


def _rotary_buffers(layer: Layer, module: Any) -> set[str]:
    """The names of ``layer``'s buffers held by a Hugging Face rotary embedding (its ``inv_freq``): frequencies,
    not a table read by position, whatever the module is named (LFM2 calls its rotary embedding ``pos_emb``);
    the rotary embedding itself is fed the rank's global positions (:class:`GlobalPositions`)."""
    if not isinstance(module, nn.Module):
        return set()
    held = {f"{path}.{name}" for path, sub in module.named_modules() if type(sub).__name__.endswith("RotaryEmbedding")
            for name, _ in sub.named_buffers(recurse=False)}
    return {n for n in layer.buffers if any(n == h or n.endswith("." + h) for h in held)}


def _refuse_unlisted_position_tables(layer: Layer, tables: tuple[str, ...], rotary: set[str]) -> None:
    """A parameter (or a floating-point buffer: a fixed sinusoidal table) named like a position table that
    ``positions=`` does not list: each rank would read its rows 0 .. t-1 (its local positions) where the
    sequence's global ones are meant, and train a different model without an error. Refused, naming it
    (a rotary embedding's frequencies, ``rotary``, are not such a table)."""
    buffers = [n for n, b in layer.buffers.items() if b.is_floating_point() and n not in rotary]  # a fixed table too
    for name in [*layer.param_names, *buffers]:
        parts = name.split(".")
        words = {w for part in parts for w in part.split("_")}
        if name not in tables and (POSITION_TABLE_NAMES.intersection(parts) or POSITION_WORDS & words):
            suggest = ".".join(name.split(".")[-2:]) if name.endswith(".weight") else name.split(".")[-1]
            raise ValueError(
                f"context_parallel: layer {layer.name!r} has the {'buffer' if name in buffers else 'parameter'} "
                f"{name!r}, named like a {'fixed' if name in buffers else 'learned'} position table, which "
                "positions= does not list; each rank would read it at its local "
                f"positions. If the model reads it by position, add it: context_parallel(..., positions=(..., "
                f"{suggest!r})); if it is not a position table, rename it"
            )


def _known(module: nn.Module, where: str) -> bool:
    mask = getattr(module, "mask", None)
    known = (
        isinstance(getattr(module, "qkv", None), nn.Module) and isinstance(getattr(module, "proj", None), nn.Module)
        and isinstance(getattr(module, "head_dim", None), int) and isinstance(mask, torch.Tensor)
        and mask.dim() == 2 and mask.dtype == torch.bool
        and (mask.is_meta or bool(torch.equal(mask, torch.ones_like(mask).tril())))
    )
    # CPForward is TinyGPT's forward: a module it does not call (a q_norm, a dropout) would be left out.
    extra = [n for n, _ in module.named_children() if n not in ("qkv", "proj")] if known else []
    if extra:
        raise ValueError(
            f"context_parallel: {where} ({type(module).__name__}) holds {', '.join(extra)}, which the forward it "
            "installs (qkv, causal attention, proj: TinyGPT's CausalSelfAttention) would not apply; rewrite the "
            "module to call ring_attention / ulysses_attention, or leave context_parallel out"
        )
    # ... nor what another forward computes on the same parts (a muP 1/head_dim scale, soft-capped scores,
    # rotary positions applied inline): only the class whose forward CPForward is gets it replaced.
    if known and _verified(module, _VERIFIED_TINYGPT) is None:
        raise ValueError(
            f"context_parallel: {where} is a {type(module).__name__} (from {type(module).__module__}) shaped like "
            "TinyGPT's attention (qkv, proj, head_dim, a causal mask buffer), whose forward is not the one "
            "context_parallel installs in its place (shardwise.testing.models.CausalSelfAttention's: softmax "
            "attention at 1/sqrt(head_dim) under the causal mask); what its own forward does beyond that (another "
            "scale, a soft cap of the scores, rotary positions) would be dropped without an error. context_parallel "
            "splits shardwise's CausalSelfAttention, the Hugging Face attentions "
            f"{', '.join([*_VERIFIED_HF, *_VERIFIED_HF_HEAD_NORMS])} and GPT2Attention, on attn_implementation='sdpa', "
            "as their classes define "
            "them, and no attention of your own: use one of those, or leave context_parallel out"
        )
    return known


def _known_hf(module: nn.Module, where: str) -> bool:
    """A Hugging Face causal attention (q_proj .. o_proj, head_dim, a config) of a class it splits; refused
    unless on sdpa."""
    m: Any = module
    if not all(isinstance(getattr(m, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    config = getattr(m, "config", None)
    if config is None or not isinstance(getattr(m, "head_dim", None), int) or not getattr(m, "is_causal", False):
        return False
    # HFForward is Llama's forward (and, for the classes of _VERIFIED_HF_HEAD_NORMS, Qwen3's per-head q_norm
    # and k_norm): a module it does not call (OLMo-2's q_norm, k_norm over all heads) would be left out, and
    # the step would train another model without an error.
    own = _HF_PROJECTIONS + (_HEAD_NORMS if _verified(m, _VERIFIED_HF_HEAD_NORMS) else ())
    extra = [n for n, _ in m.named_children() if n not in own]
    if extra:
        raise ValueError(
            f"context_parallel: {where} ({type(m).__name__}) holds {', '.join(extra)}, which the Llama-shaped forward "
            f"it installs ({', '.join(_HF_PROJECTIONS)}, rotary embedding, sdpa) would not apply; it splits "
            f"attentions that are exactly Llama's, and {', '.join(_VERIFIED_HF_HEAD_NORMS)} with their per-head "
            "q_norm and k_norm: rewrite this one to call ring_attention / ulysses_attention, or leave "
            "context_parallel out"
        )
    # ... nor what such a forward does beyond Llama's on its own settings (OLMo's clip_qkv clamps q, k, v;
    # Starcoder2's residual_dropout drops the output).
    clip, dropout = getattr(config, "clip_qkv", None), getattr(m, "residual_dropout", 0.0)
    if clip is not None or (isinstance(dropout, float) and dropout > 0):
        setting = f"config.clip_qkv={clip}" if clip is not None else f"residual_dropout={dropout}"
        raise ValueError(
            f"context_parallel: {where} ({type(m).__name__}) has {setting}, which the Llama-shaped forward it installs "
            "would not apply: set it to None / 0, or leave context_parallel out"
        )
    # ... nor anything else another family's forward does in plain code (a soft cap of the scores, another
    # scaling): only the attentions whose forward was checked equal to the installed one are split.
    if _verified(m, _VERIFIED_HF, where) is None and _verified(m, _VERIFIED_HF_HEAD_NORMS, where) is None:
        raise ValueError(
            f"context_parallel: {where} is a {type(m).__name__} (from {type(m).__module__}), whose forward is not one "
            "context_parallel has checked against the Llama-shaped forward it installs "
            f"({', '.join([*_VERIFIED_HF, *_VERIFIED_HF_HEAD_NORMS])}); "
            "what it does beyond Llama's in its own code would be left out without an error. Use one of those "
            "attentions, rewrite this one to call ring_attention / ulysses_attention, or leave context_parallel out"
        )
    # The implementation last: a class it does not split is refused for that, which no implementation changes
    # (Gemma-2 on eager was told to use sdpa, which transformers refuses for it).
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise ValueError(
            f"context_parallel: {where} ({type(m).__name__}) runs attn_implementation={implementation!r}; it splits "
            f"sdpa attention (plain causal softmax attention){sdpa_way_out(m)}"
        )
    return True


_HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# The Hugging Face attentions whose forward is Llama's (checked equal to HFForward in float64 by the tests),
# by class and the module that defines it (a copy of the class elsewhere may differ).
_VERIFIED_HF = {
    "LlamaAttention": "transformers.models.llama.modeling_llama",
    "MistralAttention": "transformers.models.mistral.modeling_mistral",
    "Qwen2Attention": "transformers.models.qwen2.modeling_qwen2",
    "MixtralAttention": "transformers.models.mixtral.modeling_mixtral",
    "Qwen2MoeAttention": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    # Llama's forward line for line: Granite's scaling is its attention_multiplier, read as m.scaling.
    "GraniteAttention": "transformers.models.granite.modeling_granite",
    "GemmaAttention": "transformers.models.gemma.modeling_gemma",
}
# ... and those whose forward is Llama's with an RMSNorm over each head of q and of k, applied to the
# projections viewed per head, before the rotary embedding (Qwen3's).
_HEAD_NORMS = ("q_norm", "k_norm")
_VERIFIED_HF_HEAD_NORMS = {
    "Qwen3Attention": "transformers.models.qwen3.modeling_qwen3",
    "Qwen3MoeAttention": "transformers.models.qwen3_moe.modeling_qwen3_moe",
}


# GPT-2's attention, checked equal to GPT2Forward (a class with its c_attn and c_proj, as GPT-BigCode's, or a
# subclass with a forward of its own, computes otherwise: replaced, its own code was left out without an error).
_VERIFIED_GPT2 = {"GPT2Attention": "transformers.models.gpt2.modeling_gpt2"}


# TinyGPT's attention, whose forward CPForward is, by class and module (transforms do not import testing).
_VERIFIED_TINYGPT = {"CausalSelfAttention": "shardwise.testing.models"}


def _verified(module: nn.Module, verified: dict[str, str], where: str | None = None) -> str | None:
    """The verified attention ``module`` is (its class or a base, or a transformers class whose forward is
    one of theirs line for line: ``reproduced.same_code``), if the forward it runs is that class's own; with
    ``where``, a class verified by name is also refused if its forward is not the code checked
    (``engine/model/reproduced.py``)."""
    for cls in type(module).__mro__:
        by_name = verified.get(cls.__name__) == cls.__module__
        if not by_name and not same_code(cls, verified):
            continue
        if type(module).forward is not getattr(cls, "forward", None):
            return None
        if by_name and where is not None:
            check_reproduced(cls, "context_parallel", where)
        return cls.__name__
    return None


def _known_gpt2(module: nn.Module, where: str) -> bool:
    """GPT-2's self-attention (a fused ``c_attn`` Conv1D, ``c_proj``, ``split_size``); refused unless on
    sdpa, and as cross-attention."""
    m: Any = module
    if not all(isinstance(getattr(m, n, None), nn.Module) for n in ("c_attn", "c_proj")) or not hasattr(
        m, "split_size"
    ):
        return False
    config = getattr(m, "config", None)
    if config is None or not isinstance(getattr(m, "head_dim", None), int):
        return False
    if getattr(m, "is_cross_attention", False):
        raise ValueError(
            f"context_parallel: {where} ({type(m).__name__}) is a cross-attention, whose keys are another sequence "
            "it does not cut; leave context_parallel out of encoder-decoder models"
        )
    if _verified(m, _VERIFIED_GPT2, where) is None:
        raise ValueError(
            f"context_parallel: {where} is a {type(m).__name__} (from {type(m).__module__}) shaped like GPT-2's "
            "attention (c_attn, c_proj), whose forward is not one context_parallel has checked against the GPT-2 "
            "forward it installs (GPT2Attention's own); what it does beyond GPT-2's in its own code would be left "
            "out without an error. Use GPT2Attention as it is, rewrite this one to call ring_attention / "
            "ulysses_attention, or leave context_parallel out"
        )
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise ValueError(
            f"context_parallel: {where} ({type(m).__name__}) runs attn_implementation={implementation!r}; it splits "
            f"sdpa attention (plain causal softmax attention){sdpa_way_out(m)}"
        )
    return True


def heads_of(module: nn.Module) -> int:
    """A known attention's query heads: its qkv width over 3 x head_dim (q_proj's over head_dim)."""
    m: Any = module
    if hasattr(m, "q_proj") and isinstance(getattr(m, "head_dim", None), int):
        return int(m.q_proj.out_features) // int(m.head_dim)
    if hasattr(m, "config") and not hasattr(m, "c_attn"):  # one that calls transformers' AttentionInterface
        return int(getattr(m, "num_heads", None) or m.config.num_attention_heads)
    if hasattr(m, "c_attn"):
        return int(m.num_heads)
    return int(m.qkv.out_features) // (3 * int(m.head_dim))


class CPForward:
    """A known attention's forward with the sequence cut over ``axis``: its projections on the rank's
    tokens, and attention over the whole sequence (``ring`` or ``ulysses``)."""

    def __init__(self, module: nn.Module, axis: str, attention: str, balanced: bool, where: str) -> None:
        self.module, self.axis, self.attention, self.balanced, self.where = module, axis, attention, balanced, where

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m: Any = self.module
        b, t, _ = x.shape
        q, k, v = m.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, m.head_dim).transpose(1, 2) for z in (q, k, v))
        y = attend(q, k, v, self.axis, self.attention, self.balanced, self.where)
        return m.proj(y.transpose(1, 2).reshape(b, t, -1))


class HFForward:
    """A Hugging Face causal attention's forward with the sequence cut over ``axis``: its projections (and
    Qwen3's per-head q_norm, k_norm) and rotary embedding (already at global positions) on the rank's tokens,
    attention over the whole sequence."""

    def __init__(self, module: nn.Module, axis: str, attention: str, balanced: bool, where: str) -> None:
        self.module, self.axis, self.attention, self.balanced, self.where = module, axis, attention, balanced, where
        self.head_norms = _verified(module, _VERIFIED_HF_HEAD_NORMS) is not None

    def __call__(
        self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
        *args: Any, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        m: Any = self.module
        self._refuse_a_shorter_window(hidden_states.shape[1])
        mask = self._mask(attention_mask, hidden_states.shape[1])
        if m.training and float(getattr(m, "attention_dropout", 0.0)) > 0:
            raise ValueError(
                f"context_parallel: {self.where} has attention_dropout={m.attention_dropout}; ring and Ulysses "
                "attention have no dropout: set config.attention_dropout = 0"
            )
        rotate = sys.modules[type(m).__module__].apply_rotary_pos_emb
        shape = (*hidden_states.shape[:-1], -1, m.head_dim)
        q, k, v = (proj(hidden_states).view(shape) for proj in (m.q_proj, m.k_proj, m.v_proj))
        if self.head_norms:  # Qwen3's: per head, before the rotary embedding
            q, k = m.q_norm(q), m.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        cos, sin = position_embeddings
        q, k = rotate(q, k, cos, sin)
        y = attend(q, k, v, self.axis, self.attention, self.balanced, self.where, scale=float(m.scaling), mask=mask)
        return m.o_proj(y.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1).contiguous()), None

    def _mask(self, attention_mask: Any, local: int) -> TokenMask | None:
        """The padding / packed-sequence mask the layer that read the batch made (see ``CPLayerFn``), or
        None; any other mask is refused."""
        if attention_mask is None:
            return None
        if not is_carried(attention_mask):
            raise ValueError(
                f"context_parallel: {self.where} got an attention mask it did not make ({_describe(attention_mask)}): "
                "it splits causal attention with padding (a 2-D attention_mask in the batch) and packed sequences "
                "(restarting position_ids in the batch), read where the model reads its batch; pass those in the "
                "batch dict, not a mask of your own"
            )
        return TokenMask.from_carried(attention_mask)

    def _refuse_a_shorter_window(self, local: int) -> None:
        """Sliding-window attention shorter than the whole sequence, with a mask or without one: a rank's
        part may fit in the window, where the model makes no mask (and ring attention would see every key)."""
        window = self._window()
        if isinstance(window, int) and window < local * in_layer.size(self.axis):
            raise ValueError(
                f"context_parallel: {self.where} uses sliding-window attention (config.sliding_window={window}, "
                f"shorter than the sequence's {local * in_layer.size(self.axis)} tokens), which it does not split: use "
                "sequences no longer than the window, or leave context_parallel out"
            )


    def _window(self) -> Any:
        """The layer's attention window: the module's own where it has one (Qwen2's: None on its
        full-attention layers), none where the config's ``layer_types`` says the layer attends to every
        earlier token and the config declares that field, so the model reads it (Qwen2-MoE's
        full-attention layers have no attribute, and its config's ``sliding_window`` is 0 unless
        ``use_sliding_window``), else the config's: Mistral's and Mixtral's modeling windows every layer
        by ``config.sliding_window`` and ignores a ``layer_types`` given to their config."""
        m: Any = self.module
        if hasattr(m, "sliding_window"):
            return m.sliding_window
        config = getattr(m, "config", None)
        kinds, index = getattr(config, "layer_types", None), getattr(m, "layer_idx", None)
        declared = any("layer_types" in getattr(c, "__annotations__", {}) for c in type(config).__mro__)
        if declared and isinstance(kinds, (list, tuple)) and isinstance(index, int) and 0 <= index < len(kinds) \
                and kinds[index] == "full_attention":
            return None
        return getattr(config, "sliding_window", None)


def _describe(mask: Any) -> str:
    return f"{type(mask).__name__} {tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else repr(mask)


# How the layer reading the batch gives the rotary embeddings positions, while it runs (``CPLayerFn``):
# "given", the batch carries position_ids (cut like every token, each one its token's own); "counted",
# the model counts 0 .. t - 1 itself, which GlobalPositions maps to the rank's global positions.
_batch_positions: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardwise_cp_positions", default=None)


@contextlib.contextmanager
def reading_batch(positions: str) -> Iterator[None]:
    """Inside the block the layer that reads the batch runs (see :data:`_batch_positions`)."""
    token = _batch_positions.set(positions)
    try:
        yield
    finally:
        _batch_positions.reset(token)


class GPT2Forward(HFForward):
    """GPT-2's self-attention forward with the sequence cut over ``axis``: its fused projection on the
    rank's tokens, attention over the whole sequence, its output projection and residual dropout."""

    def __call__(
        self, hidden_states: torch.Tensor, *args: Any, attention_mask: Any = None, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        m: Any = self.module
        mask = self._mask(attention_mask, hidden_states.shape[1])
        if m.training and float(m.attn_dropout.p) > 0:
            raise ValueError(
                f"context_parallel: {self.where} has attention dropout (config.attn_pdrop={m.attn_dropout.p}); ring "
                "and Ulysses attention have no dropout of the probabilities: set config.attn_pdrop = 0 (the "
                "residual and embedding dropouts stay)"
            )
        shape = (*hidden_states.shape[:-1], -1, m.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in m.c_attn(hidden_states).split(m.split_size, dim=2))
        y = attend(q, k, v, self.axis, self.attention, self.balanced, self.where, scale=float(m.scaling), mask=mask)
        y = m.c_proj(y.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1).contiguous())
        return m.resid_dropout(y), None


class GlobalPositions:
    """A rotary embedding's forward fed the rank's global positions: ``position_ids`` count the rank's
    tokens (0 .. t - 1), which stand for the global positions the rank holds; position_ids the batch
    gave (cut with the tokens) are each token's own, and pass as they are."""

    def __init__(self, module: nn.Module, axis: str, balanced: bool) -> None:
        self.module, self.axis, self.balanced = module, axis, balanced
        self.forward = type(module).forward

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        # (``rest``/``kwargs``: what else the embedding takes, as it is: Gemma-3's and OLMo-3's layer_type.)
        how = _batch_positions.get()
        n, t = in_layer.size(self.axis), position_ids.shape[-1]
        local = torch.arange(t, device=position_ids.device)
        if how is None and not in_layer.predicting_now() and not bool((position_ids == local).all()):
            # Outside the layer that reads the batch: Hugging Face's "head" replays the code before the
            # first block and discards it. (A rotary embedding inside the blocks would be an attention's
            # own, which HFForward replaces: in transformers 5 those attentions get no position_embeddings.)
            how = "given"
        if how == "given":
            return self.forward(self.module, x, position_ids, *rest, **kwargs)
        # Fake tensors (while predicting) hold no values to compare.
        if not in_layer.predicting_now() and not bool((position_ids == local).all()):
            raise ValueError(
                "context_parallel: a rotary embedding got position_ids the model made that do not count 0 .. t - 1 "
                "(the batch gave none); it maps the rank's token counts to their global positions: give each "
                "token's position in the batch dict's position_ids instead"
            )
        i = in_layer.index(self.axis)
        mine = shard_order(t * n, n, self.balanced)[i * t : (i + 1) * t]
        return self.forward(self.module, x, mine.to(position_ids.device).expand_as(position_ids), *rest, **kwargs)

