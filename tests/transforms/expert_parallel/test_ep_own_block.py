"""A mixture-of-experts block of one's own whose forward calls moe_dispatch_combine, as expert_parallel's
refusal advises.

It was refused ("router not known": find_blocks knew blocks by class only), and its model had no
single-device step (``axis_size(axis='ep') needs a mesh``). Now moe_dispatch_combine is the
single-device layer outside any mesh, and a block of any class whose forward calls it is split as
written: its experts cut over the axis, the step equal to the single-device one (float64, SGD with
momentum, thread ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.launch import RankFailed
from shardwise.testing.models import FusedExperts
from shardwise.transforms.expert_parallel import moe_dispatch_combine
from shardwise.transforms.expert_parallel.experts import run_experts


class MyMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, axis: str = "ep",
                 capacity_factor: float | None = None, aux_loss: bool = False) -> None:
        super().__init__()
        self.top_k, self.axis, self.capacity_factor, self.aux_loss = top_k, axis, capacity_factor, aux_loss
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = FusedExperts(experts, hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = moe_dispatch_combine(
            flat, self.gate(flat), self.experts.gate_up_proj, self.experts.down_proj, self.axis, top_k=self.top_k,
            capacity_factor=self.capacity_factor, aux_loss=self.aux_loss,
        )
        return out.output.view_as(x)


def _setup(**kw: Any) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), MyMoE(8, 4, 4, 2, **kw), nn.Linear(8, 8)).double()
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 8, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def test_outside_any_mesh_it_is_the_single_device_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(4, 4, generator=gen,
                                                                                   dtype=torch.float64)
    experts = FusedExperts(4, 4, 3).double()
    out = moe_dispatch_combine(x, x @ router.T, experts.gate_up_proj, experts.down_proj, "ep", top_k=2)
    probs = torch.softmax(x @ router.T, -1)
    weights, chosen = probs.topk(2, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.stack([
        sum(w * experts.expert(int(e), x[i]) for w, e in zip(weights[i], chosen[i], strict=True)) for i in range(8)
    ])
    torch.testing.assert_close(out.output, expected, rtol=1e-12, atol=1e-12)
    assert out.aux_loss is not None and int(out.tokens_per_expert.sum()) == 16 and out.dropped == 0
    with pytest.raises(ValueError, match=r"has no axis 'ep' .*sw.Mesh\(dp=1, ep=1\)"), sw.Mesh(dp=1):
        moe_dispatch_combine(x, x @ router.T, experts.gate_up_proj, experts.down_proj, "ep", top_k=2)


@pytest.mark.parametrize("aux_loss", [False, True])
def test_a_block_calling_it_is_split_as_written(aux_loss: bool) -> None:
    reference, params, batches = _setup(aux_loss=aux_loss)
    reference(reference.init(params), batches[0])  # the single-device step runs
    step = sw.expert_parallel(reference, "ep")
    plan = step.plan(sw.Mesh(ep=2), params, batches[0])
    assert {"all_gather", "all_to_all", "psum"} <= {c.op for c in plan.collectives(0)}
    sw.testing.assert_equivalent(step, reference, sw.Mesh(ep=2), batches, params)


def test_with_zero3_over_dp() -> None:
    reference, params, batches = _setup()
    step = sw.shard_params(sw.expert_parallel(reference, "ep"), "dp", stage=3)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(dp=2, ep=2), batches, params)


def test_zero_alone_needs_the_axis_in_the_mesh_at_size_one() -> None:
    reference, params, batches = _setup()
    zero = sw.shard_params(reference, "dp", stage=3)
    with pytest.raises(RankFailed, match=r"Mesh\(dp=2\) has no axis 'ep'.*sw.Mesh\(dp=2, ep=1\)"):
        sw.testing.assert_equivalent(zero, reference, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(zero, reference, sw.Mesh(dp=2, ep=1), batches, params)


def test_a_call_over_another_axis_is_refused() -> None:
    reference, params, batches = _setup(axis="experts")
    with pytest.raises(ValueError, match=r"moe_dispatch_combine\(axis='experts'\): 1 runs under expert_parallel "
                                         r"over axis 'ep'"):
        sw.expert_parallel(reference, "ep").plan(sw.Mesh(ep=2), params, batches[0])


def test_a_capacity_that_drops_per_rank_is_refused() -> None:
    reference, params, batches = _setup(capacity_factor=1.0)
    with pytest.raises(RankFailed, match=r"1 calls moe_dispatch_combine\(capacity_factor=1.0\), which would drop "
                                         r"(.|\n)*drop_per_rank=True"):
        sw.testing.assert_equivalent(sw.expert_parallel(reference, "ep"), reference, sw.Mesh(ep=2), batches, params)
    with pytest.raises(ValueError, match=r"expert_parallel\(capacity_factor=1.0\) sets the capacity of the blocks it "
                                         r"rewrites, and 1 is a block of your own"):
        sw.expert_parallel(reference, "ep", capacity_factor=1.0)


def test_router_aux_loss_refuses_a_block_of_ones_own() -> None:
    reference, _, _ = _setup()
    with pytest.raises(ValueError, match=r"router_aux_loss: 1 \(MyMoE\) is a block of your own"):
        sw.router_aux_loss(reference, 0.01)


class OwnRouter(nn.Module):
    """Fused experts and a router of its own (a sigmoid), not calling moe_dispatch_combine: still refused."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4, bias=False), FusedExperts(4, 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(self.gate(x))
        return sum(w[..., e : e + 1] * self.experts.expert(e, x) for e in range(4))


