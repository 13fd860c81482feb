"""Mixtures of experts inside sequence-parallel blocks: the attention split over tp, the MoE block left
whole and run on each rank's slice of the sequence (Megatron's TP + SP with replicated experts).

The guard (positions.py) follows the router op by op (a Linear, a softmax and a top k per token) and
runs the fused experts, whose code is known to compute each token alone and drop none
(engine/model/token_wise.py), as one op; their gradients are summed over tp. Each model equals the
single-device step; the Plan lists what every rank issues; what would train another model is refused:
experts of other code, the model's own aux loss over a slice, router_aux_loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw

transformers = pytest.importorskip("transformers")

# HF's DeepseekV3TopkRouter.forward (GLM-4-MoE's is the same) in the model's dtype, as expert_parallel's tests use it.
from ..expert_parallel.test_ep_own_router import _router_in_the_models_dtype  # noqa: E402

VOCAB, BLOCKS = 64, "model.layers.*"


def _batches(n: int = 2) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(VOCAB, (4, 8), generator=gen), torch.randint(VOCAB, (4, 8), generator=gen))
            for _ in range(n)]


def _model(family: str, **extra: Any) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=16, attn_implementation="eager", experts_implementation="eager",
                  bos_token_id=0, eos_token_id=0)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer as Block
        config = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=12, head_dim=4,
                                             num_experts=4, num_experts_per_tok=2, **common, **extra)
        return transformers.Qwen3MoeForCausalLM(config).double(), Block
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer as Block
        config = transformers.MixtralConfig(intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
                                            **common, **extra)
        return transformers.MixtralForCausalLM(config).double(), Block
    assert family == "qwen2_moe"  # a shared expert, gated by a sigmoid per token, beside the routed ones
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer as Block
    config = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                         shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
                                         **common, **extra)
    return transformers.Qwen2MoeForCausalLM(config).double(), Block


# DeepSeek-V3's and GLM-4-MoE's routing: eight experts in four groups, the best two groups kept, two experts
# a token, scaled; a shared expert; the first layer dense.
GROUPED = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=12,
               intermediate_size=24, num_hidden_layers=3, num_key_value_heads=4, pad_token_id=1)


def _grouped(family: str) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=4, max_position_embeddings=16,
                  attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0)
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer as Block
        config = transformers.DeepseekV3Config(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                               v_head_dim=4, **GROUPED, **common)
        model = transformers.DeepseekV3ForCausalLM(config).double()
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer as Block
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(head_dim=4, **GROUPED, **common)).double()
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():  # HF zero-initializes the routers: every score would tie
        if type(module).__name__.endswith("TopkRouter"):
            module.weight.data.normal_(0.0, 1.0, generator=gen)
            module.e_score_correction_bias.uniform_(-0.5, 0.5, generator=gen)
    return model, Block


def _problem(family: str, **extra: Any) -> tuple[sw.Step, Any, list[Any]]:
    model, block = _grouped(family) if family in ("deepseek_v3", "glm4_moe") else _model(family, **extra)
    batches = _batches()
    chain, params = sw.functionalize(model, units=block, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9))
    return step, params, batches


ATTENTION_ONLY = {k: v for k, v in sw.tp.llama_plan().items() if ".mlp" not in k}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_a_moe_block_on_the_sequence_slices_trains_as_one_device(family: str) -> None:
    step, params, batches = _problem(family)
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


# DeepSeek-V3's attention (low-rank queries and keys/values) split by heads
MLA = {"model.layers.*.self_attn": sw.tp.Region(heads=("num_heads",)),
       "model.layers.*.self_attn.q_b_proj": sw.tp.Colwise(), "model.layers.*.self_attn.kv_b_proj": sw.tp.Colwise(),
       "model.layers.*.self_attn.o_proj": sw.tp.Rowwise()}


def _grouped_plan(family: str) -> dict[str, Any]:
    return {**{k: v for k, v in ATTENTION_ONLY.items() if "attn" not in k}, **MLA} if family == "deepseek_v3" \
        else ATTENTION_ONLY


def test_grouped_routing_on_the_slices_trains_as_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-4-MoE's router (DeepSeek-V3's code) picks two of four groups per token (a mask scattered along
    the groups, scores gathered along the experts: followed row by row) and computes in float32 in a float64
    model, as HF's does; with it in the model's dtype (the same code otherwise) the step equals one device
    to float64's rounding."""
    router = "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter"
    monkeypatch.setattr(f"{router}.forward", _router_in_the_models_dtype)
    step, params, batches = _problem("glm4_moe")
    split = sw.tensor_parallel(step, "tp", _grouped_plan("glm4_moe"), sequence_parallel=BLOCKS)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


