"""sw.router_aux_loss: the routers' load-balancing loss in the step's loss, counted once over the batch.

On one device it is Hugging Face Mixtral's ``output_router_logits=True`` aux loss (HF sums it in
float32, hence that test's tolerance); under expert_parallel and ZeRO the step equals the
single-device step with the same aux loss in float64 (assert_equivalent's default), and the ledger
equals the Plan, which lists the routing counts' sums over the batch's axes after the loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardwise as sw
from shardwise.testing.models import MoEBlock, TopKMoE

from .test_ep_step import F64, _ledger, _lm_loss, batches, moe_model


def _first_loss(step: sw.Step, params: Any, batch: Any) -> float:
    _, metrics = step(step.init(params), batch)
    return float(metrics["loss"])


def _mixtral() -> tuple[Any, sw.Step, Any, list[Any]]:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, attn_implementation="eager", experts_implementation="eager", bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.MixtralForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 6), generator=gen), torch.randint(32, (4, 6), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    return model, sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, data


def _with_hfs_aux_loss(model: Any, step: sw.Step, params: Any, batch: Any, coef: float = 0.5) -> sw.Step:
    """``router_aux_loss(step, coef)``, once its first loss is ``step``'s plus coef x the HF model's own aux
    loss on ``batch`` (HF sums it in float32: agreement to float32's rounding)."""
    reference = sw.router_aux_loss(step, coef)
    added = _first_loss(reference, params, batch) - _first_loss(step, params, batch)
    with torch.no_grad():
        hf = model(batch[0], output_router_logits=True).aux_loss
    assert added == pytest.approx(coef * float(hf), rel=1e-6)
    return reference


def test_on_one_device_it_is_hf_mixtrals_aux_loss() -> None:
    model, step, params, data = _mixtral()
    coef = 0.5
    added = _first_loss(sw.router_aux_loss(step, coef), params, data[0]) - _first_loss(step, params, data[0])
    with torch.no_grad():
        hf = model(data[0][0], output_router_logits=True).aux_loss
    # HF sums the counts and probabilities in float32: agreement to float32's rounding.
    assert added == pytest.approx(coef * float(hf), rel=1e-6)
    assert added > 0.1 * coef  # the aux loss is about top_k = 2 for a near-uniform router: it is there


@pytest.mark.parametrize(("ep", "aux_first"), [(2, True), (4, True), (2, False)])
def test_ep_with_the_aux_loss_equals_the_single_device_step(ep: int, aux_first: bool) -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    if aux_first:
        composed = sw.expert_parallel(reference, "ep")
    else:
        composed = sw.router_aux_loss(sw.expert_parallel(step, "ep"), 0.1)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=ep), batches(), params)


def test_dp_by_ep_with_zero_3_and_the_aux_loss_equals_the_single_device_step() -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", 3)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, ep=2), batches(), params)


@pytest.mark.parametrize("model", ["TopKMoE", "Mixtral"])
def test_a_pipeline_without_ep_carries_the_routing_across_stages(model: str) -> None:
    """Without expert_parallel the MoE block routes on values (data-dependent: the Plan predicts no boundary),
    so the stage output that carries the routing statistics travels with its structure: it failed at the
    first step, refused as an output the receiver could not rebuild."""
    if model == "Mixtral":
        _, step, params, data = _mixtral()
    else:
        step, params = moe_model()
        data = batches()
    reference = sw.router_aux_loss(step, 0.1)
    piped = sw.pipeline(reference, "pp", "1f1b", 1)
    assert piped.boundaries(piped.layout(sw.Mesh(pp=2), params), data[0][0]) is None
    sw.testing.assert_equivalent(piped, reference, sw.Mesh(pp=2), data, params)
    sw.testing.assert_equivalent(sw.shard_params(piped, "dp", 3), reference, sw.Mesh(dp=2, pp=2), data, params)


def test_experts_frozen_in_the_module_keep_the_aux_loss_which_reads_only_the_routers() -> None:
    """Fine-tuning attention and routers with the experts frozen (requires_grad=False): router_aux_loss was
    refused as if it split the experts; expert_parallel, which does, refuses and names the optimizer's
    frozen group that keeps them fixed."""
    model, _, _, data = _mixtral()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    reference = _with_hfs_aux_loss(model, step, params, data[0])
    sw.testing.assert_equivalent(sw.shard_params(reference, "dp", 3), reference, sw.Mesh(dp=2), data, params)
    fix = r"frozen with requires_grad=False.*sw\.optim\.group\('\*experts\*', frozen=True\)"
    with pytest.raises(ValueError, match=fix):
        sw.expert_parallel(step, "ep")


