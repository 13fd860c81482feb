"""Ring and Ulysses attention on gloo processes (torch.distributed's ppermute and all-to-all), against sdpa.

float64: the transport moves exact bytes, so the threads tests' 1e-12 bound applies unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.transforms.context_parallel import ring_attention, shard_sequence, ulysses_attention

pytestmark = pytest.mark.gloo


def _inputs():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 16, 4, dtype=torch.float64, generator=gen)
    kv = torch.randn(2, 1, 4, 16, 4, dtype=torch.float64, generator=gen)
    return q, kv[0], kv[1]


def _rank(kind: str, world: int):  # type: ignore[no-untyped-def]
    attention = ring_attention if kind == "ring" else ulysses_attention
    with sw.Mesh(cp=world):
        local = [shard_sequence(t, "cp", dim=2).requires_grad_() for t in _inputs()]
        out = attention(*local, "cp")
        grads = torch.autograd.grad(out.pow(2).sum(), local)
        whole = [sw.collectives.all_gather(t.detach(), "cp", dim=2, tiled=True) for t in (out, *grads)]
        # The global position of every gathered row, so the whole sequence can be put back in order.
        positions = sw.collectives.all_gather(shard_sequence(torch.arange(16), "cp", dim=0), "cp", dim=0, tiled=True)
        inverse = torch.argsort(positions)
        return [t.index_select(2, inverse) for t in whole]


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_attention_on_gloo_equals_sdpa(kind: str, pool_name: str, request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(pool_name)
    world = int(pool_name[-1])
    q, k, v = (t.requires_grad_() for t in _inputs())
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for got in pool.run(_rank, kind, world):
        for a, b in zip(got, (ref.detach(), *ref_grads), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
