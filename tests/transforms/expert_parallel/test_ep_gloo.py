"""moe_dispatch_combine on gloo processes (torch.distributed's all-to-all and all-gather), against TopKMoE.

float64: the transport moves exact bytes, so the threads tests' 1e-12 bound applies unchanged.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import TopKMoE
from shardwise.transforms.expert_parallel import moe_dispatch_combine, shard_experts

pytestmark = pytest.mark.gloo


def _problem(world: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    moe = TopKMoE(hidden=4, intermediate=6, num_experts=2 * world, top_k=2).double()
    x = torch.randn(3 * world, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return moe, x


def _rank(world: int):  # type: ignore[no-untyped-def]
    moe, x = _problem(world)
    with sw.Mesh(ep=world) as mesh:
        mine = x[3 * mesh.rank : 3 * mesh.rank + 3].requires_grad_()
        experts = [shard_experts(p, "ep") for p in (moe.experts.gate_up_proj, moe.experts.down_proj)]
        res = moe_dispatch_combine(mine, moe.router_logits(mine), *experts, "ep", top_k=2)
        grads = torch.autograd.grad(res.output.pow(2).sum(), (mine, *experts))
        return res.output.detach(), grads


@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_moe_on_gloo_equals_single_device(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(pool_name)
    world = int(pool_name[-1])
    moe, x = _problem(world)
    x.requires_grad_()
    ref = moe(x)
    ref_x, ref_gate_up, ref_down = torch.autograd.grad(ref.pow(2).sum(), (x, moe.experts.gate_up_proj,
                                                                          moe.experts.down_proj))
    for rank, (out, (g_x, g_gate_up, g_down)) in enumerate(pool.run(_rank, world)):
        rows, mine = slice(3 * rank, 3 * rank + 3), slice(2 * rank, 2 * rank + 2)
        for got, want in ((out, ref.detach()[rows]), (g_x, ref_x[rows]), (g_gate_up, ref_gate_up[mine]),
                          (g_down, ref_down[mine])):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
