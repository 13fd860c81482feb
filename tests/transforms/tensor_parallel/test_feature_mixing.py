"""Ops across a Colwise output's features before any per-head view (feature_mixing.py, split_watch.py).

Each refused case trained silently before: a norm, softmax, mean or cumulative sum with no parameter
over q's features, taken on a rank's 16 of 32 features (losses apart by ~1e-3 from step 1, no
parameter's gradient to show it), and single-head attention contracting q's and k's features (each
rank a partial sum of the scores). Each is refused by the Plan's prediction, inside a Region and
without one. The look-alikes, the same ops per head after the view and reductions over other dims,
are compared with the single-device step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

from .conftest import two_blocks_problem

D, HEADS, VOCAB = 32, 4, 16

# What the module does to q (and k) before viewing them per head: each over this rank's features only.
_BEFORE_THE_VIEW = {
    "normalize": lambda z: F.normalize(z, dim=-1),
    "divide_by_norm": lambda z: z / z.norm(dim=-1, keepdim=True),
    "rms_norm": lambda z: F.rms_norm(z, (z.shape[-1],)),
    "layer_norm": lambda z: F.layer_norm(z, z.shape[-1:]),
    "softmax": lambda z: z.softmax(-1),
    "centred": lambda z: z - z.mean(-1, keepdim=True),
    "cumsum": lambda z: z.cumsum(-1) / D,
    "scaled_by_max": lambda z: z / z.abs().amax(),
    # (a review's list, each silent at first: the op tables grew by them)
    "var_mean": lambda z: z - torch.var_mean(z, -1, keepdim=True)[1],
    "softmin": lambda z: F.softmin(z, -1),
    "nansum": lambda z: z - z.nansum(-1, keepdim=True) / D,
    "logcumsumexp": lambda z: torch.logcumsumexp(z, -1),
    "cummax": lambda z: torch.cummax(z, -1)[0],
    "aminmax": lambda z: z / torch.aminmax(z.abs(), dim=-1, keepdim=True)[1],
    "diff": lambda z: torch.cat([z[..., :1], torch.diff(z, dim=-1)], -1),
    "renorm_over_rows": lambda z: torch.renorm(z, 2, 0, 1.0),
    "local_response_norm": lambda z: F.local_response_norm(z.transpose(1, 2), 3).transpose(1, 2),
    "fft": lambda z: torch.fft.fft(z, dim=-1).real,
    # (an audit walking torch.overrides' functions: each silent at first, and refused since)
    "quantile": lambda z: z - torch.quantile(z, 0.5, dim=-1, keepdim=True),
    "kthvalue": lambda z: z - torch.kthvalue(z, 2, -1, keepdim=True)[0],
    "count_nonzero": lambda z: z * torch.count_nonzero(z > 0, -1).unsqueeze(-1) / D,
    "trapezoid": lambda z: z - torch.trapezoid(z, dim=-1).unsqueeze(-1) / D,
    "matrix_norm": lambda z: z / torch.linalg.matrix_norm(z).view(-1, 1, 1),
    "tril": lambda z: z.tril(),
    "fftshift": lambda z: torch.fft.fftshift(z, dim=-1),
    "fftn": lambda z: torch.fft.fftn(z).real,
    "index_select_permutation": lambda z: z.index_select(-1, torch.arange(z.shape[-1]).flip(0)),
    "gather_permutation": lambda z: z.gather(-1, torch.arange(z.shape[-1]).roll(1).expand(z.shape)),
    "index_permutation": lambda z: z[..., torch.arange(z.shape[-1]).flip(0)],
    "rotate_half_before_the_view": lambda z: torch.cat((-z[..., z.shape[-1] // 2:], z[..., : z.shape[-1] // 2]), -1),
    "scaled_by_its_first_feature": lambda z: z * z[..., :1],
    "repeat": lambda z: z.repeat(1, 1, 2)[..., ::2],
    "pad": lambda z: F.pad(z, (1, 0))[..., :-1],
    "conv1d_over_the_features": lambda z: F.conv1d(
        z.reshape(-1, 1, z.shape[-1]), torch.full((1, 1, 3), 1 / 3, dtype=z.dtype), padding=1).view_as(z),
    "avg_pool_over_the_features": lambda z: F.avg_pool1d(z, 3, 1, 1),
    "interpolate": lambda z: F.interpolate(z, scale_factor=2.0, mode="linear")[..., ::2],
    "instance_norm": lambda z: F.instance_norm(z),
    "batch_norm_over_the_features": lambda z: F.batch_norm(z, None, None, training=True),
    "sum_to_size": lambda z: z - z.sum_to_size(z.shape[0], z.shape[1], 1) / D,
    "mse_loss_term": lambda z: z * F.mse_loss(z, torch.zeros_like(z)),
    "cat_of_two_halves": lambda z: torch.cat([z, z], -1)[..., ::2],
    # ops along another dim, whose output the watch now follows on to the op across the features
    "normalised_mean_over_the_sequence": lambda z: z * F.normalize(z.mean(1), dim=-1).unsqueeze(1),
    "sequence_softmax_then_normalised": lambda z: F.normalize(z.softmax(1), dim=-1),
    "features_moved_then_flipped": lambda z: z.movedim(-1, 0).flip(0).movedim(0, -1),
    "channel_shuffle_of_the_transpose": lambda z: F.channel_shuffle(
        z.transpose(1, 2).unsqueeze(-1), 2).squeeze(-1).transpose(1, 2),
    "unsqueezed_then_averaged": lambda z: z - z.unsqueeze(-1).mean(-2),
    "unsqueezed_by_keyword_then_averaged": lambda z: z - z.unsqueeze(dim=-1).mean(-2),
    "weight_norm_of_every_dim": lambda z: z / torch.norm_except_dim(z, 2, -1),
}
_BEFORE_THE_VIEW_CUTS = {
    "dsplit": lambda z: torch.cat(torch.dsplit(z, 2)[::-1], -1),
    "unsafe_chunk": lambda z: torch.cat(z.unsafe_chunk(2, -1)[::-1], -1),
}
# Across the heads of the per-head view (b, heads, t, head_dim): over a rank's heads only.
_ACROSS_HEADS = {
    "centred_over_heads": lambda z: z - z.mean(1, keepdim=True),
    "norm_over_heads_and_dim": lambda z: F.layer_norm(z.transpose(1, 2), z.transpose(1, 2).shape[-2:]).transpose(1, 2),
    "softmax_over_heads": lambda z: z.softmax(1),
}
# On the heads merged back into the rank's width (b, t, heads x head_dim), before the Rowwise.
_AFTER_THE_MERGE = {
    "rms_norm": lambda y: F.rms_norm(y, y.shape[-1:]),
    "layer_norm": lambda y: F.layer_norm(y, y.shape[-1:]),
    "softmax": lambda y: y.softmax(-1),
}
# The same kinds of ops on the per-head view (b, heads, t, head_dim), or over another dim: right on a rank.
_LOOK_ALIKES = {
    "normalize_per_head": lambda z: F.normalize(z, dim=-1),
    "rms_norm_per_head": lambda z: F.rms_norm(z, (z.shape[-1],)),
    "centred_per_head": lambda z: z - z.mean(-1, keepdim=True),
    "over_the_sequence": lambda z: z - z.mean(2, keepdim=True),
    "quantile_per_head": lambda z: z - torch.quantile(z, 0.5, dim=-1, keepdim=True),
    "index_permutation_per_head": lambda z: z[..., torch.arange(z.shape[-1]).flip(0)],
    "rotate_half_per_head": lambda z: torch.cat((-z[..., z.shape[-1] // 2:], z[..., : z.shape[-1] // 2]), -1),
    "pad_per_head": lambda z: F.pad(z, (1, 0))[..., :-1],
    "matrix_norm_per_head": lambda z: z / torch.linalg.matrix_norm(z, keepdim=True),
    "cumsum_over_the_sequence": lambda z: z.cumsum(2) / 6,
}
# Before the view, along another dim than the features (or every feature on its own): right on a rank.
_OTHER_DIMS = {
    "pooled_gate": lambda z: z * z.mean(1).sigmoid().unsqueeze(1),
    "reversed_tokens": lambda z: z[:, torch.arange(z.shape[1]).flip(0)],
    "tokens_index_selected": lambda z: z.index_select(1, torch.arange(z.shape[1]).flip(0)),
    "cumsum_over_the_sequence": lambda z: z.cumsum(1) / 6,
    "sorted_over_the_sequence": lambda z: z.sort(1).values,
    "interleaved_rotation": lambda z: torch.stack((-z[..., 1::2], z[..., ::2]), -1).flatten(-2),
    "padded_sequence": lambda z: F.pad(z, (0, 0, 1, 0))[:, :-1],
    "depthwise_conv_over_the_sequence": lambda z: F.conv1d(
        z.transpose(1, 2), torch.full((z.shape[-1], 1, 3), 1 / 3, dtype=z.dtype), padding=1, groups=z.shape[-1]
    ).transpose(1, 2),
    "batch_norm_per_feature": lambda z: F.batch_norm(z.transpose(1, 2), None, None, training=True).transpose(1, 2),
    "elementwise_loss_term": lambda z: z + 0.1 * F.mse_loss(z, 0.5 * z.detach(), reduction="none"),
    "halves_of_the_sequence_swapped": lambda z: torch.cat(torch.hsplit(z, 2)[::-1], 1),
    "nearest_upsampled_features": lambda z: F.interpolate(z, scale_factor=2.0)[..., ::2],
}


class _Attention(nn.Module):
    """Multi-head attention applying ``before`` to q and k before the view, ``per_head`` or ``across`` after
    it, ``merged`` to the heads merged back; ``single``: one head of all the features, its scores computed as
    named (never viewed per head)."""

    def __init__(
        self, before: str = "", per_head: str = "", single: str = "", across: str = "", merged: str = "",
        other: str = "",
    ) -> None:
        super().__init__()
        self.before, self.per_head, self.single, self.across, self.merged = before, per_head, single, across, merged
        self.other = other
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.single:
            return self.o(_single_head(self.single, q, k, v))
        if self.before:
            before = _BEFORE_THE_VIEW.get(self.before) or _BEFORE_THE_VIEW_CUTS[self.before]
            q, k = before(q), before(k)
        if self.other:
            q, k = _OTHER_DIMS[self.other](q), _OTHER_DIMS[self.other](k)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.per_head:
            q, k = _LOOK_ALIKES[self.per_head](q), _LOOK_ALIKES[self.per_head](k)
        if self.across:
            q, k = _ACROSS_HEADS[self.across](q), _ACROSS_HEADS[self.across](k)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)).softmax(-1)  # per head: right
        y = torch.maximum(scores @ v, 0.5 * v).transpose(1, 2).reshape(b, t, -1)  # elementwise; heads merged
        return self.o(_AFTER_THE_MERGE[self.merged](y) if self.merged else y)


def _single_head(how: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if how == "cdist":
        return (-torch.cdist(q, k)).softmax(-1) @ v
    if how == "linear_attention":  # q @ (k^T v): features by features, of which a rank holds one block
        return q @ (k.transpose(-1, -2) @ v) / (D * 6)
    if how == "einsum_linear_attention":
        return torch.einsum("btd,bde->bte", q, torch.einsum("bsd,bse->bde", k, v)) / (D * 6)
    if how == "vecdot":  # (q.unsqueeze(2) would read as a view of a rank's one head)
        return torch.linalg.vecdot(q.unsqueeze(1), k.unsqueeze(2)).transpose(-1, -2).softmax(-1) @ v
    if how == "tensordot":
        scores = torch.stack([torch.tensordot(q[i], k[i], dims=([1], [1])) for i in range(q.shape[0])])
    elif how == "einsum":
        scores = torch.einsum("btd,bsd->bts", q, k)
    else:
        scores = torch.bmm(q, k.transpose(1, 2)) if how == "bmm" else q @ k.transpose(-1, -2)
    return (scores / math.sqrt(D)).softmax(-1) @ v


def _problem(**attention: Any) -> tuple[sw.Step, Any, list[Any]]:
    return two_blocks_problem(lambda: _Attention(**attention), D)


_PAIR = {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}
_REGION = {"*.attn": sw.tp.Region(heads=("n_heads",)), **_PAIR}
_PLANS = pytest.mark.parametrize("plan", [_REGION, _PAIR], ids=["region", "no-region"])


def _refused(plan: dict[str, Any], message: str, **attention: Any) -> None:
    step, params, batches = _problem(**attention)
    with pytest.raises(ValueError, match=message):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


@_PLANS
@pytest.mark.parametrize("before", sorted(_BEFORE_THE_VIEW))
def test_a_reduction_or_norm_over_the_features_before_the_view_is_refused(before: str, plan: dict[str, Any]) -> None:
    _refused(plan, r"Colwise\(\) on '0\.attn\.q' gives each rank a contiguous 1/tp of its output features \(16 of 32 "
             r"here\), and the module computes .*before any per-head view: over this rank's slice of the features "
             r"alone.*after viewing the output per head.*Colwise\(output='replicated'\) on '0\.attn\.q'", before=before)


@_PLANS
@pytest.mark.parametrize("across", sorted(_ACROSS_HEADS))
def test_an_op_across_the_heads_of_the_per_head_view_is_refused(across: str, plan: dict[str, Any]) -> None:
    _refused(plan, r"Colwise\(\) on '0\.attn\.q' gives each rank whole heads, 1/tp of them .* of its per-head view: "
             r"over this rank's heads alone", across=across)


@_PLANS
@pytest.mark.parametrize("merged", sorted(_AFTER_THE_MERGE))
def test_a_norm_or_softmax_of_the_heads_merged_back_before_the_rowwise_is_refused(
    merged: str, plan: dict[str, Any]
) -> None:
    """A weightless sub-norm of the merged attention output before o_proj: a rank's heads' features only."""
    _refused(plan, r"Colwise\(\) on '0\.attn\.v' .* after merging its heads back: over this rank's slice of the "
             r"features alone", merged=merged)


@_PLANS
@pytest.mark.parametrize("single", ["matmul", "bmm", "einsum", "sdpa", "cdist", "tensordot", "linear_attention",
                                    "einsum_linear_attention", "vecdot"])
def test_single_head_attention_contracting_two_colwise_outputs_is_refused(single: str, plan: dict[str, Any]) -> None:
    """q @ k.transpose(-1, -2) on a rank's 16 features of each: a partial sum of the scores, never summed."""
    what = {"einsum": r"einsum\('btd,bsd->bts'\) summing out its features",
            "sdpa": "scaled_dot_product_attention of q and k never viewed per head",
            "cdist": r"cdist of its features with those of '0\.attn\.k'",
            "tensordot": r"tensordot of its features with those of '0\.attn\.k'",
            "linear_attention": r"matmul of its features by those of '0\.attn\.v'.*a rank holds the products of its "
                                r"slices alone",
            "einsum_linear_attention": r"einsum\('bsd,bse->bde'\) of its features \(the letter 'd'\) by those of "
                                       r"'0\.attn\.v'",
            "vecdot": r"linalg_vecdot over dim -1, which holds its features"}.get(
        single, r"\w+ contracting its features with those of '0\.attn\.k'")
    who = "k" if "linear_attention" in single else "q"  # k.transpose(-1, -2) @ v comes first
    _refused(plan, rf"Colwise\(\) on '0\.attn\.{who}' .* computes {what}", single=single)


