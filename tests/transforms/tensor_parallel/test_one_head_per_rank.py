"""A rank holding one head of a projection laid out per head with q, k and v inside each head.

Bloom's and Persimmon's ``query_key_value`` is viewed ``(b, t, heads, 3, head_dim)``. With one head per rank (tp =
heads) a rank's view is ``(b, t, 1, 3, head_dim)``: the split watch read the 3 (q, k, v) as the heads and refused a
correct step ("computes each of this rank's 3 heads in a loop, but not alike"), where tp = heads / 2 trained. The
size-1 dim before (3, head_dim) is the rank's one head now (split_watch._one_head_before), and what mixes the heads
is still refused at one head per rank.

Unmodified transformers models from tiny configs, random init, float64, dropout 0; 2 steps of SGD with momentum
compared with one device at rtol 1e-9 (the split only reorders float64 sums: errors are rounding, ~1e-16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 4, 8, 2


def lm_loss(out: object, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)  # type: ignore[attr-defined]


def batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(2)]


def persimmon_plan() -> dict[str, object]:
    layers = "model.layers.*"
    return {
        "model.embed_tokens": sw.tp.Rowwise(),
        f"{layers}.self_attn": sw.tp.Region(heads=("num_heads",)),
        f"{layers}.self_attn.query_key_value": sw.tp.Colwise(),
        f"{layers}.self_attn.dense": sw.tp.Rowwise(),
        f"{layers}.mlp": sw.tp.Region(),
        f"{layers}.mlp.dense_h_to_4h": sw.tp.Colwise(),
        f"{layers}.mlp.dense_4h_to_h": sw.tp.Rowwise(),
        "lm_head": sw.tp.Colwise(output="sharded"),
    }


def build(family: str) -> tuple[nn.Module, type, dict[str, object]]:
    if family == "bloom":
        config = T.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=2, n_head=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0, attn_implementation="eager")
        return T.BloomForCausalLM(config), T.models.bloom.modeling_bloom.BloomBlock, sw.tp.bloom_plan()
    config = T.PersimmonConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=HEADS, max_position_embeddings=32, qk_layernorm=True,
                               partial_rotary_factor=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    return T.PersimmonForCausalLM(config), T.models.persimmon.modeling_persimmon.PersimmonDecoderLayer, persimmon_plan()


@pytest.mark.parametrize("tp", [2, 4], ids=["two heads per rank", "one head per rank"])
@pytest.mark.parametrize("family", ["bloom", "persimmon"])
def test_a_per_head_fused_projection_trains_at_any_head_count_per_rank(family: str, tp: int) -> None:
    """Persimmon's qk-layernorm per head and partial rotary, Bloom's ALiBi cut to the rank's heads: tp = 4 was
    refused before, tp = 2 trained."""
    torch.manual_seed(0)
    model, unit, plan = build(family)
    data = batches()
    chain, params = sw.functionalize(model.double(), units=unit, example_input=data[0][0])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=tp), data, params, rtol=1e-9)


class _Attention(nn.Module):
    """(b, t, heads, 3, head_dim) as Bloom's, then ``mix`` across the heads: another attention on a rank."""

    def __init__(self, mix: str) -> None:
        super().__init__()
        self.mix, self.num_heads = mix, HEADS
        self.query_key_value, self.dense = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        fused = self.query_key_value(x)
        if self.mix == "a norm over all the features, the rows folded":  # not per head: over 48 on one device
            fused = F.layer_norm(fused.reshape(-1, 1, fused.shape[-1]), fused.shape[-1:]).reshape(b, t, -1)
        fused = fused.view(b, t, self.num_heads, 3, 4)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        if self.mix == "mean over the heads":
            q = q - q.mean(2, keepdim=True)
        elif self.mix == "softmax over the heads":
            k = k.softmax(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, mix: str) -> None:
        super().__init__()
        self.attn = _Attention(mix)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(x)