def test_the_aux_loss_is_counted_once_not_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's aux loss of its own share's routing, averaged, is another loss: the check sees it."""
    from shardwise.engine.stack import in_layer

    step, params = moe_model()
    reference = sw.router_aux_loss(step, 1.0)
    composed = sw.expert_parallel(reference, "ep")
    diverges = r"not equivalent: first divergence at step 1"
    with pytest.raises(sw.testing.NotEquivalentError, match=diverges):  # the step without the aux loss differs
        sw.testing.assert_equivalent(composed, step, sw.Mesh(ep=2), batches(1), params)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=2), batches(1), params)  # counted once: equal
    monkeypatch.setattr(in_layer, "batch_sum", lambda x, label: x.detach())  # each rank's own counts
    with pytest.raises(sw.testing.NotEquivalentError, match=diverges):
        sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=2), batches(1), params)


def test_hf_mixtral_with_the_aux_loss_under_ep_equals_the_single_device_step() -> None:
    _, step, params, data = _mixtral()
    reference = sw.router_aux_loss(step, 0.02)
    sw.testing.assert_equivalent(sw.expert_parallel(reference, "ep"), reference, sw.Mesh(ep=2), data, params)


def test_the_plan_lists_the_counts_sums_after_the_loss_and_the_ledger_is_the_plan() -> None:
    step, params = moe_model()
    ep = sw.expert_parallel(sw.router_aux_loss(step, 0.1), "ep", capacity_factor=1.0, drop_per_rank=True)
    composed = sw.shard_params(ep, "dp", 3)
    mesh, batch = sw.Mesh(dp=2, ep=2), batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    sums = [(a.op, a.axis, a.wire[0].nbytes) for a in plan.actions[0] if a.label == "router aux counts"]
    # The 4 experts' counts and the rows, float64, summed over dp then ep.
    assert sums == [("psum", "dp", 5 * 8), ("psum", "ep", 5 * 8)]
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


def test_data_parallel_alone_is_expert_parallel_over_an_axis_of_size_1() -> None:
    """Every expert on each rank, the counts summed over dp (and the ep axis of one rank), listed in the
    Plan: the same step as shard_params alone."""
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", 1)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, ep=1), batches(), params)
    plan = composed.plan(sw.Mesh(dp=2, ep=1), params, batches(1)[0])
    assert [(a.op, a.axis) for a in plan.actions[0] if a.label == "router aux counts"] == [("psum", "dp"),
                                                                                          ("psum", "ep")]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_alone_with_the_aux_loss_equals_the_single_device_step_and_the_ledger_is_the_plan(stage: int) -> None:
    """FSDP of an MoE with its aux loss, no expert_parallel: the counts are summed over dp after the loss,
    and the Plan predicts that sum without a split's layers (it was refused, pointing at an ep axis of 1)."""
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.shard_params(reference, "dp", stage)
    mesh, batch = sw.Mesh(dp=2), batches(1)[0]
    sw.testing.assert_equivalent(composed, reference, mesh, batches(), params)
    plan = composed.plan(mesh, params, batch)
    assert [(a.op, a.axis) for a in plan.actions[0] if a.label == "router aux counts"] == [("psum", "dp")]
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


class _OddRouter(nn.Module):
    """Fused experts behind a router no known block has."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = TopKMoE(4, 4, 2, 1).experts


def test_clear_errors() -> None:
    step, _ = moe_model()
    with pytest.raises(ValueError, match=r"router_aux_loss\(coef=-1\)"):
        sw.router_aux_loss(step, -1)
    odd, _ = sw.functionalize(nn.Sequential(_OddRouter()))
    unknown = r"^router_aux_loss: 0 \(_OddRouter, router Linear\)(.|\n)*not one router_aux_loss knows"
    with pytest.raises(ValueError, match=unknown):
        sw.router_aux_loss(sw.train_step(odd, F.mse_loss, sw.optim.sgd(0.1)), 0.1)  # no expert_parallel in sight
    with pytest.raises(ValueError, match="router_aux_loss was applied twice"):
        sw.router_aux_loss(sw.router_aux_loss(step, 0.1), 0.1)


def test_with_a_per_shard_mean_loss_the_aux_loss_is_counted_once() -> None:
    """tokens="per_shard_mean" (the shares' means averaged, knowingly) takes the aux loss too, counted
    once. On shares of equal weight it is the mean loss, so the step equals the single-device one with the
    aux. (A token-weighted loss with the aux loss: test_ep_router_aux_tokens.py.)"""
    step, params = moe_model()
    per_share = sw.train_step(step.chain, step.loss_fn, step.optimizer, tokens="per_shard_mean")
    composed = sw.expert_parallel(sw.router_aux_loss(per_share, 0.1), "ep")
    sw.testing.assert_equivalent(composed, sw.router_aux_loss(step, 0.1), sw.Mesh(ep=2), batches(), params)


def test_under_remat_and_mixed_precision_it_equals_the_same_policy_on_one_device() -> None:
    """remat recomputes the blocks' router logits in backward (the reports run again, unheard)."""
    step, params = moe_model()
    reference = sw.mixed_precision(sw.router_aux_loss(step, 0.1), F64)
    composed = sw.remat(sw.mixed_precision(sw.expert_parallel(sw.router_aux_loss(step, 0.1), "ep"), F64))
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=2), batches(), params)