@_PLANS
@pytest.mark.parametrize("per_head", sorted(_LOOK_ALIKES))
def test_the_same_ops_per_head_or_over_the_sequence_are_the_single_device_step(
    per_head: str, plan: dict[str, Any]
) -> None:
    """Qwen3's q_norm normalises each head's features after the view: whole heads on a rank."""
    step, params, batches = _problem(per_head=per_head)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


@_PLANS
@pytest.mark.parametrize("other", sorted(_OTHER_DIMS))
def test_ops_along_another_dim_before_the_view_are_the_single_device_step(other: str, plan: dict[str, Any]) -> None:
    """A mean, sort, gather or pad over the sequence, a depthwise conv and a batch norm per feature, strided
    slices pairing features within a rank: each feature on its own, as on one device."""
    step, params, batches = _problem(other=other)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


@_PLANS
@pytest.mark.parametrize("split", sorted(_BEFORE_THE_VIEW_CUTS))
def test_a_split_of_the_features_along_a_fixed_dim_is_refused(split: str, plan: dict[str, Any]) -> None:
    """torch.dsplit(q, 2) (or unsafe_chunk) cuts q's features in two, as chunk(2, -1) does: on a rank, halves of
    its slice."""
    _refused(plan, r"Colwise\(\) on '0\.attn\.q' .* cuts that output into parts along them \((tensor_split|chunk)\): "
             r"this rank's 16 features into \[8, 8\]", before=split)


class _LogProbsHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(x), dim=-1)


def test_a_head_normalising_its_split_logits_in_the_model_is_refused() -> None:
    """log_softmax over a rank's 8 of 16 logits: each rank's slice summed to one, the loss taken from them wrong."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(D, D), _LogProbsHead()).double())
    step = sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, D, dtype=torch.float64, generator=gen), torch.randint(VOCAB, (4,), generator=gen))
    with pytest.raises(ValueError, match=r"Colwise\(\) on '1\.proj' .*\(8 of 16 here\), and the module computes "
                                         r"log_softmax over dim -1.*vocab_parallel_cross_entropy"):
        sw.tensor_parallel(step, "tp", {"1.proj": sw.tp.Colwise()}).plan(sw.Mesh(tp=2), params, batch)
