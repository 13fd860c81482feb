"""sw.context_parallel on Hugging Face attentions it does not reproduce, through transformers' AttentionInterface.

Phi-3's, OLMo-2's, OLMo's, Cohere's and StarCoder2's attentions run their own forward (projections,
norms, clamps, rotary embedding on the rank's tokens) and call the attention function context_parallel
registers, which attends over the whole sequence by ring or Ulysses attention. Each was refused before
(an attention class it did not know). float64 on thread ranks; results agree to rounding
(assert_equivalent's float64 default); the Plan's collectives are what runs. What the function cannot
compute exactly is refused, naming the module, the setting and the fix.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.model.module_call import module_fn
from shardwise.transforms.context_parallel import hf_interface
from shardwise.transforms.context_parallel.layout import shard_sequence, unshard_sequence

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ = 32, 16


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def counted(inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return (targets != -100).sum()


def model(family: str, layers: int = 2, **extra: Any) -> Any:
    torch.manual_seed(0)
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=1,
        attn_implementation="sdpa",
    )
    config = getattr(T, f"{family}Config")(**{**settings, **extra})
    built = getattr(T, f"{family}ForCausalLM")(config).double()
    gen = torch.Generator().manual_seed(2)
    for name, p in built.named_parameters():  # norms initialized to ones would hide a norm left out less well
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5, generator=gen)
    return built


def split(built: Any, example: Any, **step: Any) -> tuple[sw.Step, Any]:
    family = type(built).__name__.removesuffix("ForCausalLM")
    layer = sys.modules[type(built).__module__]  # the model's own modeling module (deepseek_v3's too)
    chain, params = sw.functionalize(built, units=getattr(layer, f"{family}DecoderLayer"), example_input=example)
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9), **step), params


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 2, SEQ + 1), generator=gen)
    return [(x[:, :-1], x[:, 1:]) for x in ids]  # shifted on the whole sequence, before the cut


def family_step(family: str, **extra: Any) -> tuple[sw.Step, Any, list[Any]]:
    batches = token_batches()
    return (*split(model(family, **extra), batches[0][0]), batches)


@pytest.mark.parametrize(("family", "attention", "extra"), [
    ("Phi3", "ring", {}), ("Phi3", "ulysses", {}),
    ("Olmo2", "ring", {}), ("Olmo2", "ulysses", {}),  # q_norm, k_norm over all heads: per token
    ("Olmo", "ring", {"clip_qkv": 0.05}),  # its forward clamps q, k, v
    ("Cohere", "ring", {"use_qk_norm": True}),  # a LayerNorm per head, interleaved rotary, parallel block
    ("Starcoder2", "ulysses", {}),  # biases, LayerNorms
    ("StableLm", "ring", {"partial_rotary_factor": 0.5}),  # passes position_ids on to the function, unread
])
def test_an_attention_calling_the_attention_interface_equals_the_single_device_step(
    family: str, attention: str, extra: dict[str, Any],
) -> None:
    step, params, batches = family_step(family, **extra)
    cp = sw.context_parallel(step, "cp", attention=attention)
    assert "through transformers' AttentionInterface" in str(cp.plan(sw.Mesh(cp=2), params, batches[0]))
    sw.testing.assert_equivalent(cp, step, sw.Mesh(cp=2), batches, params)


@pytest.mark.parametrize("family", ["Mistral", "Qwen2"])
def test_an_attention_it_reproduces_keeps_its_reproduction(family: str) -> None:
    """Mistral's and Qwen2's attentions call the AttentionInterface too, but their forwards are reproduced
    (checked against their code): those keep the reproduction."""
    step, params, batches = family_step(family)
    text = str(sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0]))
    assert "attention self_attn over the whole sequence:" in text and "AttentionInterface" not in text


def test_over_dp_by_cp_with_zero3_equals_the_single_device_step() -> None:
    step, params, batches = family_step("Cohere")
    composed = sw.shard_params(sw.context_parallel(step, "cp"), "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, cp=2), batches, params)


# cp x tp: each Region is judged under tensor_parallel alone, and says so (test_region_not_judged.py).
@pytest.mark.filterwarnings("ignore::shardwise.tp.RegionNotJudged")
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cohere_over_cp_by_tp_equals_the_single_device_step(attention: str) -> None:
    """tensor_parallel's Region calls the attention's own forward on the rank's heads, which calls the split
    function over cp."""
    step, params, batches = family_step("Cohere")
    composed = sw.tensor_parallel(sw.context_parallel(step, "cp", attention=attention), "tp",
                                  sw.tp.llama_plan(vocab_parallel=False))
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2, tp=2), batches, params)


def test_phi3_over_pp_by_cp_equals_the_single_device_step() -> None:
    step, params, batches = family_step("Phi3")
    piped = sw.pipeline(sw.context_parallel(step, "cp"), "pp", schedule="1f1b", microbatches=2)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2, cp=2), batches, params)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_the_ledger_equals_the_plan(attention: str) -> None:
    step, params, batches = family_step("Phi3")
    cp, mesh = sw.context_parallel(step, "cp", attention=attention), sw.Mesh(cp=2)
    plan = sw.testing.assert_plan_is_run(cp, mesh, params, batches[0])
    ops = [c.op for c in plan.collectives(0) if c.axis == "cp"]
    exchanged = "ppermute" if attention == "ring" else "all_to_all"
    assert ops.count(exchanged) == 2 * (2 if attention == "ring" else 8)  # 2 layers; (cp - 1) or 4, each way


@pytest.mark.parametrize(("kind", "attention"), [("left", "ring"), ("packed", "ulysses")])
def test_padded_and_packed_batches_equal_the_single_device_step(kind: str, attention: str) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        inputs: dict[str, Any] = {"input_ids": ids[:, :-1]}
        targets = ids[:, 1:].clone()
        if kind == "packed":
            inputs.update(attention_mask=None, position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5,
                                                                           6, 7]] * 2))
        else:
            mask = torch.ones(2, SEQ, dtype=torch.long)
            mask[0, :5], mask[1, :3] = 0, 0
            inputs["attention_mask"] = mask
            targets[mask == 0] = -100
        batches.append((inputs, targets))
    step, params = split(model("Olmo2"), batches[0][0], tokens=counted)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention=attention), step, sw.Mesh(cp=2), batches,
                                 params)


def refused_at_the_plan(step: sw.Step, params: Any, batch: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batch)


def test_a_sliding_window_shorter_than_the_sequence_is_refused() -> None:
    """A window of 12 over 16 tokens cut in parts of 8: each part fits in the window, so the model makes no
    mask, and the ring would attend over every earlier key."""
    step, params, batches = family_step("Starcoder2", sliding_window=12)
    refused_at_the_plan(step, params, batches[0], r"self_attn \(Starcoder2Attention\) uses sliding-window attention "
                                                  r"\(sliding_window=12, shorter than the sequence's 16 tokens\)")
    step, params, batches = family_step("Starcoder2", sliding_window=SEQ)  # as long as the sequence: no window
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


def test_gemma2_soft_capped_scores_are_refused() -> None:
    """Gemma-2 (which transformers builds on eager only) soft-caps its scores: refused for that, not for its
    implementation, which no setting of its changes."""
    built = model("Gemma2", layers=1, head_dim=4, attn_implementation="eager")
    batches = token_batches()
    step, params = split(built, batches[0][0])
    with pytest.raises(ValueError, match=r"self_attn \(Gemma2Attention\) passes softcap= to its attention: a soft cap"
                                         r" of the scores") as info:
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
    assert "attn_implementation" not in str(info.value)


def test_gemma2_without_soft_caps_on_eager_is_refused_without_advising_sdpa() -> None:
    """Without soft caps its attention would be split, but it runs eager, and transformers refuses sdpa for
    Gemma-2: the refusal says to leave context_parallel out (it advised sdpa, which cannot be built)."""
    built = model("Gemma2", layers=1, head_dim=4, attn_implementation="eager", attn_logit_softcapping=None,
                  final_logit_softcapping=None, sliding_window=SEQ)
    batches = token_batches()
    step, params = split(built, batches[0][0])
    with pytest.raises(ValueError, match=r"\(Gemma2Attention\) runs attn_implementation='eager'.*transformers offers "
                                         r"no sdpa attention for this model.*leave context_parallel out") as info:
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
    assert "build the model with" not in str(info.value)


def test_an_attention_reading_the_position_ids_itself_is_refused() -> None:
    """Ministral-3 scales its queries by a function of position_ids (Llama-4's attention scaling), which
    count the rank's own tokens under context_parallel: it trained another model without an error (the loss
    differed from the single device's by 5e-7 relative, with original_max_position_embeddings 4)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
            "original_max_position_embeddings": 4}
    step, _, _ = family_step("Ministral3", head_dim=4, rope_parameters=rope)
    with pytest.raises(ValueError, match=r"self_attn \(Ministral3Attention\) reads position_ids in its forward \("
                                         r"beyond passing them to its attention function\)"):
        sw.context_parallel(step, "cp")