def test_hf_qwen2_moe_aux_loss_on_one_device_and_under_ep() -> None:
    """Qwen2-MoE's router (no renormalization here) and its shared expert: the aux loss is the router's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=16,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = transformers.Qwen2MoeForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 6), generator=gen), torch.randint(32, (4, 6), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=Qwen2MoeDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    reference = _with_hfs_aux_loss(model, step, params, data[0])
    sw.testing.assert_equivalent(sw.expert_parallel(reference, "ep"), reference, sw.Mesh(ep=2), data, params)


@pytest.mark.parametrize("family", ["Olmoe", "Qwen3Moe"])
@pytest.mark.parametrize("renormalized", [False, True])
def test_hf_olmoe_and_qwen3_moe_on_one_device_and_under_ep(family: str, renormalized: bool) -> None:
    """OLMoE's and Qwen3-MoE's blocks are Qwen2-MoE's without the shared expert, their routers line for line
    Qwen2-MoE's: known to expert_parallel and router_aux_loss (both refused them, naming the router)."""
    transformers = pytest.importorskip("transformers")
    module = getattr(transformers.models, family.lower().replace("qwen3moe", "qwen3_moe"))
    layer = getattr(getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[1]}"), f"{family}DecoderLayer")
    torch.manual_seed(0)
    sizes = {"num_experts": 4} if family == "Olmoe" else {"num_experts": 4, "moe_intermediate_size": 12}
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, norm_topk_prob=renormalized, max_position_embeddings=16,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0, **sizes,
    )
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 6), generator=gen), torch.randint(32, (4, 6), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=layer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)
    reference = _with_hfs_aux_loss(model, step, params, data[0])
    sw.testing.assert_equivalent(sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", 3), reference,
                                 sw.Mesh(dp=2, ep=2), data, params)


def test_a_padded_batch_leaves_the_padding_out_as_hf_does_on_one_device_and_under_ep() -> None:
    """HF weighs each row of the aux loss by the attention mask: padding routes, but does not count."""
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    model, _, _, _ = _mixtral()
    gen = torch.Generator().manual_seed(2)
    data = []
    for _ in range(2):
        ids = torch.randint(1, 32, (4, 6), generator=gen)
        mask = torch.ones(4, 6, dtype=torch.long)
        mask[0, 4:] = mask[2, 3:] = mask[3, 5:] = 0  # right padding (left padding gives NaN in HF's eager attention)
        data.append(({"input_ids": ids, "attention_mask": mask}, torch.randint(32, (4, 6), generator=gen)))
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    coef = 0.5
    reference = sw.router_aux_loss(step, coef)
    added = _first_loss(reference, params, data[0]) - _first_loss(step, params, data[0])
    with torch.no_grad():
        hf = model(**data[0][0], output_router_logits=True).aux_loss
        unmasked = model(data[0][0]["input_ids"], output_router_logits=True).aux_loss
    assert added == pytest.approx(coef * float(hf), rel=1e-6)  # HF sums in float32
    assert abs(float(hf) - float(unmasked)) > 1e-3  # the mask matters here
    composed = sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", 1)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, ep=2), data, params)


@settings(max_examples=4)
@given(
    ep=st.sampled_from([2, 4]),
    dp=st.sampled_from([1, 2]),
    local_experts=st.integers(1, 2),
    top_k=st.integers(1, 2),
    coef=st.sampled_from([0.01, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_the_aux_loss_under_dp_by_ep_equals_the_single_device_step(
    ep: int, dp: int, local_experts: int, top_k: int, coef: float, seed: int
) -> None:
    num_experts = ep * local_experts
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), MoEBlock(8, 2, 4, num_experts, top_k), MoEBlock(8, 2, 4, num_experts, 1),
        torch.nn.Linear(8, 3),
    ).double()
    chain, params = sw.functionalize(model)
    reference = sw.router_aux_loss(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), coef)
    composed = sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", 3)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=dp, ep=ep), batches(size=8), params)


