"""Small reference models shared by tests, examples and benchmarks.

:class:`TinyGPT` is a standard pre-LN decoder: token embedding, a learned position
embedding added in the top-level forward (glue between units, on purpose), a
``ModuleList`` of :class:`Block`, a final LayerNorm and an output head tied to the
token embedding. Attention is causal through a registered, non-persistent mask
buffer, so functionalizing it exercises buffers as well as tied weights.
:func:`mlp` builds a plain ``nn.Sequential``. :class:`TopKMoE` is a top-k mixture of experts in
Hugging Face Mixtral's layout (router ``gate``, fused 3-D ``experts``), and :class:`MoEBlock` a pre-LN
transformer block whose MLP it is.
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


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as fused 3-D weights, as HF's ``MixtralExperts`` stores them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) * hidden**-0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, intermediate) * intermediate**-0.5)

    def expert(self, e: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class TopKMoE(nn.Module):
    """A top-k mixture of experts on one device: ``x [..., hidden] -> [..., hidden]``.

    The router is HF Mixtral's: softmax over the experts, the top ``top_k``, renormalized to sum to one
    when ``normalize`` (Qwen2-MoE's ``norm_topk_prob``). Every token reaches every expert it chose (no
    capacity). The forward is the plain loop over experts HF writes, the reference that expert
    parallel is checked against; ``router_logits(x)`` gives what the auxiliary loss needs.

    >>> import torch
    >>> from shardwise.testing.models import TopKMoE
    >>> moe = TopKMoE(hidden=8, intermediate=16, num_experts=4, top_k=2)
    >>> moe(torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.top_k, self.normalize = top_k, normalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, intermediate)

    def router_logits(self, x: Tensor) -> Tensor:
        return self.gate(x.reshape(-1, x.shape[-1]))

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router_logits(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.gate.out_features):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out = out.index_add(0, token, self.experts.expert(e, flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class MoEBlock(nn.Module):
    """Pre-LN transformer block with a :class:`TopKMoE` as its MLP: ``x + attn(ln1(x))`` then ``x + moe(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.moe = TopKMoE(d_model, 2 * d_model, num_experts, top_k)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))
