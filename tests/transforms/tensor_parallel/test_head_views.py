"""How a module treats the heads of a Colwise output (head_views.py, split_watch.py; match.py's lists).

Each wrong case trained silently before: a Colwise outside any Region viewed per head by the whole
head count (each rank made every head, of 1/tp of the head width), a module cutting its per-head
view across the heads (DiffLlama pairs head h with head h + H/2), and a Region holding one
LayerNorm per head in a list (StableLM's qk_layernorm zips the rank's heads with the first
entries). Each is refused by the Plan's prediction; the look-alike uses are compared with the
single-device step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

from .conftest import two_blocks_problem

D, HEADS = 32, 4


class _Attention(nn.Module):
    """Multi-head attention viewing its projections per head as ``view`` says; ``pair``: DiffLlama's pairing
    of head h with head h + H/2 (a chunk of the heads), ``per_head``: each head cut apart and put back."""

    def __init__(self, view: str = "by-width", pair: bool = False, per_head: bool = False, loop: str = "") -> None:
        super().__init__()
        self.view, self.pair, self.per_head, self.loop = view, pair, per_head, loop
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def heads(self, z: torch.Tensor) -> torch.Tensor:
        b, t, _ = z.shape
        if self.view == "by-count":  # nanoGPT's, einops' rearrange(z, "b n (h d) -> b h n d", h=heads)
            return z.view(b, t, self.n_heads, -1).transpose(1, 2)
        return z.view(b, t, -1, self.head_dim).transpose(1, 2)  # Hugging Face's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        if self.per_head:  # each head on its own: a cut into single heads, a cut within each head
            q = torch.cat([h * 2.0 for h in torch.split(q, 1, dim=1)], dim=1)
            k = torch.cat([k[..., :2] * 0.5, k[..., 2:]], dim=-1)
            v = v[:, :, None].expand(b, v.shape[1], 1, t, self.head_dim).reshape(b, -1, t, self.head_dim)
        if self.loop:  # a per-head loop over the heads this rank holds, each head taken alone
            take = {"index": lambda z, h: z[:, h], "select": lambda z, h: z.select(1, h),
                    "split_ones": lambda z, h: z.split([1] * z.shape[1], 1)[h][:, 0]}[self.loop]
            y = torch.stack([F.scaled_dot_product_attention(take(q, h), take(k, h), take(v, h), is_causal=True)
                             for h in range(q.shape[1])], dim=1)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.pair:
            first, second = torch.chunk(y, 2, dim=1)
            y = torch.cat([first - 0.5 * second, second], dim=1)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _problem(**attention: Any) -> tuple[sw.Step, Any, list[Any]]:
    return two_blocks_problem(lambda: _Attention(**attention), D)


_PAIR = {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}
_REGION = {"*.attn": sw.tp.Region(heads=("n_heads",)), **_PAIR}


def _refused(plan: dict[str, Any], message: str, **attention: Any) -> None:
    step, params, batches = _problem(**attention)
    with pytest.raises(ValueError, match=message):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


def _equivalent(plan: dict[str, Any], **attention: Any) -> None:
    step, params, batches = _problem(**attention)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


def test_a_view_by_the_whole_head_count_without_a_region_is_refused() -> None:
    """Each rank made 4 heads of 4 features instead of 2 heads of 8: losses apart from step 1, no error."""
    _refused(_PAIR, r"Colwise\(\) on '0\.attn\.q', outside any Region, .* whole head count \(0\.attn\.n_heads = 4\)"
             r".*sw\.tp\.Region\(heads=\('n_heads',\)\)", view="by-count")


@pytest.mark.parametrize("view, plan", [("by-width", _PAIR), ("by-count", _REGION), ("by-width", _REGION)])
def test_heads_viewed_by_their_width_or_counted_by_a_region_are_the_single_device_step(
    view: str, plan: dict[str, Any]
) -> None:
    """Hugging Face's view(..., -1, head_dim) needs no Region (BERT's attention holds its head count too,
    unread); a Region divides the count a view reads."""
    _equivalent(plan, view=view)


def test_a_module_pairing_heads_across_the_whole_count_is_refused() -> None:
    """DiffLlama's torch.chunk(attn_output, 2, dim=heads): rank 0 paired its heads 0 and 1, not 0 and 2."""
    _refused(_REGION, r"'0\.attn\.[qkv]' .*cuts its per-head view across the heads: chunk of its 2 heads", pair=True)