@pytest.mark.parametrize("stack", ["remat", "dp x ep, ZeRO-3, remat"])
def test_a_padded_batch_under_remat_equals_the_single_device_step(stack: str) -> None:
    """Under remat the MoE block's recomputation runs without the batch's mask (outside the layer's
    collecting()). The rows were weighed by the mask inside the block, so the recomputation saved other
    tensors: a CheckpointError (65 saved in forward, 64 in recomputation) that aborted the launch, and
    made equal in count, a silently wrong router gradient (grad norm off by 5e-4 relative). The rows are
    weighed after the block now; it replays the softmax and top k alone."""
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    model, _, _, _ = _mixtral()
    gen = torch.Generator().manual_seed(3)
    data = []
    for _ in range(2):
        ids = torch.randint(1, 32, (8, 6), generator=gen)
        mask = torch.ones(8, 6, dtype=torch.long)
        mask[0, 4:] = mask[5, 2:] = mask[7, 5:] = 0
        data.append(({"input_ids": ids, "attention_mask": mask}, torch.randint(32, (8, 6), generator=gen)))
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    reference = sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9)), 0.5)
    if stack == "remat":
        composed, mesh = sw.remat(sw.expert_parallel(reference, "ep")), sw.Mesh(ep=1)
    else:
        composed, mesh = sw.shard_params(sw.remat(sw.expert_parallel(reference, "ep")), "dp", 3), sw.Mesh(dp=2, ep=2)
    sw.testing.assert_equivalent(composed, reference, mesh, data, params)


def test_mixtral_router_jitter_noise_is_refused() -> None:
    """HF's aux loss is of the jittered router logits; the reported ones are of the block's input, so with
    jitter in training the step's aux was not HF's, without an error."""
    model, _, params, data = _mixtral()
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    chain, params = sw.functionalize(model, units=type(model.model.layers[0]), example_input=data[0][0])
    with_aux = sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1)), 0.02)
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1.*set config.router_jitter_noise = 0"):
        with_aux(with_aux.init(params), data[0])


def _mixtral_adding_its_aux(coef: float) -> tuple[Any, Any]:
    """Mixtral built with output_router_logits=True: its ``loss`` adds ``coef`` x the aux loss of the
    batch it is called on. The whole model is one layer (split into units it cannot run, below)."""
    model, _, _, data = _mixtral()
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, coef
    ids = data[0][0]
    chain, params = sw.functionalize(model, example_input={"input_ids": ids, "labels": ids})
    return sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1, momentum=0.9)), params


def test_a_model_adding_its_own_aux_loss_is_refused_where_the_batch_is_cut() -> None:
    """Under data or expert parallel each rank's model added the aux loss of its share of the batch: the
    step trained on the mean of the shares' aux losses, 1e-4 of the loss away from the single-device
    step's, without an error. Refused, as is router_aux_loss on top (the aux counted twice); with a
    zero coefficient nothing is added, and the step is accepted."""
    step, _ = _mixtral_adding_its_aux(0.5)
    fix = r"Set config.output_router_logits = False before functionalize and apply sw.router_aux_loss"
    for transform, why in [
        (lambda s: sw.shard_params(s, "dp", 3), r"under shard_params each rank \(or micro-batch\) calls it on a part"),
        (lambda s: sw.expert_parallel(s, "ep"), r"under expert_parallel each rank"),
        (lambda s: sw.router_aux_loss(s, 0.5), r"router_aux_loss adds the same loss again, so it would be counted"),
    ]:
        with pytest.raises(ValueError, match=r"'model' \(MixtralForCausalLM, router_aux_loss_coef=0.5\) adds its "
                           rf"routers' load-balancing loss to the loss it returns.*{why}.*{fix}"):
            transform(step)
    unscaled, _ = _mixtral_adding_its_aux(0.0)
    assert [t.name for t in sw.expert_parallel(sw.shard_params(unscaled, "dp", 3), "ep").transforms] == [
        "shard_params", "expert_parallel"]


def test_a_model_adding_its_own_aux_loss_split_into_units_is_refused_by_functionalize() -> None:
    """Split into decoder layers, HF's forward found no recorded router logits: an IndexError from inside
    transformers. functionalize now says why, and what to do."""
    model, _, _, data = _mixtral()
    model.config.output_router_logits = True
    with pytest.raises(sw.FunctionalizeError, match=r"the module itself \(MixtralForCausalLM\) has "
                       r"output_router_logits=True.*split into units.*sw.router_aux_loss\(step, 0.001\)"):
        sw.functionalize(model, units=type(model.model.layers[0]), example_input=data[0][0])
