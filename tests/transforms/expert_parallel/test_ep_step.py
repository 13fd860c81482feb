"""sw.expert_parallel as a step: equal to the single-device step, its Plan what runs, its errors.

float64 on thread ranks. The distributed MoE sums a token's k expert outputs and the replicated
gradients' ep shares in another order than the single device, so results agree to rounding
(assert_equivalent's float64 default). The ledger must equal the Plan exactly: the all-to-alls
carry their bound of rows, so their bytes do not depend on the routing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import MoEBlock, TopKMoE

F64 = "params=f64,compute=f64,output=f64"


def moe_model(num_experts: int = 4, seed: int = 0) -> tuple[sw.Step, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 8), MoEBlock(8, 2, 4, num_experts, 2), MoEBlock(8, 2, 4, num_experts, 1), nn.Linear(8, 3)
    ).double()
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def batches(n: int = 2, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, 6, generator=gen, dtype=torch.float64),
             torch.randn(size, 4, 3, generator=gen, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_alone_equals_the_single_device_step(ep: int) -> None:
    step, params = moe_model()
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=ep), batches(), params)


@pytest.mark.parametrize("stage", [1, 3])
def test_dp_by_ep_with_zero_equals_the_single_device_step(stage: int) -> None:
    step, params = moe_model()
    composed = sw.shard_params(sw.expert_parallel(step, "ep"), "dp", stage)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, ep=2), batches(), params)


def test_ep_with_mixed_precision_and_remat_equals_the_same_policy_on_one_device() -> None:
    step, params = moe_model()
    reference = sw.mixed_precision(step, F64)
    composed = sw.remat(sw.mixed_precision(sw.expert_parallel(step, "ep"), F64))
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=2), batches(), params)


def _ledger(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[list[tuple[str, str, str, int]]]:
    def run() -> list[tuple[str, str, str, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    return sw.launch(run, mesh.size, timeout=120)


@pytest.mark.parametrize("mesh", [sw.Mesh(ep=2), sw.Mesh(dp=2, ep=2)], ids=str)
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(mesh: sw.Mesh) -> None:
    step, params = moe_model()
    ep = sw.expert_parallel(step, "ep", capacity_factor=1.0, drop_per_rank=True)
    if "dp" in mesh.axis_names:
        ep = sw.shard_params(ep, "dp", 2)
    batch = batches(1)[0]
    plan = ep.plan(mesh, params, batch)
    for rank, got in enumerate(_ledger(ep, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"
    # The all-to-alls' bytes by volumes.py's formula, each way: [E x slots, hidden] with slots the
    # capacity ceil(1.0 * tokens * top_k / E) of the rank's tokens, for each block's top_k.
    tokens = 8 // mesh.size * 4
    slots = [min(tokens, -(-tokens * k // 4)) for k in (2, 1)]
    a2a = [c.nbytes for c in plan.collectives(0) if c.op == "all_to_all"]
    assert sorted(a2a) == sorted([4 * s * 8 * 8 for s in slots for _ in range(4)])


def test_each_rank_holds_and_checkpoints_only_its_experts(tmp_path: Path) -> None:
    step, params = moe_model()
    ep = sw.expert_parallel(step, "ep")
    mesh, data = sw.Mesh(ep=2), batches(3)
    reference = step.init(params)
    for batch in data:
        reference, _ = step(reference, batch)

    def save() -> tuple[int, ...]:
        state = ep.init(params, mesh)
        for batch in data[:2]:
            state, _ = ep(state, batch)
        sw.checkpoint.save(tmp_path / "c", state, ep)
        return tuple(state.params["1"]["moe.experts.gate_up_proj"].shape)

    assert sw.launch(save, 2, timeout=120)[0] == (2, 32, 8)  # 2 of the 4 experts

    def resume() -> Any:
        state = sw.checkpoint.load(tmp_path / "c", ep, mesh)
        state, _ = ep(state, data[2])
        return ep.full_params(state)

    full = sw.launch(resume, 2, timeout=120)[0]
    for layer, tensors in reference.params.items():
        for name, want in tensors.items():
            torch.testing.assert_close(full[layer][name], want, rtol=1e-12, atol=1e-14)


def test_clear_errors() -> None:
    step, params = moe_model(num_experts=4)
    with pytest.raises(ValueError, match="4 experts, which the 3 ranks of axis 'ep' do not divide"):
        sw.expert_parallel(step, "ep").plan(sw.Mesh(ep=3), params)
    dense, _ = sw.functionalize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no mixture-of-experts block"):
        sw.expert_parallel(sw.train_step(dense, F.mse_loss, sw.optim.sgd(0.1)), "ep")

    class OddRouter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.experts = TopKMoE(4, 4, 2, 1).experts

    odd, _ = sw.functionalize(nn.Sequential(OddRouter()))
    with pytest.raises(ValueError, match=r"0 \(OddRouter, router Linear\) holds fused experts"):
        sw.expert_parallel(sw.train_step(odd, F.mse_loss, sw.optim.sgd(0.1)), "ep")

    class RouterByName(nn.Module):  # Jamba's block calls its router `router` (it was named "router NoneType")
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(4, 2)
            self.experts = TopKMoE(4, 4, 2, 1).experts

    named, _ = sw.functionalize(nn.Sequential(RouterByName()))
    with pytest.raises(ValueError, match=r"0 \(RouterByName, router Linear\) holds fused experts"):
        sw.expert_parallel(sw.train_step(named, F.mse_loss, sw.optim.sgd(0.1)), "ep")
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        sw.expert_parallel(step, "ep", capacity_factor=-1)
    with pytest.raises(ValueError, match="both use axis 'ep'"):
        sw.shard_params(sw.expert_parallel(step, "ep"), "ep", 1)
    uneven = (torch.randn(6, 4, 6, dtype=torch.float64), torch.randn(6, 4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="expert_parallel over axis 'ep' of size 4"):
        sw.expert_parallel(step, "ep").plan(sw.Mesh(ep=4), params, uneven)


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("stack", ["ep", "dp x ep"])
def test_hf_mixtral_per_decoder_layer_equals_the_single_device_step(stack: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, attn_implementation="eager",
        experts_implementation="eager", bos_token_id=0, eos_token_id=0,  # grouped_mm has no float64 kernel
    )
    model = transformers.MixtralForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 6), generator=gen), torch.randint(32, (4, 6), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    ep = sw.expert_parallel(step, "ep")
    mesh = sw.Mesh(ep=2)
    if stack == "dp x ep":
        ep, mesh = sw.shard_params(ep, "dp", 3), sw.Mesh(dp=2, ep=2)
    split = sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    assert split == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")]
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


def test_a_capacity_that_drops_nothing_equals_the_single_device_step() -> None:
    # capacity ceil(4.0 * tokens * top_k / 4) >= every expert's assignments on a rank: nothing is dropped.
    step, params = moe_model()
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep", capacity_factor=4.0), step, sw.Mesh(ep=2), batches(),
                                 params)


def test_under_remat_and_mixed_precision_the_ledger_is_the_plan_and_it_simulates() -> None:
    step, params = moe_model()
    ep = sw.remat(sw.mixed_precision(sw.expert_parallel(step, "ep"), "params=f64,compute=f32,output=f64,reduce=f64"))
    mesh, batch = sw.Mesh(ep=2), batches(1)[0]
    plan = ep.plan(mesh, params, batch)
    for rank, got in enumerate(_ledger(ep, mesh, params, batch)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"
    wires = {(c.op, c.dtype) for c in plan.collectives(0)}
    # The all-to-alls travel in the compute dtype, the replicated gradients' sums in the reduce dtype;
    # remat recomputes each MoE forward in backward: its all-to-alls twice more.
    assert ("all_to_all", "float32") in wires and ("psum", "float64") in wires
    assert sum(c.op == "all_to_all" for c in plan.collectives(0)) == 2 * 3 * 2
    assert sw.simulate(plan).ranks


def test_hf_qwen2_moe_with_its_shared_expert_equals_the_single_device_step() -> None:
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
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)


def test_from_the_meta_device_each_rank_makes_only_its_experts_and_they_equal_one_device() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    chain, meta_params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=torch.zeros(2, 4).long())
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1))
    ep = sw.expert_parallel(step, "ep")
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def made() -> tuple[tuple[int, ...], Any]:
        state = ep.init(meta_params, sw.Mesh(ep=2), seed=0)
        return tuple(state.params["model.layers.0"][name].shape), ep.full_params(state)

    (shape, full), _ = sw.launch(made, 2, timeout=120)
    assert shape == (2, 48, 16)  # 2 of the 4 experts on each rank
    reference = step.init(meta_params, seed=0).params
    assert all(torch.equal(full[k][n], reference[k][n]) for k in reference for n in reference[k])