@pytest.mark.parametrize("as_hf_writes_it", [False, True])
def test_deepseek_v3_on_the_slices_trains_as_one_device(as_hf_writes_it: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's router, and the RMSNorms of its low-rank attention, compute in float32 in a float64
    model. Tensor parallel sums the attention's input gradient over tp in another order than one device's
    matmul, and the float32 norm's backward rounds that difference to float32's: 3e-9 relative at the
    first step with the router in float64, with or without sequence parallel alike. With both in the
    model's dtype, equal to float64's rounding; as HF writes it, within float32's precision (the bound of
    expert_parallel's test of this router)."""
    if not as_hf_writes_it:
        where = "transformers.models.deepseek_v3.modeling_deepseek_v3"
        monkeypatch.setattr(f"{where}.DeepseekV3TopkRouter.forward", _router_in_the_models_dtype)
        monkeypatch.setattr(f"{where}.DeepseekV3RMSNorm.forward", _rms_norm_in_the_models_dtype)
    step, params, batches = _problem("deepseek_v3")
    split = sw.tensor_parallel(step, "tp", _grouped_plan("deepseek_v3"), sequence_parallel=BLOCKS)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-6 if as_hf_writes_it else 1e-9)


def _rms_norm_in_the_models_dtype(self: Any, hidden_states: Tensor) -> Tensor:
    """HF's DeepseekV3RMSNorm.forward in the model's dtype where HF computes in float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("stack", ["pp2 x tp2 zb_h1", "remat"])
def test_under_a_zero_bubble_pipeline_and_remat(stack: str) -> None:
    """The experts run as one op in a stage's input and weight passes (zb_h1 splits them) and again in
    remat's recomputed forward."""
    step, params, batches = _problem("qwen3_moe")
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    if stack == "remat":
        sw.testing.assert_equivalent(sw.remat(split), step, sw.Mesh(tp=2), batches, params, rtol=1e-9)
    else:
        sw.testing.assert_equivalent(sw.pipeline(split, "pp", "zb_h1", 2), step, sw.Mesh(pp=2, tp=2), batches, params,
                                     rtol=1e-9)


def test_under_zero3_on_another_axis_too() -> None:
    step, params, batches = _problem("qwen3_moe")
    split = sw.shard_params(sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS), "dp", 3)
    sw.testing.assert_equivalent(split, step, sw.Mesh(dp=2, tp=2), batches, params, rtol=1e-9)


@pytest.mark.parametrize("sequence_parallel", [BLOCKS, None])
def test_the_plan_lists_what_every_rank_issues(sequence_parallel: str | None) -> None:
    """The experts read their routing to decide shapes, which fake tensors cannot run: the Plan's
    prediction runs such a layer on real stand-ins (without sequence parallel too, where plan() raised
    torch's DynamicOutputShapeException), and lists exactly what the ranks issue."""
    step, params, batches = _problem("qwen3_moe")
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=sequence_parallel)
    mesh = sw.Mesh(tp=2)
    plan = sw.testing.assert_plan_is_run(split, mesh, params, batches[0])
    ops = {c.op for c in plan.collectives(0)}
    assert ops >= ({"all_gather", "psum_scatter"} if sequence_parallel else {"psum"}), ops


