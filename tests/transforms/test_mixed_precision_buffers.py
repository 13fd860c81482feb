"""mixed_precision and what is not a parameter: buffers keep their dtype (``buffers=compute`` casts
them, as before), a layer that a kept buffer breaks says so, and inputs that need no gradient (masks)
are cast saturating."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shardwise as sw
from shardwise.engine.layout.precision import Policy
from shardwise.engine.model.chain import Chain, Layer
from shardwise.transforms.mixed_precision.cast import saturating_cast

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# -- the policy grammar ----------------------------------------------------------------------------


def test_the_buffers_key_reads_keep_or_compute() -> None:
    assert Policy.parse("compute=bf16").buffers == "keep"
    assert Policy.parse("compute=bf16,buffers=compute") == Policy(F32, BF16, BF16, F32, "compute")
    assert Policy.parse("c=bf16, b=keep") == Policy(F32, BF16, BF16, F32)
    base = Policy.parse("compute=bf16,buffers=compute")
    assert Policy.parse("compute=f32", base=base).buffers == "compute"  # an override keeps the base's
    assert Policy.parse("buffers=keep", base=base) == dataclasses.replace(base, buffers="keep")
    with pytest.raises(ValueError, match=r"buffers='bf16'; use buffers=keep .* or buffers=compute"):
        Policy.parse("buffers=bf16")
    with pytest.raises(ValueError, match=r"Policy\(buffers='all'\)"):
        Policy(buffers="all")
    with pytest.raises(ValueError, match="buffers is given twice"):
        Policy.parse("buffers=keep,b=compute")


_DTYPE_NAMES = st.sampled_from(["f64", "f32", "bf16", "f16"])


@given(params=_DTYPE_NAMES, compute=_DTYPE_NAMES, output=_DTYPE_NAMES, reduce=_DTYPE_NAMES,
       buffers=st.sampled_from(["keep", "compute"]))
def test_policies_round_trip_through_text_and_pickle(params: str, compute: str, output: str, reduce: str,
                                                     buffers: str) -> None:
    policy = Policy.parse(f"params={params},compute={compute},output={output},reduce={reduce},buffers={buffers}")
    assert Policy.parse(str(policy)) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.buffers = "compute"  # type: ignore[misc]


def test_a_policy_pickled_before_the_buffers_field_loads_as_keep() -> None:
    """A Policy pickled by an older shardwise has no ``buffers`` in its state: it loads with the default."""
    policy = Policy.parse("compute=bf16")
    state = dict(policy.__dict__)
    del state["buffers"]
    old = Policy.__new__(Policy)
    old.__dict__.update(state)
    assert pickle.loads(pickle.dumps(old)) == policy


# -- buffers keep their dtype ----------------------------------------------------------------------


def _position_chain(seen: dict[str, torch.dtype]) -> tuple[Chain, dict[str, dict[str, torch.Tensor]]]:
    """A sinusoidal position layer reading float positions (as Hugging Face's rotary reads inv_freq):
    computed in f32, then cast to the activations' dtype."""
    n, d = 1024, 8

    def positions(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        seen["pos"] = tensors["pos"].dtype
        angle = tensors["pos"][: x.shape[1], None].float() * tensors["freq"].float()
        return x + torch.cat([angle.sin(), angle.cos()], -1).to(x.dtype) @ tensors["weight"].T

    freq = torch.exp(-math.log(1e4) * torch.arange(0, d, 2) / d)
    buffers = {"pos": torch.arange(n, dtype=F32), "freq": freq}
    chain = Chain([Layer("pos", positions, ("weight",), buffers),
                   Layer("head", lambda t, x: x @ t["weight"].T, ("weight",))])
    g = torch.Generator().manual_seed(0)
    return chain, {"pos": {"weight": torch.randn(d, d, generator=g)},
                   "head": {"weight": torch.randn(1, d, generator=g)}}


def test_float_buffers_keep_their_dtype_and_buffers_compute_casts_them() -> None:
    """In bf16 the positions 0..1023 collapse to 513 values (8 mantissa bits); kept in f32 the layer's
    encodings are those of the f32 step, rounded once to bf16 where they join the activations."""
    seen: dict[str, torch.dtype] = {}
    chain, params = _position_chain(seen)
    x = torch.randn(2, 1024, 8, generator=torch.Generator().manual_seed(1))
    batch = (x, torch.zeros(2, 1024, 1))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    kept = sw.mixed_precision(step, "compute=bf16,output=f32")
    kept(kept.init(params), batch)
    assert seen["pos"] == F32
    cast = sw.mixed_precision(step, "compute=bf16,output=f32,buffers=compute")
    cast(cast.init(params), batch)
    assert seen["pos"] == BF16  # the opt-in: mixed_precision's earlier behaviour
    assert "buffers=compute" in cast.plan(None, params).layers["pos"][-1]
    overridden = sw.mixed_precision(step, "compute=bf16,output=f32", overrides={"pos": "buffers=compute"})
    overridden(overridden.init(params), batch)
    assert seen["pos"] == BF16

    def encodings(dtype: torch.dtype | None) -> torch.Tensor:
        pos = chain["pos"].buffers["pos"]
        pos = pos if dtype is None else pos.to(dtype)
        angle = pos[:, None].float() * chain["pos"].buffers["freq"].float()
        return torch.cat([angle.sin(), angle.cos()], -1).to(BF16).float()

    exact = encodings(None)
    assert len(torch.unique(chain["pos"].buffers["pos"].to(BF16))) == 513
    assert (encodings(BF16) - exact).abs().max() > 0.5  # what casting the buffer cost


class PositionalEncoding(nn.Module):
    """The PyTorch tutorial's sinusoidal table, added straight to the activations: an f32 buffer
    promotes bf16 activations to f32."""

    def __init__(self, d: int, n: int = 32) -> None:
        super().__init__()
        pos = torch.arange(n).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(n, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(1)]


class EmbedWithPositions(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb, self.pos, self.proj = nn.Embedding(vocab, d), PositionalEncoding(d), nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pos(self.emb(ids)))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(2))
    return ids[:, :-1], ids[:, 1:]


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def test_a_position_table_added_in_its_own_layer_trains() -> None:
    """x + pe promotes the layer's output to f32; the next layer's cast brings it back to bf16."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Embedding(16, 8), PositionalEncoding(8), nn.Linear(8, 16)))
    f32 = sw.train_step(chain, _token_loss, sw.optim.sgd(0.1))
    bf16 = sw.mixed_precision(f32, "compute=bf16,output=f32")
    sw.testing.assert_equivalent(bf16, f32, sw.Mesh(dp=1), [_tokens()] * 3, params, rtol=1e-2)


def test_a_kept_buffer_that_breaks_a_matmul_names_the_layer_buffer_and_opt_in() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(EmbedWithPositions(16, 8), nn.Linear(8, 16)))
    f32 = sw.train_step(chain, _token_loss, sw.optim.sgd(0.1))
    bf16 = sw.mixed_precision(f32, "compute=bf16,output=f32")
    with pytest.raises(RuntimeError, match=r"layer '0' .* pos\.pe \(torch\.float32\).*overrides=\{'0': "
                                           r"'buffers=compute'\}") as caught:
        bf16(bf16.init(params), _tokens())
    assert "same dtype" in str(caught.value.__cause__)
    for opt_in in (sw.mixed_precision(f32, "compute=bf16,output=f32,buffers=compute"),
                   sw.mixed_precision(f32, "compute=bf16,output=f32", overrides={"0": "buffers=compute"})):
        sw.testing.assert_equivalent(opt_in, f32, sw.Mesh(dp=1), [_tokens()] * 3, params, rtol=1e-2)


def test_batch_norm_statistics_follow_the_compute_dtype() -> None:
    """torch's batch norm takes its running statistics in the dtype of its weight (bf16 here: a
    compute copy), so in eval mode they follow the compute dtype, as FSDP1 keeps BatchNorm whole."""
    torch.manual_seed(0)

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.bn(self.conv(x)))

    model = nn.Sequential(Stem(), nn.Conv1d(8, 8, 1), nn.BatchNorm1d(8), nn.Flatten(), nn.Linear(40, 1)).eval()
    chain, params = sw.functionalize(model)
    f32 = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, 5, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    for policy in ("compute=bf16,output=f32", "compute=f16,output=f32"):
        sw.testing.assert_equivalent(sw.mixed_precision(f32, policy), f32, sw.Mesh(dp=1), batches, params,
                                     rtol=1e-2)


# -- inputs that need no gradient are cast saturating ---------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_saturating_cast_keeps_the_mask_value_finite_and_lets_other_values_overflow(dtype: torch.dtype) -> None:
    """float32's extremes (what an additive mask is built with) become the target's; any other value
    beyond its range overflows as in a plain cast: a frozen layer's activation or a batch feature past
    float16's range must reach the loss scale as inf, not train clamped (review)."""
    big = torch.finfo(F32).max
    t = torch.tensor([-big, -1e30, -70000.0, -1.5, 0.0, 3.0, 70000.0, big, -math.inf, math.inf, math.nan])
    out = saturating_cast(t, dtype)
    limit = torch.finfo(dtype)
    assert out.dtype == dtype
    assert out[0] == limit.min and out[7] == limit.max
    plain = t.to(dtype)
    assert torch.equal(out[1:7], plain[1:7])  # within range, and beyond it (-1e30, +-70000 in f16): as plain
    assert out[-3] == -math.inf and out[-2] == math.inf and out[-1].isnan()
    torch.testing.assert_close(saturating_cast(t, torch.float64), t.double(), rtol=0, atol=0, equal_nan=True)


