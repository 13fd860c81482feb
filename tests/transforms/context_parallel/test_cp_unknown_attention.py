"""An attention context_parallel does not know, and whose class name does not end in ``Attention``.

It was left as it is: it attended over the rank's part of the sequence only, and the step trained
another model without an error (TinyGPT with a user's ``MHA`` in its second block, cp 2: loss off by
2e-3 relative at the first step, sdpa or eager). It is refused now by what it computes, at the Plan and
at the first step: a ``scaled_dot_product_attention``, or (eager) its causal mask made of the part's length
(``torch.ones(t, t).tril()``: a new tensor sized by it holds the part's positions) before the softmax of a
``[..., t, t]`` tensor, outside the attention context_parallel installed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import Block, CausalSelfAttention, TinyGPT


class MHA(nn.Module):
    def __init__(self, d: int, heads: int, eager: bool) -> None:
        super().__init__()
        self.heads, self.eager = heads, eager
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if self.eager:
            scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
            y = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ShortConv(nn.Module):
    """A causal depthwise convolution over time (Mamba-style token mixing): it mixes positions too."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding=2, groups=d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_an_attention_it_does_not_know_by_name_is_refused(eager: bool) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    model.blocks[1].attn = MHA(16, 2, eager).double()
    ids = torch.randint(0, 32, (2, 9))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    chain, params = sw.functionalize(model, units=Block)
    reference = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.context_parallel(reference, "cp")
    what = r"masks a \[4, 4\] tensor by the positions' places in the part \(tril\)" if eager else (
        "scaled_dot_product_attention")
    message = f"MHA in layer 'blocks.1' .*{what}.* outside the attentions it splits.*ring_attention"
    with pytest.raises(ValueError, match=message):
        step.plan(sw.Mesh(cp=2), params, batches[0])
    step = sw.context_parallel(reference, "cp")  # a fresh step: its layers watch their first call again
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.testing.assert_equivalent(step, reference, sw.Mesh(cp=2), batches, params, rtol=1e-12)
    # The model without it is split, and equal to one device.
    model.blocks[1].attn = type(model.blocks[0].attn)(16, 2, 8).double()
    chain, params = sw.functionalize(model, units=Block)
    reference = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.context_parallel(reference, "cp"), reference, sw.Mesh(cp=2), batches, params,
                                 rtol=1e-12)


def test_a_convolution_over_time_beside_a_known_attention_is_refused() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    model.blocks[1].mlp = ShortConv(16).double()  # the block's MLP slot: x + mlp(ln2(x))
    ids = torch.randint(0, 32, (2, 9))
    chain, params = sw.functionalize(model, units=Block)
    step = sw.context_parallel(sw.train_step(chain, _loss, sw.optim.sgd(0.1)), "cp")
    with pytest.raises(ValueError, match=r"Conv1d in layer 'blocks\.1' convolves .* with a kernel of 3"):
        step.plan(sw.Mesh(cp=2), params, (ids[:, :-1], ids[:, 1:]))


