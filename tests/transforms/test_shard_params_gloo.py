"""shard_params on gloo processes: the same results as the single-device step.

Each rank rebuilds the (seeded) problem itself, so nothing unpicklable crosses
processes; the parent computes the reference and compares. float64, so the
1e-12 relative bound of the threads tests applies unchanged: the transport
moves exact bytes and gloo's sums differ from ours only in rounding order.

The GPT runs SGD with momentum and the MLP AdamW, not the other way round:
Adam normalises each update, so an element whose true gradient is zero (the
attention key bias: softmax ignores a shift shared by all keys) moves by
about ±lr on rounding noise alone, and a different reduction order changes
that noise. That is Adam amplifying ulps, not a sharding error; the MLP has
no such direction.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import TinyGPT, mlp

pytestmark = pytest.mark.gloo


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _problem(kind: str, world: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        chain, params = sw.functionalize(mlp([5, 7, 3, 6]).double())
        step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2), clip_norm=0.5)
        batches = [(torch.randn(4 * world, 5, generator=gen, dtype=torch.float64),
                    torch.randn(4 * world, 6, generator=gen, dtype=torch.float64)) for _ in range(3)]
    else:
        model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
        chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
        step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.5, momentum=0.9))
        batches = [(torch.randint(32, (2 * world, 8), generator=gen),
                    torch.randint(32, (2 * world, 8), generator=gen)) for _ in range(3)]
    return step, params, batches


def _run_rank(kind: str, world: int, options: dict) -> list:
    step, params, batches = _problem(kind, world)
    sharded = sw.shard_params(step, "dp", **options)
    return sw.testing.record_history(sharded, sharded.init(params, sw.Mesh(dp=world)), batches)


def _reference(kind: str, world: int) -> list:
    step, params, batches = _problem(kind, world)
    return sw.testing.record_history(step, step.init(params), batches)


CASES = [
    ("mlp", {"stage": 1}),
    ("mlp", {"stage": 2, "accumulation": 2}),
    ("mlp", {"stage": 3, "prefetch": 2}),
    ("gpt", {"stage": 3, "reshard_after_forward": False}),
    ("gpt", {"stage": 3, "accumulation": 2}),
]


@pytest.mark.parametrize("kind,options", CASES, ids=[f"{k}-{o}" for k, o in CASES])
@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_sharded_step_on_gloo_equals_single_device(
    kind: str, options: dict, pool_name: str, request: pytest.FixtureRequest
) -> None:
    pool = request.getfixturevalue(pool_name)
    world = int(pool_name[-1])
    per_rank = pool.run(_run_rank, kind, world, options)
    sw.testing.compare_histories(per_rank, _reference(kind, world), rtol=1e-12)


def _run_hsdp_rank(stage: int) -> list:
    step, params, batches = _problem("mlp", 4)
    # a gloo group per axis: dp {0, 1} and {2, 3}, node {0, 2} and {1, 3}
    hsdp = sw.shard_params(step, "dp", stage, replicate="node")
    return sw.testing.record_history(hsdp, hsdp.init(params, sw.Mesh(node=2, dp=2)), batches)


def test_hsdp_on_gloo_equals_single_device(gloo4: Any) -> None:
    """HSDP at world 4 on processes: each axis its own gloo group, the reduce-scatter over dp and the
    shards' all-reduce over node in flight together."""
    per_rank = gloo4.run(_run_hsdp_rank, 3)
    sw.testing.compare_histories(per_rank, _reference("mlp", 4), rtol=1e-12)
