"""sw.expert_parallel beside sw.tensor_parallel: the experts split over ep, attention over tp.

tensor_parallel rewrites the layers first (the engine's SPLIT_ORDER) and installs its forwards on the
attention modules; expert_parallel finds the MoE blocks through tensor_parallel's layer wrapper and
installs its forward on them. Each tp rank routes the same tokens (attention's output is summed over
tp), so the experts are replicated over tp, and the batch is cut over ep. float64 on thread ranks,
equal to the single-device step to rounding (assert_equivalent's float64 default); the ledger
equals the Plan on both axes.
"""

from __future__ import annotations

import pytest

import shardwise as sw

from .test_ep_router_aux import _mixtral
from .test_ep_step import _ledger, batches, moe_model

PLAN = {
    "*.attn": sw.tp.Region(heads=("n_heads",)), "*.attn.qkv": sw.tp.Colwise(fused=3), "*.attn.proj": sw.tp.Rowwise(),
}


@pytest.mark.parametrize("ep_first", [True, False])
def test_tp_2_by_ep_2_equals_the_single_device_step(ep_first: bool) -> None:
    step, params = moe_model()
    if ep_first:
        composed = sw.tensor_parallel(sw.expert_parallel(step, "ep"), "tp", PLAN)
    else:
        composed = sw.expert_parallel(sw.tensor_parallel(step, "tp", PLAN), "ep")
    mesh = sw.Mesh(ep=2, tp=2)
    cut = {name: c.axis for (_layer, name), c in composed.split.tensor_splits(composed.base_chain, mesh).items()}
    assert cut == {"attn.qkv.weight": "tp", "attn.qkv.bias": "tp", "attn.proj.weight": "tp",
                   "moe.experts.gate_up_proj": "ep", "moe.experts.down_proj": "ep"}
    sw.testing.assert_equivalent(composed, step, mesh, batches(), params)


def test_every_rank_issues_exactly_the_collectives_its_plan_lists() -> None:
    step, params = moe_model()
    composed = sw.tensor_parallel(sw.expert_parallel(step, "ep", capacity_factor=1.0, drop_per_rank=True), "tp", PLAN)
    mesh, batch = sw.Mesh(ep=2, tp=2), batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    ops = {(c.axis, c.op) for c in plan.collectives(0)}
    assert {("ep", "all_to_all"), ("ep", "psum"), ("tp", "psum")} <= ops
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


def test_dp_by_tp_by_ep_with_zero_3_and_the_aux_loss_equals_the_single_device_step() -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.shard_params(sw.tensor_parallel(sw.expert_parallel(reference, "ep"), "tp", PLAN), "dp", 3)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, ep=2, tp=2), batches(), params)


def test_hf_mixtral_tp_2_by_ep_2_equals_the_single_device_step() -> None:
    _, step, params, data = _mixtral()
    attention = {
        "model.layers.*.self_attn": sw.tp.Region(heads=("config.num_attention_heads", "config.num_key_value_heads")),
        "model.layers.*.self_attn.[qkv]_proj": sw.tp.Colwise(),
        "model.layers.*.self_attn.o_proj": sw.tp.Rowwise(),
    }
    composed = sw.expert_parallel(sw.tensor_parallel(step, "tp", attention), "ep")
    sw.testing.assert_equivalent(composed, step, sw.Mesh(ep=2, tp=2), data, params)


@pytest.mark.parametrize("ep_first", [True, False])
def test_sequence_parallel_by_ep_equals_the_single_device_step(ep_first: bool) -> None:
    """Each (tp, ep) rank routes its slice of the sequence of its share of the batch; TopKMoE's experts
    (not transformers' code, so tensor_parallel alone refuses them in a sequence-parallel block) run inside
    expert_parallel's forward, which the guard takes as one per-token op (test_ep_sequence_parallel.py has
    transformers' models)."""
    step, params = moe_model()
    if ep_first:
        composed = sw.tensor_parallel(sw.expert_parallel(step, "ep"), "tp", PLAN, sequence_parallel="[12]")
    else:
        composed = sw.expert_parallel(sw.tensor_parallel(step, "tp", PLAN, sequence_parallel="[12]"), "ep")
    mesh = sw.Mesh(ep=2, tp=2)
    sw.testing.assert_equivalent(composed, step, mesh, batches(), params)
    sw.testing.assert_plan_is_run(composed, mesh, params, batches(1)[0])