def test_a_gpt2_shaped_attention_whose_forward_is_not_gpt2s_is_refused() -> None:
    """GPT-2's attention was recognised by its parts (c_attn, c_proj, split_size) and its forward replaced: a
    subclass with a forward of its own (here: the output halved) lost it without an error (loss off by 2e-4
    relative), and GPT-BigCode's failed on an AttributeError. Only GPT2Attention's own forward is replaced."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Block

    class Halved(GPT2Attention):
        def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> tuple:
            out = super().forward(hidden_states, *args, **kwargs)
            return (out[0] * 0.5, *out[1:])

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(0, 64, (2, 17))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2

    def loss(out: object, targets: torch.Tensor) -> torch.Tensor:
        return _loss(out.logits, targets)  # type: ignore[attr-defined]

    chain, params = sw.functionalize(model, units=GPT2Block, example_input=batches[0][0])
    reference = sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.context_parallel(reference, "cp", positions=("wpe.weight",))
    sw.testing.assert_equivalent(step, reference, sw.Mesh(cp=2), batches, params, rtol=1e-12)
    for block in model.transformer.h:
        block.attn.__class__ = Halved
    chain, params = sw.functionalize(model, units=GPT2Block, example_input=batches[0][0])
    reference = sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"attn is a Halved .* not one context_parallel has checked"):
        sw.context_parallel(reference, "cp", positions=("wpe.weight",))


class _FixedTableGPT(TinyGPT):
    """TinyGPT whose position table is a fixed sinusoidal buffer, read at rows 0 .. t - 1."""

    pos_table: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        d = self.pos_emb.shape[-1]
        at = torch.arange(self.seq_len, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("pos_table", torch.cat([at.sin(), at.cos()], dim=1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_table[: idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_a_fixed_position_table_is_read_at_global_positions_or_refused() -> None:
    """A buffer table (sinusoidal) was read at the rank's local rows 0 .. t/n - 1 on every rank, without an
    error (loss off by 2e-3 relative): positions= only looked at parameters. Listed, it is read at the
    rank's global positions; named like a table and not listed, it is refused, as a parameter is."""
    torch.manual_seed(0)
    model = _FixedTableGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    ids = torch.randint(0, 32, (2, 9))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    chain, params = sw.functionalize(model, units=Block, example_input=batches[0][0])
    reference = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"has the buffer 'pos_table', named like a fixed position table"):
        sw.context_parallel(reference, "cp")
    step = sw.context_parallel(reference, "cp", positions=("pos_emb", "pos_table"))
    sw.testing.assert_equivalent(step, reference, sw.Mesh(cp=2), batches, params, rtol=1e-12)


class _OwnCausalAttention(nn.Module):
    """A user's causal attention with TinyGPT's parts (qkv, proj, head_dim, a tril mask buffer) and a forward
    of its own: muP's 1/head_dim scale, Gemma-2's soft-capped scores, or rotary positions applied inline."""

    def __init__(self, d: int, heads: int, t: int, kind: str) -> None:
        super().__init__()
        self.head_dim, self.kind = d // heads, kind
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("mask", torch.ones(t, t, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        mask = self.mask[:t, :t]
        if self.kind == "rope":
            inverse = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2, dtype=x.dtype) / self.head_dim)
            angles = torch.outer(torch.arange(t, dtype=x.dtype), inverse)
            cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
            half = self.head_dim // 2
            q, k = (z * cos + torch.cat([-z[..., half:], z[..., :half]], -1) * sin for z in (q, k))
        if self.kind == "softcap":
            scores = 5.0 * torch.tanh((q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim) / 5.0)
            y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            scale = 1.0 / self.head_dim if self.kind == "mup" else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _MuPAttention(CausalSelfAttention):
    """TinyGPT's own attention, subclassed with a forward at muP's scale (no module of its own added)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t], scale=1.0 / self.head_dim)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _Renamed(CausalSelfAttention):
    """TinyGPT's attention under another name, its forward the class's own: still split."""


@pytest.mark.parametrize("kind", ["mup", "softcap", "rope", "subclass"])
def test_an_attention_shaped_like_tinygpts_whose_forward_is_its_own_is_refused(kind: str) -> None:
    """An attention with TinyGPT's parts was recognised by them alone and its forward replaced by plain softmax
    attention at 1/sqrt(head_dim): a muP scale, a soft cap or an inline RoPE was dropped without an error (loss
    off by 3e-5, 9e-7, 5e-4 relative at cp 2). Only shardwise's CausalSelfAttention's own forward is replaced;
    a subclass that keeps it is split, and equal to one device."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=16).double()
    for block in model.blocks:
        block.attn = (_MuPAttention(16, 4, 16) if kind == "subclass" else _OwnCausalAttention(16, 4, 16, kind)).double()
    chain, _ = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    name = "_MuPAttention" if kind == "subclass" else "_OwnCausalAttention"
    with pytest.raises(ValueError, match=rf"blocks\.0: blocks\.0\.attn is a {name} \(from {__name__}\) shaped like "
                                         r"TinyGPT's attention .* would be dropped without an error.*leave "
                                         r"context_parallel out"):
        sw.context_parallel(step, "cp")
    for block in model.blocks:
        block.attn = _Renamed(16, 4, 16).double()
    ids = torch.randint(0, 32, (2, 17))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    chain, params = sw.functionalize(model, units=Block)
    reference = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.context_parallel(reference, "cp"), reference, sw.Mesh(cp=2), batches, params,
                                 rtol=1e-12)
