"""Small reference models shared by tests, examples and benchmarks.

:class:`TinyGPT` is a standard pre-LN decoder: token embedding, a learned position
embedding added in the top-level forward (glue between units, on purpose), a
``ModuleList`` of :class:`Block`, a final LayerNorm and an output head tied to the
token embedding. Attention is causal through a registered, non-persistent mask
buffer, so functionalizing it exercises buffers as well as tied weights.
:func:`mlp` builds a plain ``nn.Sequential``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Block", "CausalSelfAttention", "TinyGPT", "mlp"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "identity": nn.Identity,
}


def mlp(widths: Sequence[int], activation: str = "gelu") -> nn.Sequential:
    """``Linear(widths[0], widths[1]), act, ..., Linear(widths[-2], widths[-1])``.

    The activation sits between Linears, not after the last one, so the output is
    unbounded logits / regression values. ``activation`` is one of
    ``gelu, relu, silu, tanh, identity``.
    """
    if len(widths) < 2:
        raise ValueError(
            f"mlp needs at least an input and an output width, got widths={list(widths)}"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(_ACTIVATIONS)}")
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(widths)):
        if i > 0:
            layers.append(_ACTIVATIONS[activation]())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention masked by a registered lower-triangular buffer."""

    mask: Tensor

    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # Non-persistent: derived data, not a checkpointed weight; it still travels as a buffer.
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # Widths are read from the projections, not from d_model and n_heads: under tensor parallel
        # a rank's qkv computes its heads only (as Hugging Face's attention does).
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = mlp([d_model, 4 * d_model, d_model])

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases. torch's default N(0, 1)
    embedding makes the tied output head's first logits ~sqrt(d_model) large."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    """A small GPT: ``idx (batch, time) int64 -> logits (batch, time, vocab)``.

    Split it for the engine with ``functionalize(model, units=["tok_emb", "blocks", "head"])``
    or ``units=Block``; the position embedding and ``ln_f`` are glue that joins the
    neighbouring unit.
    """

    def __init__(
        self,
        vocab: int = 1024,
        d_model: int = 256,
        n_heads: int = 4,
        n_layers: int = 4,
        seq_len: int = 128,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Parameter(torch.randn(1, seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, seq_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(_gpt2_init)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok_emb(idx)
        # Read the length from x, not idx: only one value may cross a unit boundary.
        x = x + self.pos_emb[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