ALL_ATTENTION_FUNCTIONS = T.modeling_utils.ALL_ATTENTION_FUNCTIONS


def _sdpa_branching_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    assert ALL_ATTENTION_FUNCTIONS is not None  # named, as transformers' attention forwards name it
    if self.config._attn_implementation == "sdpa":  # a branch the split attention (another name) would not take
        hidden_states = 2 * hidden_states
    return T.models.phi3.modeling_phi3.Phi3Attention.forward(self, hidden_states, *args, **kwargs)


def test_an_attention_branching_on_the_sdpa_implementation_is_refused() -> None:
    """Some transformers attentions (SAM's, EdgeTAM's, Dots3's) take a branch of their own on sdpa, which the
    single-device step takes and a module pointed at the split function would not."""
    built = model("Phi3")
    cls = type("BranchingAttention", (T.models.phi3.modeling_phi3.Phi3Attention,),
               {"forward": _sdpa_branching_forward, "__module__": "transformers.models.branching.modeling_branching"})
    for layer in built.model.layers:
        layer.self_attn.__class__ = cls
    step, _ = split(built, token_batches()[0][0])
    with pytest.raises(ValueError, match=r"self_attn \(BranchingAttention\) branches on attn_implementation 'sdpa'"):
        sw.context_parallel(step, "cp")


