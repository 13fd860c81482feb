"""sw.expert_parallel under sw.pipeline: experts split over ep inside each stage, stages over pp.

float64 on thread ranks, equal to the single-device step to rounding (assert_equivalent's float64
default). Every compute of a stage holding a MoE block lists its own all-to-alls and count exchange
(per micro-batch; under a zero-bubble schedule the all-to-alls' transposes run in the input pass, on
whose path they lie), and the ledger equals the Plan.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw

from .test_ep_step import _ledger, batches, moe_model


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pp_2_by_ep_2_equals_the_single_device_step_and_the_ledger_is_the_plan(schedule: str) -> None:
    step, params = moe_model()
    composed = sw.pipeline(sw.expert_parallel(step, "ep"), "pp", schedule=schedule, microbatches=2)
    mesh = sw.Mesh(pp=2, ep=2)
    sw.testing.assert_equivalent(composed, step, mesh, batches(), params)
    batch = batches(1)[0]
    plan = composed.plan(mesh, params, batch)
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"
    # Stage s holds the MoE block of layer s + 1: per micro-batch, one count exchange and two
    # all-to-alls forward, two backward, also under zero-bubble: its second stage walks the
    # all-to-alls' transposes in its input pass alone, its weight pass starting where the weights'
    # branches leave their path (model/split_backward.py).
    for rank in range(mesh.size):
        a2a = sum(a.op == "all_to_all" for a in plan.actions[rank])
        gathers = sum(a.label == "moe counts" for a in plan.actions[rank])
        assert gathers == 2, f"rank {rank}"
        assert a2a == 2 * (2 + 2), f"rank {rank}"


def test_dp_by_pp_by_ep_with_zero_equals_the_single_device_step() -> None:
    step, params = moe_model()
    composed = sw.shard_params(sw.pipeline(sw.expert_parallel(step, "ep"), "pp", "1f1b", microbatches=2), "dp", 1)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, pp=2, ep=2), batches(size=16), params)


def test_the_aux_loss_under_pp_by_ep_in_one_micro_batch_equals_the_single_device_step() -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.pipeline(sw.expert_parallel(reference, "ep"), "pp", schedule="1f1b", microbatches=1)
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(pp=2, ep=2), batches(), params)


def test_the_aux_loss_under_micro_batches_is_their_mean_and_the_ledger_is_the_plan() -> None:
    """Each micro-batch's aux loss is over its own tokens (of both ep ranks), the step's their mean (HF's
    under gradient accumulation). SGD's first step is linear in the gradient, so the step's parameters
    are the mean of one-device steps on each micro-batch; the routing statistics cross the stage
    boundary with the activations (and their gradients come back)."""
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1, per_microbatch=True)
    composed = sw.pipeline(sw.expert_parallel(reference, "ep"), "pp", schedule="zb_h1", microbatches=2)
    mesh, (x, y) = sw.Mesh(pp=2, ep=2), batches(1)[0]

    def run() -> tuple[float, Any]:
        state, metrics = composed(composed.init(params, mesh), (x, y))
        return float(metrics["loss"]), composed.full_params(state)

    loss, full = sw.launch(run, mesh.size, timeout=120)[0]
    # ep rank r takes rows 4r..4r+3, micro-batch j its rows 2j, 2j+1: micro-batch j is rows {2j, 2j+1, 4+2j, 5+2j}.
    ones = []
    for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
        state, metrics = reference(reference.init(params), (x[rows], y[rows]))
        ones.append((float(metrics["loss"]), state.params))
    assert loss == pytest.approx((ones[0][0] + ones[1][0]) / 2, rel=1e-12)
    for layer, tensors in full.items():
        for name, got in tensors.items():
            want = (ones[0][1][layer][name] + ones[1][1][layer][name]) / 2
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    plan = composed.plan(mesh, params, (x, y))
    for rank, got_ledger in enumerate(_ledger(composed, mesh, params, (x, y))):
        want_plan = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got_ledger == want_plan, f"rank {rank}\nledger: {got_ledger}\nplan:   {want_plan}"


@pytest.mark.parametrize("cut", ["pipeline", "accumulation"])
def test_micro_batches_are_refused_unless_the_aux_loss_is_said_to_be_per_micro_batch(cut: str) -> None:
    """The aux loss of a micro-batch is not its share of the whole batch's (a product of two batch means):
    a micro-batched step would train another loss than the single-device step's without an error, so it is
    refused, naming the opt-in; one micro-batch, and the opt-in, are accepted."""
    step, _ = moe_model()

    def cut_into(aux: sw.Step, n: int) -> sw.Step:
        ep = sw.expert_parallel(aux, "ep")
        if cut == "pipeline":
            return sw.pipeline(ep, "pp", schedule="1f1b", microbatches=n)
        return sw.shard_params(ep, "dp", 2, accumulation=n)

    with pytest.raises(ValueError, match="per_microbatch=True"):
        cut_into(sw.router_aux_loss(step, 0.1), 2)
    assert "per_microbatch=True" in str(cut_into(sw.router_aux_loss(step, 0.1, per_microbatch=True), 2).transforms)
    cut_into(sw.router_aux_loss(step, 0.1), 1)