def test_heads_cut_one_by_one_within_a_head_and_repeated_are_the_single_device_step() -> None:
    _equivalent(_REGION, per_head=True)
    _equivalent(_PAIR, per_head=True)


@pytest.mark.parametrize("loop", ["index", "select", "split_ones"])
def test_a_per_head_loop_taking_one_head_at_a_time_is_the_single_device_step(loop: str) -> None:
    """q[:, h], q.select(1, h), q.split([1] * n, 1): each head alone, whatever the count (they were refused
    as cuts across the heads); chunk(n) stays refused, its n parts being heads of another size on a rank."""
    _equivalent(_REGION, loop=loop)
    _equivalent(_PAIR, loop=loop)


def _tiny_hf(make: Callable[[], nn.Module], layer: type) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    model = make().double()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(64, (2, 2, 9), generator=gen)
    batches = [(seq[:, :-1], seq[:, 1:]) for seq in ids]
    chain, params = sw.functionalize(model, units=layer, example_input=batches[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)

    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


_HF = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=16)


def test_hugging_face_diffllama_under_the_llama_plan_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaDecoderLayer

    def make() -> nn.Module:
        config = transformers.DiffLlamaConfig(**_HF, num_key_value_heads=4, attn_implementation="eager")
        return transformers.DiffLlamaForCausalLM(config)

    step, params, batches = _tiny_hf(make, DiffLlamaDecoderLayer)
    with pytest.raises(ValueError, match=r"self_attn\.v_proj' .*chunk of its 2 heads \(dim 1\)"):
        sw.tensor_parallel(step, "tp", sw.tp.llama_plan()).plan(sw.Mesh(tp=2), params, batches[0])


class _AdaptedAttention(_Attention):
    """A list of input adapters, Linear(D, D), as long as the head count by chance: not one per head."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.ModuleList(nn.Linear(D, D) for _ in range(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for adapter in self.adapters:
            x = x + 0.1 * adapter(x)
        return super().forward(x)


def test_a_list_of_matrices_as_long_as_the_head_count_is_not_taken_for_one_per_head() -> None:
    step, params, batches = two_blocks_problem(_AdaptedAttention, D)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _REGION), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


@pytest.mark.parametrize("qk_layernorm", [True, False])
def test_stablelm_per_head_layernorms_are_refused_and_without_them_it_trains_right(qk_layernorm: bool) -> None:
    """qk_layernorm=True zipped rank 1's heads with the LayerNorms of rank 0's; norms 2 and 3 never trained."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.stablelm.modeling_stablelm import StableLmDecoderLayer

    def make() -> nn.Module:
        config = transformers.StableLmConfig(**_HF, num_key_value_heads=2, partial_rotary_factor=0.25,
                                             qk_layernorm=qk_layernorm, attn_implementation="sdpa")
        return transformers.StableLmForCausalLM(config)

    step, params, batches = _tiny_hf(make, StableLmDecoderLayer)
    plan = {**sw.tp.llama_plan(), "model.layers.*.self_attn": sw.tp.Region(heads=("num_heads", "num_key_value_heads"))}
    if qk_layernorm:
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_layernorm\.norms', a ModuleList of 4 "
                                             r"entries, one per head \(num_heads = 4\)"):
            sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])
    else:
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                     rtol=1e-9)


