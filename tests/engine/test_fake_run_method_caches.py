"""A run on fake tensors leaves no fake tensor in a cache a model's class holds.

BEiT's relative position index is memoized by a static method under transformers' lru cache, keyed by the window
size alone: functionalize's run of a meta-built BEiT on fake tensors left a fake index there, and the step's real
call, and any real BEiT of that window size later in the process, failed with torch's raw
DataDependentOutputException. The caches are emptied after a fake run (predicted_state.clear_method_caches).
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")


def _config() -> object:
    return T.BeitConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        image_size=16, patch_size=8, num_labels=3, use_relative_position_bias=True, drop_path_rate=0.0)


def test_a_meta_builds_fake_run_leaves_no_fake_index_in_beits_cache() -> None:
    torch.manual_seed(0)
    real = T.BeitForImageClassification(_config())
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.randint(3, (2,))}
    with torch.device("meta"):
        empty = T.BeitForImageClassification(_config())
    chain, params = sw.functionalize(empty, example_input=batch)
    step = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1))
    _, metrics = step(step.init(params, seed=0), (batch, None))
    assert torch.isfinite(metrics["loss"])
    assert torch.isfinite(real(**batch).loss)  # a model shardwise never touched, same window size
