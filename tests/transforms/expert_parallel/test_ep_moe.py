"""moe_dispatch_combine against the single-device MoE (shardwise.testing.models.TopKMoE), forward and gradients.

float64 on thread ranks; the distributed layer computes each expert row by row as the reference does
(batched instead of gathered) and sums a token's k contributions in another order, so results agree
to rounding: tolerance 1e-12. Gradients of the replicated router are per rank and summed over the
ranks here (what a psum over ep does in a step); those of the experts must be complete on their
owner, with no reduction. With a capacity, the reference applies the drop rule of capacity.py
itself, in a plain loop per rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.collectives import Mesh, launch
from shardwise.testing.models import MoEBlock, TopKMoE
from shardwise.transforms.expert_parallel import moe_dispatch_combine, shard_experts

TOL = {"rtol": 1e-12, "atol": 1e-12}
AUX = 0.37  # the auxiliary loss's weight in the test loss: any value that is not 0 or 1


def make_moe(hidden, num_experts, top_k, normalize, seed=0):
    torch.manual_seed(seed)
    return TopKMoE(hidden, 2 * hidden, num_experts, top_k, normalize).double()


def kept_mask(chosen: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """The drop rule, as a loop: choice by choice, token by token, an expert keeps its first ``capacity``."""
    n, k = chosen.shape
    keep = torch.ones(n, k, dtype=torch.bool)
    if capacity is None:
        return keep
    taken = [0] * num_experts
    for j in range(k):
        for t in range(n):
            e = int(chosen[t, j])
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def reference(moe: TopKMoE, parts, g_parts, capacity_factor):
    """Output per part, aux loss over all parts, gradients of (tokens per part, router, gate_up, down), drops."""
    parts = [p.detach().requires_grad_() for p in parts]
    num_experts = moe.gate.out_features
    outs, dropped = [], 0
    for x in parts:
        probs = torch.softmax(moe.router_logits(x), dim=-1)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
        if moe.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        capacity = None if capacity_factor is None else math.ceil(capacity_factor * len(x) * moe.top_k / num_experts)
        keep = kept_mask(chosen, num_experts, capacity)
        dropped += int((~keep).sum())
        rows = [
            sum((weights[t, j] * moe.experts.expert(int(chosen[t, j]), x[t]) for j in range(moe.top_k) if keep[t, j]),
                torch.zeros_like(x[t]))
            for t in range(len(x))
        ]
        outs.append(torch.stack(rows) if rows else torch.zeros_like(x))
    whole = torch.cat(parts)
    probs = torch.softmax(moe.router_logits(whole), dim=-1)
    counts = F.one_hot(torch.topk(probs, moe.top_k, dim=-1).indices, num_experts).sum((0, 1)).double()
    aux = num_experts * torch.sum(counts / len(whole) * probs.mean(0))
    loss = sum((o * g).sum() for o, g in zip(outs, g_parts, strict=True)) + AUX * aux
    params = (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    grads = torch.autograd.grad(loss, (*parts, *params))
    return [o.detach() for o in outs], aux.detach(), grads[: len(parts)], grads[len(parts) :], dropped


def distributed(moe: TopKMoE, parts, g_parts, capacity_factor, router=None):
    ep = len(parts)
    router = router or ("softmax_topk_renormalized" if moe.normalize else "softmax_topk")

    def main():
        with Mesh(ep=ep) as mesh:
            mine = parts[mesh.rank].clone().requires_grad_()
            w = moe.gate.weight.detach().clone().requires_grad_()
            gate_up, down = (shard_experts(p.detach(), "ep").clone().requires_grad_()
                             for p in (moe.experts.gate_up_proj, moe.experts.down_proj))
            res = moe_dispatch_combine(mine, mine @ w.T, gate_up, down, "ep", top_k=moe.top_k, router=router,
                                       capacity_factor=capacity_factor)
            loss = (res.output * g_parts[mesh.rank]).sum() + AUX * res.aux_loss
            grads = torch.autograd.grad(loss, (mine, w, gate_up, down))
            return res._replace(output=res.output.detach(), aux_loss=res.aux_loss.detach()), grads

    return launch(main, world=ep, timeout=60)


def check(moe, sizes, capacity_factor, seed=0):
    hidden, num_experts = moe.gate.in_features, moe.gate.out_features
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, hidden, dtype=torch.float64, generator=gen) for n in sizes]
    g_parts = [torch.randn(n, hidden, dtype=torch.float64, generator=gen) for n in sizes]
    ref_out, ref_aux, ref_token_grads, (ref_w, ref_gate_up, ref_down), ref_dropped = reference(
        moe, parts, g_parts, capacity_factor
    )
    results = distributed(moe, parts, g_parts, capacity_factor)
    local = num_experts // len(sizes)
    for rank, (res, (g_tokens, _, g_gate_up, g_down)) in enumerate(results):
        torch.testing.assert_close(res.output, ref_out[rank], **TOL)
        torch.testing.assert_close(res.aux_loss, ref_aux, **TOL)
        assert res.dropped == ref_dropped
        torch.testing.assert_close(g_tokens, ref_token_grads[rank], **TOL)
        mine = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(g_gate_up, ref_gate_up[mine], **TOL, msg="expert grads complete on the owner")
        torch.testing.assert_close(g_down, ref_down[mine], **TOL)
    torch.testing.assert_close(sum(g[1] for _, g in results), ref_w, **TOL, msg="router grads summed over ep")
    return results


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("normalize", [True, False])
def test_equals_single_device_moe_when_nothing_is_dropped(ep, top_k, normalize):
    results = check(make_moe(6, 2 * ep, top_k, normalize), [5] * ep, None)
    assert all(res.dropped == 0 for res, _ in results)


@pytest.mark.parametrize("ep", [2, 4])
def test_capacity_drops_by_the_stated_rule(ep):
    results = check(make_moe(6, 2 * ep, 2, True), [6] * ep, 0.5)
    assert results[0][0].dropped > 0  # the case exercises dropping


def test_ranks_may_hold_different_token_counts_even_none():
    check(make_moe(4, 4, 2, True), [1, 7], None)
    check(make_moe(4, 4, 2, True), [0, 3], 1.0)
    check(make_moe(4, 4, 2, True), [3, 8, 2, 5], 1.0)


@settings(max_examples=6)
@given(
    ep=st.sampled_from([2, 4]),
    local_experts=st.integers(1, 2),
    top_k=st.integers(1, 3),
    sizes=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    capacity_factor=st.sampled_from([None, 0.5, 1.0, 2.0]),
    normalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_moe_equals_single_device(ep, local_experts, top_k, sizes, capacity_factor, normalize, seed):
    num_experts = ep * local_experts
    check(make_moe(4, num_experts, min(top_k, num_experts), normalize, seed), sizes[:ep], capacity_factor, seed)


def test_aux_loss_is_huggingfaces_over_the_global_batch():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = make_moe(4, 4, 2, True)
    parts = [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]
    results = distributed(moe, parts, [torch.zeros_like(p) for p in parts], None)
    logits = moe.router_logits(torch.cat(parts)).detach()
    hf = load_balancing_loss_func((logits,), num_experts=4, top_k=2)  # computes in float32
    for res, _ in results:
        torch.testing.assert_close(res.aux_loss, hf.double(), rtol=1e-6, atol=1e-6)


def test_moe_block_on_a_batch_split_over_ep_equals_the_block():
    """The tiny MoE block: attention on each rank's sequences, the MoE through moe_dispatch_combine."""
    torch.manual_seed(0)
    block = MoEBlock(d_model=8, n_heads=2, seq_len=4, num_experts=4, top_k=2).double()
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    ref = block(x)
    (ref_attn_grad,) = torch.autograd.grad(ref.sum(), (block.attn.qkv.weight,))

    def main():
        with Mesh(ep=2) as mesh:
            mine = x[2 * mesh.rank : 2 * mesh.rank + 2]
            h = mine + block.attn(block.ln1(mine))
            tokens = block.ln2(h).reshape(-1, 8)
            experts = [shard_experts(p, "ep") for p in (block.moe.experts.gate_up_proj, block.moe.experts.down_proj)]
            res = moe_dispatch_combine(tokens, block.moe.router_logits(tokens), *experts, "ep", top_k=2)
            out = h + res.output.view_as(h)
            (grad,) = torch.autograd.grad(out.sum(), (block.attn.qkv.weight,))
            return out.detach(), grad

    results = launch(main, world=2, timeout=60)
    torch.testing.assert_close(torch.cat([out for out, _ in results]), ref.detach(), **TOL)
    torch.testing.assert_close(sum(g for _, g in results), ref_attn_grad, **TOL)


def test_torch_func_grad_equals_autograd():
    moe = make_moe(4, 4, 2, True)
    x = torch.randn(8, 4, dtype=torch.float64)

    def main():
        with Mesh(ep=2) as mesh:
            mine = x[4 * mesh.rank : 4 * mesh.rank + 4]
            experts = [shard_experts(p.detach(), "ep") for p in (moe.experts.gate_up_proj, moe.experts.down_proj)]
            w = moe.gate.weight.detach()

            def loss(tokens, gate_up, down):
                return moe_dispatch_combine(tokens, tokens @ w.T, gate_up, down, "ep", top_k=2).output.pow(2).sum()

            functional = torch.func.grad(loss, argnums=(0, 1, 2))(mine, *experts)
            leaves = [t.clone().requires_grad_() for t in (mine, *experts)]
            return functional, torch.autograd.grad(loss(*leaves), leaves)

    # Not bitwise: under torch.func the token gradient's index backward sums in another order (1e-16 apart).
    for functional, autograd in launch(main, world=2, timeout=60):
        for a, b in zip(functional, autograd, strict=True):
            torch.testing.assert_close(a, b, **TOL)
