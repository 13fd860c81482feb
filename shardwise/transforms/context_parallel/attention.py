"""What context_parallel rewrites in a layer: the attention modules it knows and the position tables.

A known attention is a causal self-attention with a fused ``qkv`` projection, an output ``proj``,
``head_dim`` and a lower-triangular ``mask`` buffer (TinyGPT's ``CausalSelfAttention``): its forward
is replaced by :class:`CPForward`, the same projections around ring or Ulysses attention. Any other
module whose class name ends in ``Attention`` is refused, naming it: left as it is it would attend
within the rank's part of the sequence only.

A position table is a parameter whose local name ends in one of ``positions`` (TinyGPT's ``pos_emb``,
[1, max_len, d]; an embedding's [max_len, d] weight), read at rows ``0 .. t - 1`` by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.model.chain import Layer
from .comm import attend


@dataclass(frozen=True)
class LayerParts:
    """What a layer holds that context parallel rewrites: attention paths in its module, table names."""

    attentions: tuple[str, ...]
    tables: tuple[str, ...]


def find_parts(layer: Layer, positions: tuple[str, ...]) -> LayerParts | None:
    """The layer's known attentions and position tables (None: neither); an unknown attention is refused."""
    tables = tuple(n for n in layer.param_names if any(n == p or n.endswith("." + p) for p in positions))
    replicas = getattr(layer.fn, "replicas", None)
    module = getattr(replicas, "module", None)
    attentions: list[str] = []
    if isinstance(module, nn.Module):
        for path, sub in module.named_modules():
            if _known(sub):
                attentions.append(path)
            elif type(sub).__name__.endswith("Attention") and not any(path.startswith(a + ".") for a in attentions):
                raise ValueError(
                    f"context_parallel: layer {layer.name!r} holds the attention {path} ({type(sub).__name__}), "
                    "which it cannot split over the sequence (it knows causal self-attentions with qkv, proj, "
                    "head_dim and a lower-triangular mask buffer: TinyGPT's CausalSelfAttention); rewrite it "
                    "to call sw's ring_attention / ulysses_attention, or leave context_parallel out"
                )
    if not attentions and not tables:
        return None
    return LayerParts(tuple(attentions), tables)


def _known(module: nn.Module) -> bool:
    mask = getattr(module, "mask", None)
    return (
        isinstance(getattr(module, "qkv", None), nn.Module) and isinstance(getattr(module, "proj", None), nn.Module)
        and isinstance(getattr(module, "head_dim", None), int) and isinstance(mask, torch.Tensor)
        and mask.dim() == 2 and mask.dtype == torch.bool
        and (mask.is_meta or bool(torch.equal(mask, torch.ones_like(mask).tril())))
    )


def heads_of(module: nn.Module) -> int:
    """A known attention's query heads: its qkv width over 3 x head_dim."""
    m: Any = module
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