def test_a_norm_spanning_every_head_is_named_not_the_head_counts() -> None:
    """OLMo2's q_norm normalizes all heads' features together: the refusal blamed head counts that were named."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

    def make() -> nn.Module:
        config = transformers.Olmo2Config(**_HF, num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0,
                                          eos_token_id=1, bos_token_id=1)
        return transformers.Olmo2ForCausalLM(config)

    step, params, batches = _tiny_hf(make, Olmo2DecoderLayer)
    with pytest.raises(ValueError, match=r"its parameter 'q_norm\.weight' of shape \(32,\) spans the whole output of "
                                         r"'model\.layers\.0\.self_attn\.q_proj'"):
        sw.tensor_parallel(step, "tp", sw.tp.llama_plan()).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_parameter_per_head_is_named_not_the_head_counts() -> None:
    """GPT-OSS's attention sinks, (num_heads,), are concatenated to each head's scores; no style splits them,
    so a rank's 2 heads met all 4 sinks, and the refusal blamed the head counts the Region named."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    def make() -> nn.Module:
        config = transformers.GptOssConfig(**{**_HF, "intermediate_size": 16}, num_key_value_heads=2, head_dim=8,
                                           num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
                                           experts_implementation="eager", pad_token_id=0, eos_token_id=1,
                                           bos_token_id=1)
        return transformers.GptOssForCausalLM(config)

    step, params, batches = _tiny_hf(make, GptOssDecoderLayer)
    heads = ("config.num_attention_heads", "config.num_key_value_heads")
    plan = {"model.layers.*.self_attn": sw.tp.Region(heads=heads),
            "model.layers.*.self_attn.[qkv]_proj": sw.tp.Colwise(),
            "model.layers.*.self_attn.o_proj": sw.tp.Rowwise(), "lm_head": sw.tp.Colwise(output="sharded")}
    with pytest.raises(ValueError, match=r"its parameter 'sinks' of shape \(4,\) holds one value per head \(4 heads\)"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_linear_over_every_heads_features_is_named_a_linear_not_a_norm() -> None:
    """Doge's dt_proj (a Linear no style splits) takes the values of every head together: a rank's half of
    them failed its matmul, and the refusal called its weight a norm spanning q_proj's output (the product
    of its dims, 2 x 8, happened to equal q_proj's 16 features). It names the Linear and its input width,
    and v_proj, whose output the failing matmul took (it named k_proj, the first Colwise as wide)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.doge.modeling_doge import DogeDecoderLayer

    def make() -> nn.Module:
        config = transformers.DogeConfig(**{**_HF, "hidden_size": 16}, num_key_value_heads=2,
                                         attn_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=1)
        return transformers.DogeForCausalLM(config)

    step, params, batches = _tiny_hf(make, DogeDecoderLayer)
    plan = {**sw.tp.llama_plan(vocab_parallel=False), "lm_head": sw.tp.Colwise(output="sharded")}
    with pytest.raises(ValueError, match=(
            r"its Linear 'dt_proj' \(weight \(2, 8\)\), which no style splits, takes 8 input features, as wide as "
            r"the whole output of 'model\.layers\.0\.self_attn\.v_proj' \(every head's\)")):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


def test_phi3_reading_its_configs_head_count_is_told_so() -> None:
    """Phi-3 slices q at config.num_attention_heads * head_dim: o_proj got the whole width, and the refusal
    told to give the module before it Colwise(), which it had."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

    def make() -> nn.Module:
        config = transformers.Phi3Config(**_HF, num_key_value_heads=4, attn_implementation="sdpa", pad_token_id=0,
                                         eos_token_id=1, bos_token_id=1)
        return transformers.Phi3ForCausalLM(config)

    step, params, batches = _tiny_hf(make, Phi3DecoderLayer)
    plan = {"model.layers.*.self_attn": sw.tp.Region(heads=("config.num_attention_heads",)),
            "model.layers.*.self_attn.qkv_proj": sw.tp.Colwise(fused=3),
            "model.layers.*.self_attn.o_proj": sw.tp.Rowwise()}
    with pytest.raises(ValueError, match=r"o_proj' .* but got all 32, though its Region split them: .*query_pos"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])
