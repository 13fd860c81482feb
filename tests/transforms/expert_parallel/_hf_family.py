"""What the expert-parallel tests of one Hugging Face family each (Jamba, GPT-OSS, PhiMoE) share: their
batches, their loss, the stacks they run, their checks of the aux loss and the Plan, and a forward standing
for one a later transformers changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

VOCAB = 32


def token_batches(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches of 4 sequences of 6 tokens, with targets of their own."""
    return [(torch.randint(VOCAB, (4, 6), generator=gen), torch.randint(VOCAB, (4, 6), generator=gen))
            for _ in range(2)]


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def under_ep(step: sw.Step, stack: str) -> tuple[sw.Step, sw.Mesh]:
    """``step`` under expert parallel at ep 2 (``"ep"``), or with ZeRO-3 over dp 2 beside it (``"dp x ep zero3"``)."""
    ep = sw.expert_parallel(step, "ep")
    if stack == "dp x ep zero3":
        return sw.shard_params(ep, "dp", 3), sw.Mesh(dp=2, ep=2)
    return ep, sw.Mesh(ep=2)


def changed(method: Any) -> Any:
    """A forward computing what ``method`` does, in code of its own (what a later version might add)."""
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)
    return forward


def assert_router_aux_loss_is_hfs(model: Any, step: sw.Step, params: Any, batch: Any, coef: float) -> None:
    """On one device ``sw.router_aux_loss(step, coef)`` adds ``coef`` times the model's own aux loss
    (``output_router_logits=True``), to float32's rounding (HF sums it in float32), and adds something."""
    reference = sw.router_aux_loss(step, coef)
    _, plain = step(step.init(params), batch)
    _, with_aux = reference(reference.init(params), batch)
    with torch.no_grad():
        hf = model(batch[0], output_router_logits=True).aux_loss
    added = float(with_aux["loss"]) - float(plain["loss"])
    assert added == pytest.approx(coef * float(hf), rel=1e-6)
    assert added > 0.1 * coef  # it is there


def assert_equal_under_both_stacks(reference: sw.Step, params: Any, data: Any) -> None:
    for stack in ("ep", "dp x ep zero3"):
        composed, mesh = under_ep(reference, stack)
        sw.testing.assert_equivalent(composed, reference, mesh, data, params)


def all_to_alls_of_a_plan_run(step: sw.Step, params: Any, batch: Any) -> int:
    """The all-to-alls of rank 0's Plan under dp x ep ZeRO-3, once checked to be what every rank issues."""
    ep, mesh = under_ep(step, "dp x ep zero3")
    plan = sw.testing.assert_plan_is_run(ep, mesh, params, batch)
    return sum(c.op == "all_to_all" for c in plan.collectives(0))
