"""Ops outside the attentions that mix or move the rank's positions, found by following the sequence dim.

The first-call watch (``unsplit.py``) refused only attention-like ops picked by a shape coincidence (a dim of
the part's length); a pooling over the tokens, a token shift, attention without softmax, a pooling or sort
along time trained another model without an error (TinyGPT, cp 2, float64, loss at the first step off by
1.7e-3 (mean over the tokens), 2.2e-3 (a token shift by F.pad), 6.2e-4 (linear attention) relative). Now the
sequence dim of the layer's inputs is followed op by op (``sequence_dims.py``) and those ops are refused,
naming the module and the op; ops that compute each position alone pass, whatever their shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT

Op = Callable[[torch.Tensor], torch.Tensor]


class Mixer(nn.Module):
    """A block's MLP slot computing ``op`` of its input [batch, t, d] beside a Linear."""

    def __init__(self, d: int, op: Op) -> None:
        super().__init__()
        self.op, self.proj = op, nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.op(x)


def _linear_attention(x: torch.Tensor) -> torch.Tensor:
    q, k, v = x.sigmoid(), x.tanh(), x
    return q @ (k.transpose(-2, -1) @ v) / x.shape[1]


def _einsum_attention(x: torch.Tensor) -> torch.Tensor:
    state = torch.einsum("btd,bte->bde", x.tanh(), x)
    return torch.einsum("btd,bde->bte", x.sigmoid(), state) / x.shape[1]


def _over_time(pool: Callable[[torch.Tensor], torch.Tensor]) -> Op:
    return lambda x: pool(x.transpose(1, 2)).transpose(1, 2)


# (id, op, what the refusal says it does)
MIXING: list[tuple[str, Op, str]] = [
    ("mean_over_tokens", lambda x: x.mean(dim=1, keepdim=True), r"takes mean of a \[2, 4, 16\] tensor along the"),
    ("max_over_tokens", lambda x: x.max(1).values.unsqueeze(1), "takes max of .* along the sequence"),
    ("sum_dim_minus_2", lambda x: x.sum(-2, keepdim=True), "takes sum of .* along the sequence"),
    ("std_over_tokens", lambda x: x.std(1, keepdim=True), "takes (std|var) of .* along the sequence"),
    ("logsumexp_over_tokens", lambda x: torch.logsumexp(x, 1, keepdim=True), "takes logsumexp of .* along the"),
    ("norm_over_tokens", lambda x: x.norm(dim=1, keepdim=True), "takes linalg_vector_norm of .* along the sequence"),
    ("shift_by_pad", lambda x: F.pad(x, (0, 0, 1, -1)), "pads a \\[2, 4, 16\\] tensor by \\[1, -1\\] along its dim 1"),
    ("shift_by_roll", lambda x: torch.roll(x, 1, dims=1), "rolls a \\[2, 4, 16\\] tensor"),
    ("shift_by_cat", lambda x: torch.cat([x[:, :1] * 0, x[:, :-1]], 1), r"slices a \[2, 4, 16\] tensor along"),
    ("narrow", lambda x: F.pad(x.narrow(1, 1, x.shape[1] - 1), (0, 0, 0, 1)), "slices .* along its dim 1"),
    # (exact under the balanced layout, whose chunks i and 2n - 1 - i mirror each other; off 2.7e-3 without it)
    ("flip", lambda x: x.flip(1), "flips a \\[2, 4, 16\\] tensor"),
    ("linear_attention", _linear_attention, "multiplies a .* contracting a dim that holds the part's positions"),
    ("einsum_attention", _einsum_attention, "multiplies a .* contracting a dim that holds the part's positions"),
    ("token_gram", lambda x: (x.transpose(1, 2) @ x).sum(-1).unsqueeze(1) / 100, "multiplies .* contracting"),
    ("avg_pool1d", _over_time(lambda y: F.avg_pool1d(y, 3, 1, 1)), "pools a .* with a window of 3"),
    ("max_pool1d", _over_time(lambda y: F.max_pool1d(y, 3, 1, 1)), "pools a .* with a window of 3"),
    ("interpolate", _over_time(lambda y: F.interpolate(F.interpolate(y, scale_factor=0.5, mode="linear"),
                                                       size=y.shape[-1], mode="linear")),
     "runs aten.upsample_linear1d, an op whose effect on the positions is not known"),
    ("sort", lambda x: x.sort(1).values, "takes sort of .* along the sequence"),
    ("topk", lambda x: x.topk(2, dim=1).values.sum(1, keepdim=True), "takes topk of .* along the sequence"),
    ("mean_of_everything_used_in_the_layer", lambda x: x * x.mean(), "computes aten.mul of a mean over every element"),
    ("argmax", lambda x: x.argmax(1, keepdim=True).to(x.dtype), "takes argmax of .* along the sequence"),
]