def test_pp_by_tp_sp_by_ep_equals_the_single_device_step_and_the_ledger_is_the_plan() -> None:
    step, params = moe_model()
    composed = sw.pipeline(
        sw.tensor_parallel(sw.expert_parallel(step, "ep"), "tp", PLAN, sequence_parallel="[12]"), "pp", "1f1b", 1
    )
    mesh = sw.Mesh(pp=2, ep=2, tp=2)
    sw.testing.assert_equivalent(composed, step, mesh, batches(), params)
    sw.testing.assert_plan_is_run(composed, mesh, params, batches(1)[0])


def test_sequence_parallel_with_the_aux_loss_is_refused_with_the_fix() -> None:
    step, _ = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    sequence = sw.tensor_parallel(reference, "tp", PLAN, sequence_parallel="[12]")
    with pytest.raises(ValueError, match=r"expert_parallel with tensor_parallel\(.* under router_aux_loss\(.*routes "
                                         r"only its slice.*drop sequence_parallel= or the aux loss"):
        sw.expert_parallel(sequence, "ep")
    with pytest.raises(ValueError, match=r"expert_parallel with tensor_parallel\(.* under router_aux_loss"):
        sw.tensor_parallel(sw.expert_parallel(reference, "ep"), "tp", PLAN, sequence_parallel="[12]")


def test_a_tensor_parallel_plan_styling_the_moe_block_is_refused() -> None:
    step, _ = moe_model()
    moe_styled = {"*.moe": sw.tp.Region(), "*.moe.gate": sw.tp.Colwise(output="replicated")}
    styled = sw.tensor_parallel(step, "tp", {**PLAN, **moe_styled})
    with pytest.raises(ValueError, match=r"expert_parallel: 1.moe \(TopKMoE\) already runs another split's forward"):
        sw.expert_parallel(styled, "ep")


def test_pp_by_tp_by_ep_with_the_aux_loss_equals_the_single_device_step_and_the_ledger_is_the_plan() -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.pipeline(sw.tensor_parallel(sw.expert_parallel(reference, "ep"), "tp", PLAN), "pp", "1f1b", 1)
    mesh = sw.Mesh(pp=2, ep=2, tp=2)
    sw.testing.assert_equivalent(composed, reference, mesh, batches(), params)
    batch = batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


@pytest.mark.parametrize("ep", [1, 2])
def test_router_aux_loss_beside_a_vocabulary_parallel_head(ep: int) -> None:
    """The head's logits split over the vocabulary and the loss's vocab-parallel cross-entropy, with
    router_aux_loss: its routing statistics, carried beside the logits, were wrapped as split logits too, and
    their reshape refused as one changing the vocabulary dimension. Only the split head's output is guarded."""
    _, step, params, data = _mixtral()
    vocab = sw.train_step(step.chain, lambda out, t: sw.tp.vocab_parallel_cross_entropy(out.logits, t),
                          sw.optim.sgd(0.1, momentum=0.9))
    aux = sw.router_aux_loss(vocab, 0.5)
    split = sw.tensor_parallel(aux, "tp", {"lm_head": sw.tp.Colwise()})
    if ep > 1:
        split = sw.expert_parallel(split, "ep")
    sw.testing.assert_equivalent(split, aux, sw.Mesh(ep=ep, tp=2), data, params)


def test_split_logits_laid_out_otherwise_are_still_guarded() -> None:
    """The review's case: guarding only tensors whose last dim is the split's width let a head's logits returned
    transposed (B, V, T) through, and a z-loss over their vocabulary dim ran on each rank's slice (9.4% off). A
    tensor with the width in any dim is guarded."""
    import torch

    class Transposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(ids))).transpose(1, 2)

    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(o.transpose(1, 2), t) + 0.1 * o.logsumexp(1).pow(2).mean()

    torch.manual_seed(0)
    chain, params = sw.functionalize(Transposed().double(), units=["emb", "head"])
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen))]
    split = sw.tensor_parallel(step, "tp", {"head": sw.tp.Colwise(output="sharded")})
    with pytest.raises(sw.collectives.RankFailed, match="tensor_parallel: "):
        sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), data, params)