def test_experts_of_other_code_stay_refused_naming_the_mixture() -> None:
    """A subclass of the experts with a forward of its own (the same sums here, but nothing says so)
    is not known to compute each token alone: the guard refuses its dispatch, naming the mixture and
    its experts' class."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class MyExperts(Qwen3MoeExperts):
        def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            return super().forward(hidden_states, top_k_index, top_k_weights)

    model, block = _model("qwen3_moe")
    for layer in model.model.layers:
        mine = MyExperts(model.config).double()
        mine.load_state_dict(layer.mlp.experts.state_dict())
        layer.mlp.experts = mine
    batches = _batches()
    chain, params = sw.functionalize(model, units=block, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y), sw.optim.sgd(0.1))
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    with pytest.raises(ValueError, match=r"mixture of experts 'model\.layers\.0\.mlp'.*its experts \(MyExperts\) "
                                         r"are not.*leave 'model\.layers\.\*' out of sequence_parallel"):
        split.plan(sw.Mesh(tp=2), params, batches[0])


def test_the_models_own_aux_loss_over_a_slice_is_refused_naming_the_setting() -> None:
    """output_router_logits=True: the model's loss adds the aux loss of the router logits it collects,
    which under sequence parallel are this rank's slice's."""
    model, _ = _model("mixtral", output_router_logits=True)
    batches = _batches()
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y), sw.optim.sgd(0.1))
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*'model\.layers\.0\.mlp\.experts' sees only "
                                         r"this rank's slice.*config\.output_router_logits = False"):
        split.plan(sw.Mesh(tp=2), params, batches[0])


def test_router_aux_loss_with_sequence_parallel_is_refused_where_applied() -> None:
    step, _, _ = _problem("qwen3_moe")
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    with pytest.raises(ValueError, match=r"under router_aux_loss.*'model\.layers\.0\.mlp\.experts' routes only this "
                                         r"rank's slice"):
        sw.router_aux_loss(split, 0.01)
    with pytest.raises(ValueError, match=r"under router_aux_loss"):
        sw.tensor_parallel(sw.router_aux_loss(step, 0.01), "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)


def test_which_experts_are_known_to_compute_each_token_alone() -> None:
    """Read from transformers' private experts dispatch (config._experts_implementation, the interface's
    mapping): this fails loudly when transformers changes either. Its own kernels are known; a function
    registered from elsewhere (which may drop tokens over a capacity) is not; nor is another class."""
    from transformers.integrations.moe import ExpertsInterface

    from shardwise.engine.model.token_wise import computes_each_token_alone

    model, _ = _model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert computes_each_token_alone(experts)
    assert not computes_each_token_alone(model.model.layers[0].mlp)  # the block: its router is followed
    for name, known in (("grouped_mm", True), ("batched_mm", True), ("shardwise_test_capacity", False)):
        if name not in ExpertsInterface._global_mapping:
            ExpertsInterface.register(name, lambda self, *args: args[0])
        model.config._experts_implementation = name
        assert experts.config._experts_implementation == name
        assert computes_each_token_alone(experts) is known, name


def test_a_per_token_op_returning_more_than_rows_per_token_is_refused() -> None:
    """A module run as one op (positions.per_token) may return a tuple (GPT-OSS's MLP: its output and its
    router's scores, [tokens, experts]); each part must hold one row per token of the slice, as the input or
    with batch and sequence folded. Anything else is refused; the rows are followed on."""
    from shardwise.transforms.tensor_parallel import positions

    block = nn.Linear(4, 4)
    hidden = torch.randn(2, 3, 4)
    with positions.following("blocks.0", block, hidden, 2):
        out, scores = positions.per_token(lambda: (hidden * 2, torch.zeros(6, 5)), hidden, "blocks.0.mlp")
        with pytest.raises(ValueError, match=r"cumsum acts along dim 0"):
            scores.cumsum(0)  # the folded rows are followed: a sum over the tokens is refused
        with pytest.raises(ValueError, match=r"blocks\.0\.mlp returns \[5, 2\] \(output 1\) for tokens \[2, 3\], not "
                                             r"a row per token"):
            positions.per_token(lambda: (hidden * 2, torch.zeros(5, 2)), hidden, "blocks.0.mlp")
    assert out.shape == hidden.shape