def _step(op: Op, d_model: int = 16, n_heads: int = 2) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=d_model, n_heads=n_heads, n_layers=2, seq_len=8).double()
    model.blocks[1].mlp = Mixer(d_model, op).double()
    ids = torch.randint(0, 32, (2, 2, 9), generator=torch.Generator().manual_seed(1))
    batches = [(x[:, :-1], x[:, 1:]) for x in ids]
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    return step, params, batches


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in MIXING])
def test_an_op_mixing_the_positions_outside_the_attentions_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=f"Mixer in layer 'blocks.1' {what}.* outside the attentions it splits"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def test_a_mixing_op_is_refused_at_the_first_step_too() -> None:
    step, params, batches = _step(MIXING[0][1])
    with pytest.raises(sw.collectives.RankFailed, match=r"Mixer in layer 'blocks\.1' takes mean"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def _folded(x: torch.Tensor) -> torch.Tensor:
    """OPT-style: (batch, seq) folded into rows, a row-wise op, and unfolded."""
    b, t, d = x.shape
    rows = x.reshape(-1, d)
    return F.layer_norm(rows * rows.softmax(-1), (d,)).view(b, t, d)


# Each computes every position alone: equal to one device. d_model 4 = the part's length (seq 8, cp 2): ops over
# the hidden dim have a dim of the part's length, which a shape test would take for the sequence.
POSITION_WISE: list[tuple[str, Op, int]] = [
    ("fold_batch_and_seq_into_rows", _folded, 16),
    ("norms_over_hidden_of_the_parts_length", lambda x: x / x.norm(dim=-1, keepdim=True) + x.cumsum(-1) / 4
     + x.softmax(-1) + x.std(-1, keepdim=True), 4),
    ("reduction_over_the_batch", lambda x: x.mean(0, keepdim=True) + x.amax(0), 16),
    ("products_over_the_hidden_dim", lambda x: torch.einsum("btd,bte->bte", x, x.tanh()) + x @ torch.ones(
        x.shape[-1], x.shape[-1], dtype=x.dtype) / 16, 16),
    ("pools_of_one_position", _over_time(lambda y: F.avg_pool1d(y, 1) + F.max_pool1d(y, 1)), 16),
]


@pytest.mark.parametrize(("op", "d_model"), [pytest.param(op, d, id=name) for name, op, d in POSITION_WISE])
def test_an_op_computing_each_position_alone_is_split(op: Op, d_model: int) -> None:
    step, params, batches = _step(op, d_model, n_heads=2)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                 rtol=1e-12)


def _routed_by_position_value(x: torch.Tensor) -> torch.Tensor:
    """A router's tokens (``torch.where``: nonzero) taken and put back, weighted by their positions' values."""
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    (tok,) = torch.where(flat[:, 0] == flat[:, 0])
    return torch.zeros_like(flat).index_add(0, tok, flat[tok] * (tok % t).to(x.dtype)[:, None] / 8).view(b, t, d)