def _masked_chain() -> tuple[Chain, dict[str, dict[str, torch.Tensor]]]:
    """Hugging Face's eager shape: the first layer builds an additive mask at finfo(its dtype).min and
    passes it on with the hidden states; the next layer's softmax must give a fully masked row weights
    that are finite (not NaN)."""

    def embed(tensors: dict[str, torch.Tensor], x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, keep = x[0] @ tensors["weight"].T, x[1]
        mask = torch.zeros(keep.shape, dtype=h.dtype).masked_fill(~keep, torch.finfo(h.dtype).min)
        return h, mask

    def attend(tensors: dict[str, torch.Tensor], x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = x
        scores = h @ h.transpose(-1, -2) + mask[:, None, :]
        return (scores.softmax(-1) @ h) @ tensors["weight"].T

    chain = Chain([Layer("embed", embed, ("weight",)), Layer("attend", attend, ("weight",))])
    g = torch.Generator().manual_seed(0)
    return chain, {"embed": {"weight": torch.randn(8, 4, generator=g)},
                   "attend": {"weight": torch.randn(1, 8, generator=g)}}


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_an_f32_layers_mask_stays_finite_in_the_next_layer(compute: str) -> None:
    chain, params = _masked_chain()
    g = torch.Generator().manual_seed(1)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[:2] = False  # two rows fully masked
    batches = [((torch.randn(4, 6, 4, generator=g) * 0.3, keep), torch.randn(4, 6, 1, generator=g)) for _ in range(3)]
    f32 = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    step = sw.mixed_precision(f32, f"compute={compute},output=f32", overrides={"embed": "compute=f32"},
                              loss_scale="dynamic" if compute == "f16" else None)
    _, metrics = step(step.init(params), batches[0])
    assert not bool(metrics["skipped"]) and bool(torch.isfinite(metrics["loss"]))
    sw.testing.assert_equivalent(step, f32, sw.Mesh(dp=1), batches, params, rtol=1e-2)


def test_an_activation_that_overflows_still_shows_as_inf() -> None:
    """An input that needs a gradient keeps the plain cast: the overflow reaches the loss scale."""
    seen: list[torch.Tensor] = []

    def record(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x @ tensors["weight"].T

    chain = Chain([Layer("big", lambda t, x: x * t["scale"], ("scale",)), Layer("head", record, ("weight",))])
    params = {"big": {"scale": torch.tensor(1e6)}, "head": {"weight": torch.ones(1, 3)}}
    step = sw.mixed_precision(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "compute=f32",
                              overrides={"head": "compute=f16"}, loss_scale="dynamic")
    _, metrics = step(step.init(params), (torch.ones(2, 3), torch.zeros(2, 1)))
    assert seen[0].dtype == F16 and bool(seen[0].isinf().all())
    assert bool(metrics["skipped"])


# -- frozen parameters (requires_grad=False) are weights, not buffers ------------------------------


def _frozen_first_layer() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model[0].requires_grad_(False)  # a frozen base layer, as in a LoRA or head-only fine-tune
    return model


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_a_frozen_linear_computes_in_the_compute_dtype_as_a_frozen_group_does(compute: str) -> None:
    """A frozen Linear's weight travels with the layer's buffers, but it is a weight: it computes in the
    compute dtype, as a parameter in a frozen optimizer group does (and as FSDP2's param_dtype casts
    frozen parameters). Kept in float32, it refused every bf16 step of a model with a frozen layer."""
    policy = f"params=f32,compute={compute},output=f32"
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]

    chain, params = sw.functionalize(_frozen_first_layer())
    assert chain["0"].frozen == {"weight", "bias"} and set(chain["0"].buffers) == {"weight", "bias"}
    step = sw.mixed_precision(sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2)), policy)
    state = step.init(params)

    trainable = _frozen_first_layer().requires_grad_(True)
    chain_g, params_g = sw.functionalize(trainable)
    grouped = sw.optim.adamw(1e-2, groups=[sw.optim.group("0.*", frozen=True)])
    step_g = sw.mixed_precision(sw.train_step(chain_g, F.mse_loss, grouped), policy)
    state_g = step_g.init(params_g)
    for batch in batches:
        state, metrics = step(state, batch)
        state_g, metrics_g = step_g(state_g, batch)
        assert torch.equal(metrics["loss"], metrics_g["loss"])
    assert torch.equal(state.params["2"]["weight"], state_g.params["2"]["weight"])
    assert torch.equal(state_g.params["0"]["weight"], chain["0"].buffers["weight"])  # neither trained it


def test_a_frozen_name_must_be_a_buffer() -> None:
    with pytest.raises(ValueError, match=r"Layer 'lin': frozen names \['weight'\] that are not in buffers"):
        Layer("lin", lambda t, x: x, param_names=("weight",), frozen=frozenset({"weight"}))
