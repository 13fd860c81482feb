"""Checks of the query, key and value tensors both attentions take: each error names the argument and the fix."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Shapes(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    seq_local: int
    head_dim: int


def check_qkv(op: str, q: object, k: object, v: object) -> Shapes:
    """The shapes of ``q`` [batch, heads, seq_local, head_dim] and of ``k``, ``v`` (kv_heads in place of heads)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}; it must be [batch, heads, seq_local, head_dim] "
                "(transpose a [batch, seq, heads, head_dim] tensor with .transpose(1, 2))"
            )
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; attention needs floating tensors")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if k.shape != v.shape:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"{op}: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    b, h, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"{op}: q has shape {tuple(q.shape)} and k {tuple(k.shape)}: batch, seq_local and head_dim must agree"
        )
    if h % k.shape[1]:
        raise ValueError(
            f"{op}: q has {h} heads, which k's {k.shape[1]} key/value heads do not divide (grouped-query "
            "attention shares each key/value head among an equal group of query heads)"
        )
    return Shapes(b, h, k.shape[1], s, d)


def default_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
