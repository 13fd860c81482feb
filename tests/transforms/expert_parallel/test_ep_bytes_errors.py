"""The MoE byte formulas held to the ledger, the drop rule's slots, and the errors of bad input."""

from __future__ import annotations

import pytest
import torch

from shardwise.collectives import Mesh, RankFailed, comm_ledger, launch
from shardwise.transforms.expert_parallel import (
    assign_slots,
    expert_capacity,
    moe_all_to_all_bytes,
    moe_count_exchange_bytes,
    moe_dispatch_combine,
    route,
    shard_experts,
)


def run(ep, num_experts, sizes, hidden=4, top_k=2, capacity_factor=None, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    gate_up = torch.randn(num_experts, 6, hidden, dtype=dtype)
    down = torch.randn(num_experts, hidden, 3, dtype=dtype)
    router = torch.randn(num_experts, hidden, dtype=dtype)
    parts = [torch.randn(n, hidden, dtype=dtype) for n in sizes]

    def main():
        with Mesh(ep=ep) as mesh:
            x = parts[mesh.rank].clone().requires_grad_()
            local = [shard_experts(w, "ep").clone().requires_grad_() for w in (gate_up, down)]
            res = moe_dispatch_combine(x, x @ router.T, *local, "ep", top_k=top_k,
                                       capacity_factor=capacity_factor, **kw)
            (res.output.sum() + res.aux_loss).backward()
            return res.slots, res.dropped

    return launch(main, world=ep, timeout=60)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_all_to_all_bytes_equal_the_formula_each_way(ep, capacity_factor):
    sizes = [6, 3, 5, 4][:ep]
    with comm_ledger() as ledger:
        results = run(ep, 2 * ep, sizes, hidden=4, capacity_factor=capacity_factor)
    slots = results[0][0]
    assert all(s == slots for s, _ in results), "every rank agrees on the slots"
    # The bound the Plan can state before routing: at most the capacity, at most the largest token count.
    assert slots <= max(sizes)
    if capacity_factor is not None:
        assert slots <= max(expert_capacity(n, 2, 2 * ep, capacity_factor) for n in sizes)
    expected = moe_all_to_all_bytes(num_experts=2 * ep, slots=slots, hidden=4, itemsize=8, size=ep)
    assert expected == 2 * (2 * ep * slots * 4 * 8) * (ep - 1) // ep
    for rank in range(ep):
        mine = [r for r in ledger.records if r.rank == rank]
        for phase in ("forward", "backward"):
            a2a = [r for r in mine if r.op == "all_to_all" and r.phase == phase]
            assert len(a2a) == 2 and sum(r.sent_bytes for r in a2a) == expected, (rank, phase, a2a)
        gathers = [r for r in mine if r.op == "all_gather"]
        assert [r.phase for r in gathers] == ["forward"]
        counts = moe_count_exchange_bytes(num_experts=2 * ep, size=ep)
        assert gathers[0].sent_bytes == counts == (ep - 1) * (4 * ep + 1) * 8
        assert [r.phase for r in mine if r.op == "psum"] == ["forward"]  # the aux loss's probability sums
        assert {r.op for r in mine} == {"all_to_all", "all_gather", "psum"}


def test_slots_follow_the_choice_then_token_order():
    experts = torch.tensor([[1, 0], [1, 2], [1, 0], [0, 1]])
    slots = assign_slots(experts, num_experts=3, capacity=2)
    # Expert 1 is first choice of tokens 0, 1, 2 (positions 0, 1, 2) and second choice of token 3 (position 3).
    assert slots.position.tolist() == [[0, 1], [1, 0], [2, 2], [0, 3]]
    assert slots.kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert slots.counts.tolist() == [3, 4, 1] and slots.kept_counts.tolist() == [2, 2, 1]
    unlimited = assign_slots(experts, num_experts=3, capacity=None)
    assert bool(unlimited.kept.all()) and unlimited.kept_counts.tolist() == [3, 4, 1]


def test_capacity_is_the_ceiling_of_the_even_share():
    assert expert_capacity(10, 2, 8, 1.0) == 3  # 10 * 2 / 8 = 2.5
    assert expert_capacity(10, 2, 8, 1.25) == 4
    assert expert_capacity(10, 2, 8, None) is None
    for bad in (0, -1.0, True, "1", float("nan"), float("inf")):  # (nan and inf: a bare float-to-int error)
        with pytest.raises(ValueError, match="give a finite positive number"):
            expert_capacity(10, 2, 8, bad)


def test_routers():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]], dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    plain = route(logits, 2, "softmax_topk")
    assert plain.experts.tolist() == [[2, 3]]
    torch.testing.assert_close(plain.weights, probs[:, [2, 3]], rtol=0, atol=0)
    renormalized = route(logits, 2, "softmax_topk_renormalized")
    torch.testing.assert_close(renormalized.weights, probs[:, [2, 3]] / probs[:, [2, 3]].sum(), rtol=0, atol=0)


def error(ep, num_experts, sizes, **kw):
    with pytest.raises(RankFailed) as info:
        run(ep, num_experts, sizes, **kw)
    return str(info.value)


def test_experts_not_divisible_by_ep_are_refused():
    assert "3 experts (dim 0 of the weight of shape (3, 6, 4)) do not divide over axis 'ep' of size 2" in error(
        2, 3, [2, 2]
    )


def test_unknown_router_and_bad_top_k_are_refused():
    assert "unknown router 'sigmoid'" in error(2, 4, [2, 2], router="sigmoid")
    assert "top_k=5 must be an int in 1..4" in error(2, 4, [2, 2], top_k=5)


def test_weights_that_are_not_this_ranks_share_are_refused():
    def main():
        with Mesh(ep=2):
            x = torch.zeros(3, 4)
            moe_dispatch_combine(x, torch.zeros(3, 4), torch.zeros(4, 6, 4), torch.zeros(4, 4, 3), "ep", top_k=1)

    shape_error = r"gate_up_proj must be \(2, 2 \* intermediate, 4\).*cut them with shard_experts"
    with pytest.raises(RankFailed, match=shape_error):
        launch(main, world=2, timeout=60)

    def rows():
        with Mesh(ep=2):
            moe_dispatch_combine(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(2, 6, 4), torch.zeros(2, 4, 3),
                                 "ep", top_k=1)

    with pytest.raises(RankFailed, match="router_logits has 2 rows but tokens has 3"):
        launch(rows, world=2, timeout=60)

    def experts_not_dividing():
        with Mesh(ep=2):
            moe_dispatch_combine(torch.zeros(3, 4), torch.zeros(3, 3), torch.zeros(1, 6, 4), torch.zeros(1, 4, 3),
                                 "ep", top_k=1)

    with pytest.raises(RankFailed, match="3 experts do not divide over axis 'ep' of size 2"):
        launch(experts_not_dividing, world=2, timeout=60)