def test_computing_with_the_values_of_a_routers_token_index_is_refused() -> None:
    # (tok % t: this rank's local positions as numbers; off 7.6e-4 relative before it was refused)
    step, params, batches = _step(_routed_by_position_value)
    with pytest.raises(ValueError, match=r"Mixer in layer 'blocks\.1' computes aten\.remainder with the values of an "
                                         "index made by nonzero"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


class _AuxBlock(nn.Module):
    """A block that adds a mean over every element of its output to a carried auxiliary loss term."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(16, 2, 8)

    def forward(self, carry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.block(carry[0])
        return h, carry[1] + 0.5 * (h * h).mean()


class _AuxModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(32, 16), nn.ModuleList([_AuxBlock(), _AuxBlock()]), nn.Linear(
            16, 32)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        carry = (self.emb(idx), idx.new_zeros((), dtype=torch.float64))
        for block in self.blocks:
            carry = block(carry)
        return self.head(carry[0]), carry[1]


def _aux_step(tokens: Callable[..., torch.Tensor] | None) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(_AuxModel().double(), units=_AuxBlock)
    ids = torch.randint(0, 32, (2, 2, 9), generator=torch.Generator().manual_seed(1))
    batches = []
    for x in ids:
        targets = x[:, 1:].clone()
        if tokens is not None:
            targets[:, -3:] = -100  # padding: the ranks' parts hold 4 and 1 counted tokens
        batches.append((x[:, :-1], targets))

    def loss(o: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o[0].flatten(0, 1), t.flatten(), ignore_index=-100) + o[1]

    return sw.train_step(chain, loss, sw.optim.sgd(0.1), tokens=tokens), params, batches


def test_a_pooled_loss_term_under_a_token_weighted_step_is_refused() -> None:
    # (each rank's mean of its part weighed by its own count: loss off 6e-3 relative before it was refused)
    step, params, batches = _aux_step(lambda inputs, targets: (targets != -100).sum())
    with pytest.raises(ValueError, match=r"layer 'blocks\.0' returns a mean over every element .* "
                                         r"train_step\(tokens=\.\.\.\) weighs each rank's loss"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def test_a_pooled_loss_term_under_a_mean_loss_is_split() -> None:
    step, params, batches = _aux_step(None)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


@pytest.mark.parametrize(("op", "method"), [
    pytest.param(lambda x: x * torch.tensor(x.detach().tolist(), dtype=x.dtype).roll(1, 1), "tolist", id="tolist"),
    pytest.param(lambda x: x * torch.from_numpy(x.detach().numpy()).roll(1, 1), "numpy", id="numpy"),
])
def test_reading_the_positions_values_out_of_torch_is_refused(op: Op, method: str) -> None:
    # (a token shift on the values read back: loss off 1.8e-4 relative before it was refused)
    step, params, batches = _step(op)
    with pytest.raises(sw.collectives.RankFailed,
                       match=rf"Mixer in layer 'blocks\.1' reads the values of a \[2, 4, 16\] tensor .*"
                             rf" \(Tensor\.{method}\)"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


class _SeqFirstBlock(nn.Module):
    """A Megatron-style block: activations [t, batch, d] between the layers, a summary over the tokens (dim 0)."""

    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.block, self.proj, self.mix = Block(16, 2, 8), nn.Linear(16, 16), mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x.transpose(0, 1)).transpose(0, 1)
        return y + self.proj(y.mean(0, keepdim=True)) if self.mix else y


class _SeqFirstModel(nn.Module):
    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList([_SeqFirstBlock(False), _SeqFirstBlock(mix)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x.transpose(0, 1))


def _seq_first_step(mix: bool, batch: int) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(_SeqFirstModel(mix).double(), units=_SeqFirstBlock)
    ids = torch.randint(0, 32, (2, batch, 9), generator=torch.Generator().manual_seed(1))
    step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    return step, params, [(x[:, :-1], x[:, 1:]) for x in ids]


@pytest.mark.parametrize("batch", [2, 4])  # 4: the batch dim has the part's length, as the sequence would
def test_a_seq_first_layer_mixing_the_tokens_is_refused(batch: int) -> None:
    # The layers' inputs hold the tokens on dim 0: the previous layer's output tags say so (the part's length on
    # dim 1 tagged nothing, or the batch); off 6.6e-4 (batch 2) and 3.1e-3 (batch 4) relative before.
    step, params, batches = _seq_first_step(True, batch)
    with pytest.raises(sw.collectives.RankFailed, match=rf"_SeqFirstBlock in layer 'blocks\.1' takes mean of a "
                                                          rf"\[4, {batch}, 16\] tensor along the sequence \(its dim 0"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


@pytest.mark.parametrize("batch", [2, 4])
def test_a_seq_first_model_computing_each_token_alone_is_split(batch: int) -> None:
    step, params, batches = _seq_first_step(False, batch)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


class _LatentBlock(nn.Module):
    """Carries a latent array ``[b, 3, d]`` (no positions: a prefix, a memory) first, beside the hidden states."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.block, self.proj, self.pool = Block(16, 2, 8), nn.Linear(16, 16), pool

    def forward(self, carry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        latent, h = carry
        if self.pool == "latent":  # a mean over the latent array's rows: each rank holds all of them
            h = h + self.proj(latent).mean(1, keepdim=True)
        h = self.block(h)
        if self.pool == "tokens":
            h = h + h.mean(1, keepdim=True)
        return latent, h


class _LatentModel(nn.Module):
    def __init__(self, pool: str) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.latent = nn.Parameter(torch.randn(1, 3, 16) * 0.1)
        self.blocks = nn.ModuleList([_LatentBlock(pool), _LatentBlock(pool)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        carry = (self.latent.expand(idx.shape[0], 3, 16), self.emb(idx))
        for block in self.blocks:
            carry = block(carry)
        return self.head(carry[1])


def _latent_step(pool: str) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(_LatentModel(pool).double(), units=_LatentBlock)
    ids = torch.randint(0, 32, (2, 2, 9), generator=torch.Generator().manual_seed(1))
    step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    return step, params, [(x[:, :-1], x[:, 1:]) for x in ids]


def test_a_latent_array_before_the_hidden_states_is_no_sequence() -> None:
    # The part's length was read off the first input leaf, the latent array's 3: its mean was refused as one over
    # the sequence (a false refusal), and a mean over the hidden states' tokens passed (2.7e-2 off before the
    # tags were handed from layer to layer). The length is now a handed-over sequence dim's.
    step, params, batches = _latent_step("latent")
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)
    step, params, batches = _latent_step("tokens")
    with pytest.raises(sw.collectives.RankFailed, match=r"_LatentBlock in layer 'blocks\.0' takes mean of a "
                                                          r"\[2, 4, 16\] tensor along the sequence \(its dim 1"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def _token_mixing_mlp(x: torch.Tensor) -> torch.Tensor:
    # MLP-Mixer's token mixing: a matrix over the whole sequence (8 tokens), applied along the sequence dim
    return (x.transpose(1, 2) @ torch.full((8, 8), 1 / 8, dtype=x.dtype)).transpose(1, 2)


def test_an_op_sized_by_the_whole_sequence_fails_saying_why() -> None:
    # It fails on the part's shapes in torch itself (no silent result); the error now says it is the part's.
    step, params, batches = _step(_token_mixing_mlp)
    with pytest.raises(RuntimeError, match=r"context_parallel: aten\.\w+ failed on a \[2, 16, 4\] tensor whose dim 2 "
                                           r"holds this rank's part of the sequence only.*token-mixing Linear"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