class _Net(nn.Module):
    """An embedding, ``layers`` (two blocks of width 16) and a head: the model the tests below split."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.layers = nn.ModuleList(layers)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("tp", [2, 4], ids=["two heads per rank", "one head per rank"])
@pytest.mark.parametrize(
    "mix", ["none", "mean over the heads", "softmax over the heads", "a norm over all the features, the rows folded"])
def test_an_op_across_the_heads_is_refused_with_one_head_per_rank_too(mix: str, tp: int) -> None:
    """With one head per rank a reduction over the heads dim (size 1 on the rank, 4 on one device) is the rank's
    head alone: refused (by the split watch at two heads, by the Region's value probe at one), as tp = 2 is."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randint(32, (2, 8), generator=gen), torch.randint(32, (2, 8), generator=gen)) for _ in range(2)]
        chain, params = sw.functionalize(_Net([_Block(mix), _Block(mix)]), units=_Block, example_input=data[0][0])
        step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
        plan = {"layers.*.attn": sw.tp.Region(heads=("num_heads",)),
                "layers.*.attn.query_key_value": sw.tp.Colwise(), "layers.*.attn.dense": sw.tp.Rowwise()}
        tp_step = sw.tensor_parallel(step, "tp", plan)
        if mix == "none":
            sw.testing.assert_equivalent(tp_step, step, sw.Mesh(tp=tp), data, params, rtol=1e-9)
            return
        with pytest.raises(sw.collectives.RankFailed, match=r"(?s)tensor_parallel: .*heads"):
            sw.testing.assert_equivalent(tp_step, step, sw.Mesh(tp=tp), data, params, rtol=1e-9)
    finally:
        torch.set_default_dtype(torch.float32)


class _Mlp(nn.Module):
    """up (Colwise), a norm over all its features after ``how`` puts a dim of size 1 before them, down (Rowwise)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.up, self.down = how, nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.up(x)
        if self.how == "unsqueeze(2)":
            h = F.layer_norm(h.unsqueeze(2), h.shape[-1:]).squeeze(2)
        elif self.how == "view(b, t, 1, -1)":
            h = F.layer_norm(h.view(b, t, 1, -1), h.shape[-1:]).view(b, t, -1)
        elif self.how == "reshape(-1, 1, width)":
            h = F.layer_norm(h.reshape(-1, 1, h.shape[-1]), h.shape[-1:]).reshape(b, t, -1)
        return x + self.down(torch.relu(h))


@pytest.mark.parametrize("how", ["unsqueeze(2)", "view(b, t, 1, -1)", "reshape(-1, 1, width)"])
def test_a_dim_of_size_one_is_not_a_head_where_no_rank_holds_one(how: str) -> None:
    """A Colwise outside any Region with no head count: a dim of size 1 before its features is no head, so a norm
    over the features after it is over the rank's half of them. It was read as a rank's one head and trained
    another model without an error (0.78% off in the first loss, float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randint(32, (2, 8), generator=gen), torch.randint(32, (2, 8), generator=gen)) for _ in range(2)]
        chain, params = sw.functionalize(_Net([_Mlp(how), _Mlp(how)]), units=_Mlp, example_input=data[0][0])
        step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
        tp_step = sw.tensor_parallel(step, "tp", {"layers.*.up": sw.tp.Colwise(), "layers.*.down": sw.tp.Rowwise()})
        with pytest.raises(sw.collectives.RankFailed, match=r"layer_norm with no weight over its features"):
            sw.testing.assert_equivalent(tp_step, step, sw.Mesh(tp=2), data, params, rtol=1e-9)
    finally:
        torch.set_default_dtype(torch.float32)


class _FoldedNormAttention(nn.Module):
    """Chameleon's per-head q/k norm: ``layer_norm(q.reshape(-1, heads, head_dim), (head_dim,))``, the leading dims
    folded (batch x time rows), then viewed back."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, 16 // heads
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape

        def normed(z: Tensor) -> Tensor:
            z = F.layer_norm(z.reshape(-1, self.n_heads, self.head_dim), (self.head_dim,))
            return z.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)

        v = self.v(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(normed(self.q(x)), normed(self.k(x)), v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class _FoldedBlock(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attn = _FoldedNormAttention(heads)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(x)


@pytest.mark.parametrize("heads", [4, 2], ids=["two heads per rank", "one head per rank"])
def test_a_per_head_norm_on_folded_rows_trains_at_any_head_count_per_rank(heads: int) -> None:
    """With one head per rank the fold is ``reshape(-1, 1, head_dim)``: it was refused as a norm over the features
    (with two, ``reshape(-1, 2, head_dim)``, it trained)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(_FoldedBlock(heads), nn.Linear(16, 8))
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 8, generator=gen)) for _ in range(2)]
        chain, params = sw.functionalize(model)
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
        plan = {"0.attn": sw.tp.Region(heads=("n_heads",)), "0.attn.[qkv]": sw.tp.Colwise(),
                "0.attn.o": sw.tp.Rowwise()}
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), data, params, rtol=1e-9)
    finally:
        torch.set_default_dtype(torch.float32)


def test_swapped_styles_are_named_as_swapped() -> None:
    """Rowwise on q_proj and Colwise on o_proj (a Qwen3 attention): the refusal blamed a whole count the module read
    (Phi-3's query_pos), where q_proj simply met the Region's whole input with no Colwise before it."""
    torch.manual_seed(0)
    config = T.Qwen3Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
    model = T.Qwen3ForCausalLM(config).double()
    data = batches()
    chain, params = sw.functionalize(model, units=T.models.qwen3.modeling_qwen3.Qwen3DecoderLayer,
                                     example_input=data[0][0])
    step = sw.train_step(chain, lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
                         sw.optim.sgd(0.1))
    attention = "model.layers.*.self_attn"
    plan = {attention: sw.tp.Region(heads=("config.num_attention_heads", "config.num_key_value_heads")),
            f"{attention}.q_proj": sw.tp.Rowwise(), f"{attention}.[kv]_proj": sw.tp.Colwise(),
            f"{attention}.o_proj": sw.tp.Colwise()}
    with pytest.raises(sw.collectives.RankFailed, match=r"Rowwise\(\) on 'model.layers.0.self_attn.q_proj' .*no "
                                                        r"Colwise ran before it in its Region.*are the two styles "
                                                        r"swapped\?"):
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), data, params)
