"""expert_parallel replaces a known MoE block's forward with its reproduction of it: a block whose
forward is not the known class's own (a subclass overriding it, a same-named copy of the class) would
lose what that forward adds without an error, so it is refused; a subclass that keeps the forward is
the known block."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.testing.models import TopKMoE


class ScaledMoE(TopKMoE):
    """A user's MoE: the known block's routing and experts, its output scaled."""

    def forward(self, x: Tensor) -> Tensor:
        return 2.0 * super().forward(x)


class NamedMoE(TopKMoE):
    """A subclass keeping TopKMoE's forward (a name of the user's own, nothing else)."""


def _copy_named_topkmoe() -> type[nn.Module]:
    # A class called TopKMoE defined here, as a user copying the testing model into their code would.
    return type("TopKMoE", (ScaledMoE,), {"__module__": __name__})


def _step(block: type[nn.Module]) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), block(8, 4, 4, 2), nn.Linear(8, 3)).double()
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


@pytest.mark.parametrize("block", [ScaledMoE, _copy_named_topkmoe()], ids=["subclass", "same_name_copy"])
def test_a_block_whose_forward_is_not_the_known_ones_is_refused(block: type[nn.Module]) -> None:
    step, _ = _step(block)
    with pytest.raises(ValueError, match="forward is not"):
        sw.expert_parallel(step, "ep")
    with pytest.raises(ValueError, match="forward is not"):
        sw.router_aux_loss(step, 0.1)


def test_a_subclass_keeping_the_forward_is_the_known_block() -> None:
    step, params = _step(NamedMoE)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), batches, params)