def test_attention_dropout_in_training_is_refused() -> None:
    step, params, batches = family_step("Phi3", attention_dropout=0.1)
    refused_at_the_plan(step, params, batches[0], r"self_attn \(Phi3Attention\) drops attention probabilities in "
                                                  r"training \(dropout=0.1, config.attention_dropout\)")


def test_a_model_not_built_on_sdpa_is_refused_with_the_fix() -> None:
    step, params, batches = family_step("Phi3", attn_implementation="eager")
    refused_at_the_plan(step, params, batches[0], r"\(Phi3Attention\) runs attn_implementation='eager'.*build the "
                                                  r"model with attn_implementation='sdpa'")


class ShortConv(nn.Module):
    """A causal depthwise convolution over time: it mixes positions outside the attention."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding=2, groups=d).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def test_sequence_mixing_outside_the_attention_function_is_still_refused() -> None:
    built = model("Olmo2")
    built.model.layers[1].mlp = ShortConv(16)
    batches = token_batches()
    step, params = split(built, batches[0][0])
    refused_at_the_plan(step, params, batches[0], r"Conv1d in layer 'model.layers.1' convolves")


def test_the_single_device_step_of_a_chain_run_under_cp_is_unchanged() -> None:
    """The split function is named in the configs of the taken-over modules' copies only: the model's, the
    chain's and the single-device step's configs still name sdpa, and its step computes the same bits."""
    built = model("Phi3")
    batches = token_batches()
    step, params = split(built, batches[0][0])
    before = step(step.init(params), batches[0])
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches[:1], params)
    after = step(step.init(params), batches[0])
    assert before[1].keys() == after[1].keys() and all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    chain_configs = [m.config for layer in step.base_chain
                     for m in module_fn(layer.fn).replicas.module.modules() if hasattr(m, "config")]
    assert chain_configs and {c._attn_implementation for c in [built.config, *chain_configs]} == {"sdpa"}


def _attention_module(causal: bool = True, **settings: Any) -> nn.Module:
    module = nn.Module()
    module.is_causal = causal  # type: ignore[assignment]
    if settings:
        setattr(module, hf_interface._SETTINGS, hf_interface.SplitAttention(**settings))
    return module


def test_a_module_not_taken_over_computes_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = torch.randn(3, 2, 4, 8, 4, dtype=torch.float64).unbind(0)
    module = _attention_module()
    got, _ = hf_interface.split_attention_forward(module, q, k, v, None, scaling=0.3, dropout=0.0)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3, dropout=0.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_the_function_over_the_axis_equals_sdpa_on_the_whole_sequence(causal: bool) -> None:
    """Non-causal attention (``module.is_causal`` False) is split exactly too: each rank attends to every key."""
    q = torch.randn(2, 4, 16, 4, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 16, 4, dtype=torch.float64).unbind(0)  # grouped-query: 2 key/value heads
    module = _attention_module(causal, axis="cp", attention="ring", balanced=True, where="here",
                               implementation="sdpa")

    def main() -> torch.Tensor:
        with sw.Mesh(cp=2):
            local = [shard_sequence(t, "cp", dim=2) for t in (q, k, v)]
            out, _ = hf_interface.split_attention_forward(module, *local, None, scaling=0.3, dropout=0.0)
            return unshard_sequence(out.transpose(1, 2), "cp", dim=2)

    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
    for got in sw.launch(main, world=2, timeout=60):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kwargs", "mask", "match"), [
    ({"cu_seq_lens_q": None}, None, r"passes cu_seq_lens_q to its attention function, which context_parallel's does "
                                    r"not know"),
    ({"s_aux": torch.zeros(4)}, None, r"passes s_aux= to its attention: attention sinks"),
    ({"head_mask": torch.ones(4)}, None, r"passes head_mask= to its attention"),
    ({}, torch.zeros(2, 1, 16, 16, dtype=torch.bool), r"got an attention mask it did not make \(Tensor \(2, 1, 16, 16"),
])
def test_what_it_cannot_compute_exactly_is_refused(kwargs: dict[str, Any], mask: Any, match: str) -> None:
    q, k, v = torch.randn(3, 2, 4, 16, 4, dtype=torch.float64).unbind(0)
    module = _attention_module(axis="cp", attention="ring", balanced=True, where="layer 0: attn",
                               implementation="sdpa")
    with pytest.raises(ValueError, match=r"context_parallel: layer 0: attn \(Module\) " + match):
        hf_interface.split_attention_forward(module, q, k, v, mask, **kwargs)


def test_a_layer_of_another_kind_than_full_or_sliding_attention_is_refused() -> None:
    """Llama-4's chunked attention is a mask the model makes (for the rank's part alone, which may fit in a
    chunk: then no mask at all); the attention function is not told."""
    q, k, v = torch.randn(3, 2, 4, 16, 4, dtype=torch.float64).unbind(0)
    module = _attention_module(axis="cp", attention="ring", balanced=True, where="a", implementation="sdpa")
    module.config = T.PretrainedConfig()  # type: ignore[assignment]
    module.config.layer_types = ["full_attention", "chunked_attention"]
    module.layer_idx = 1  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"is a 'chunked_attention' layer \(config.layer_types\)"):
        hf_interface.split_attention_forward(module, q, k, v, None)
    module.layer_idx = 0  # type: ignore[assignment]
    hf_interface.split_attention_forward(module, q, k, v, None)  # a full-attention layer


def test_a_cross_attention_is_refused() -> None:
    q, k, v = torch.randn(2, 4, 16, 4, dtype=torch.float64), *torch.randn(2, 2, 4, 8, 4, dtype=torch.float64)
    module = _attention_module(axis="cp", attention="ring", balanced=True, where="a", implementation="sdpa")
    with pytest.raises(ValueError, match=r"is a cross-attention"):
        hf_interface.split_attention_forward(module, q, k, v, None)


# -- found in review: what the general path met on more families -------------------------------------------


@pytest.mark.parametrize(("family", "extra"), [
    # its decoder layers hand output_router_logits (False) on to the attention, which does not read it
    ("Olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"}),
    ("Olmo3", {"sliding_window": 64}),  # its rotary embedding takes the layer's type beside the positions
])
def test_models_handing_more_to_their_attention_or_rotary_equal_the_single_device_step(
    family: str, extra: dict[str, Any]
) -> None:
    step, params, batches = family_step(family, **extra)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


@pytest.mark.parametrize(("family", "extra", "refusal"), [
    ("DeepseekV3", {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 2, "q_lora_rank": None, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 4, "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1},
     r"values of head dim 4 to queries and keys of 8 \(DeepSeek-V3's multi-head latent attention\)"),
    ("Falcon", {"alibi": True}, r"adds ALiBi position biases \(config\.alibi\)"),
    ("Falcon", {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 2},
     r"makes a mask of its own where the batch gives none \(Falcon's causal mask\) takes the batch's attention_mask"),
    ("OPT", {"ffn_dim": 32, "word_embed_proj_dim": 16},
     r"position table 'model\.decoder\.embed_positions' \(OPTLearnedPositionalEmbedding\), which its own forward"),
])
def test_what_the_split_attention_cannot_take_is_refused_by_name_not_a_raw_error(
    family: str, extra: dict[str, Any], refusal: str
) -> None:
    """Each ended in a raw error or a misleading refusal: MLA's values of another head dim (ring attention's
    shape error), Falcon's ALiBi built from the batch's 2-D mask (an unpacking error), Falcon's own causal
    mask on a batch without one (refused as the user's mask), OPT's position table read at the mask's
    running count (refused with the advice to list it in positions=, which then failed)."""
    step, params, batches = family_step(family, **extra)
    with pytest.raises((ValueError, sw.collectives.RankFailed), match=refusal):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
    if family == "OPT":  # following the old advice ends in the same refusal
        with pytest.raises(ValueError, match=refusal):
            sw.context_parallel(step, "cp", positions=("embed_positions.weight",))


@pytest.mark.parametrize("floor_scale", [2, 8192])
def test_an_attention_making_positions_from_its_part_of_the_sequence_is_refused(floor_scale: int) -> None:
    """Llama-4's layers without rotary scale their queries by a temperature of each token's position, made
    with arange over the length of the hidden states it is given: under context_parallel the rank's own
    count. It trained another model without an error (2.4e-8 relative on the loss at floor_scale=2; from
    8192 tokens on at the default); refused when the transform is applied, whatever the scale."""
    torch.manual_seed(0)
    config = T.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=2 * SEQ,
        attention_chunk_size=None, floor_scale=floor_scale, num_local_experts=2, moe_layers=[], no_rope_layers=[1, 0],
        bos_token_id=0, eos_token_id=0, pad_token_id=1, attn_implementation="sdpa")
    built = T.Llama4ForCausalLM(config).double()
    batches = token_batches()
    chain, _ = sw.functionalize(built, units=T.models.llama4.modeling_llama4.Llama4TextDecoderLayer,
                                example_input=batches[0][0])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"Llama4TextAttention\) makes positions with arange in its forward"):
        sw.context_parallel(step, "cp")


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_a_rotary_embedding_named_pos_emb_is_fed_positions_not_refused_as_a_table(attention: str) -> None:
    """LFM2-MoE names its rotary embedding ``model.pos_emb``: its ``inv_freq`` buffer, named like a position
    table, was refused as one not listed in positions= (even with positions=(), and the advice was to rename
    it), though a rotary embedding is fed the rank's global positions. Its frequencies are not a table read by
    position; an LFM2-MoE of attention layers only now equals one device."""
    extra = dict(layer_types=["full_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=8, num_dense_layers=1, experts_implementation="eager")
    step, params, batches = family_step("Lfm2Moe", **extra)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention), step, sw.Mesh(cp=2), batches, params)
