"""transformers' output-capturing hooks on rank threads' copies of a model.

transformers puts its capturing hooks on a model's layers at its first call and marks the model. A rank
thread's copy of the model dropped the hooks added after the split but kept the mark, so its calls captured
nothing: ``out.hidden_states`` came back ``()`` on every rank thread (any mesh, even dp 1). A loss term over
the hidden states trained without it, no error (ViT: 2e-2 in the loss); SegFormer's and LLaVA's heads, which
read them, failed inside transformers. Then the first-call probe's copy of the model, sharing the hook dicts,
put a second set of hooks on the rank's copy (hidden states counted twice from the second micro-batch on).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

LAYERS = 2


def _regularized(out: Any, _: Any) -> torch.Tensor:
    assert len(out.hidden_states) == LAYERS + 1, len(out.hidden_states)  # the embeddings' and each layer's
    return out.loss + 0.1 * sum(h.pow(2).mean() for h in out.hidden_states)


@pytest.mark.parametrize("layout", ["zero3 dp1", "zero3 dp2", "zero1 dp1 accumulation 2"])
def test_hidden_states_reach_the_loss_on_rank_threads_as_on_one_device(layout: str) -> None:
    torch.manual_seed(0)
    model = T.ViTForImageClassification(T.ViTConfig(
        hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=32, image_size=16,
        patch_size=8, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        output_hidden_states=True)).double()
    gen = torch.Generator().manual_seed(1)
    batches = [({"pixel_values": torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64),
                 "labels": torch.randint(3, (4,), generator=gen)}, None) for _ in range(2)]
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, _regularized, sw.optim.sgd(0.1, momentum=0.9))
    distributed, mesh = {
        "zero3 dp1": (sw.shard_params(step, "dp", 3), sw.Mesh(dp=1)),
        "zero3 dp2": (sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)),
        "zero1 dp1 accumulation 2": (sw.shard_params(step, "dp", 1, accumulation=2), sw.Mesh(dp=1)),
    }[layout]
    sw.testing.assert_equivalent(distributed, step, mesh, batches, params)