def test_a_block_that_does_not_call_it_is_still_refused() -> None:
    model = nn.Sequential(nn.Linear(6, 8), OwnRouter()).double()
    chain, _ = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"its router is not one expert_parallel knows.*write its forward to call "
                                         r"moe_dispatch_combine"):
        sw.expert_parallel(step, "ep")


class _AuxMoE(MyMoE):
    """Returns its aux loss beside its output (``moe_dispatch_combine``'s ``MoEOutput.aux_loss``)."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        flat = x.reshape(-1, x.shape[-1])
        out = moe_dispatch_combine(flat, self.gate(flat), self.experts.gate_up_proj, self.experts.down_proj,
                                   self.axis, top_k=self.top_k)
        return out.output.view_as(x), out.aux_loss


def _aux_setup() -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _AuxMoE(8, 4, 4, 2)).double()
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 8, generator=gen, dtype=torch.float64)) for _ in range(2)]
    loss = lambda out, y: F.mse_loss(out[0], y) + 0.5 * out[1]  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.sgd(1.0)), params, batches


@pytest.mark.parametrize("layout", ["ep2", "ep4", "dp2 x ep2 zero1", "dp2 x ep2 zero3"])
def test_its_aux_loss_added_to_the_loss_counts_once_with_its_gradient(layout: str) -> None:
    """The engine means the ranks' losses; the aux, one value on every rank, had each rank's part of its gradient
    divided by the ranks (the router's update from it 0.5x one device's at ep 2, 0.25x at ep 4), and under data
    parallel x ep it was the aux of the ep group's tokens alone (the loss 2.4e-3 off)."""
    reference, params, batches = _aux_setup()
    step = sw.expert_parallel(reference, "ep")
    mesh = sw.Mesh(ep=4) if layout == "ep4" else sw.Mesh(ep=2)
    if layout.startswith("dp2"):
        step, mesh = sw.shard_params(step, "dp", int(layout[-1])), sw.Mesh(dp=2, ep=2)
    sw.testing.assert_equivalent(step, reference, mesh, batches, params)
    if layout == "dp2 x ep2 zero1":
        sw.testing.assert_plan_is_run(step, mesh, params, batches[0])


class _BiasedExperts(FusedExperts):
    """Fused experts with a per-expert output bias [E, H] beside their weights."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__(experts, hidden, inter)
        self.down_bias = nn.Parameter(torch.randn(experts, hidden) * 0.3)


class _BiasedMoE(nn.Module):
    """Its experts= callable adds each expert's bias to that expert's rows ([local experts, rows, H])."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = _BiasedExperts(experts, hidden, 6)  # (no width of the experts' equals their count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, ex = x.reshape(-1, x.shape[-1]), self.experts

        def run(rows: torch.Tensor) -> torch.Tensor:
            return run_experts(rows, ex.gate_up_proj, ex.down_proj, F.silu) + ex.down_bias[: rows.shape[0], None]

        out = moe_dispatch_combine(flat, self.gate(flat), ex.gate_up_proj, ex.down_proj, "ep", top_k=2,
                                   aux_loss=False, experts=run)
        return out.output.view_as(x)


@pytest.mark.parametrize(("experts", "layout"), [(4, "ep2"), (2, "ep2"), (4, "ep4"), (4, "dp2 x ep2 zero3")])
def test_its_experts_other_per_expert_parameters_are_cut_with_the_weights(experts: int, layout: str) -> None:
    """A bias [E, H] beside the fused weights stayed whole on every rank while the weights were cut: the callable's
    rows met all E biases (a raw shape error), or, sliced to the rows' experts as here, the first experts' biases on
    every rank, another model. Every parameter of the experts with E rows is cut alike now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _BiasedMoE(8, experts)).double()
    chain, params = sw.functionalize(model)
    reference = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 8, generator=gen, dtype=torch.float64)) for _ in range(2)]
    step, mesh = sw.expert_parallel(reference, "ep"), sw.Mesh(ep=int(layout[2]))
    if layout.startswith("dp2"):
        step, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2, ep=2)
    sw.testing.assert_equivalent(step, reference, mesh, batches, params)


class _SharedBiasExperts(FusedExperts):
    """Fused experts with a bias [H] every expert adds, where H equals the experts' count."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__(experts, hidden, inter)
        self.shared_bias = nn.Parameter(torch.randn(hidden) * 0.3)


def test_a_parameter_as_long_as_the_experts_and_one_of_their_widths_is_refused() -> None:
    """The review's case: with 8 experts of hidden 8, a bias [8] shared by every expert was cut as one row per
    expert (a raw shape error, or another model where it was reduced). Such a count cannot be told apart."""
    moe = _BiasedMoE(8, 8)
    moe.experts = _SharedBiasExperts(8, 8, 6)
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(6, 8), moe).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"experts.shared_bias \(shape \(8,\)\) has 8 rows, as many as the experts "
                                         r"and as a width of theirs"):
        sw.expert_parallel(step, "ep")
