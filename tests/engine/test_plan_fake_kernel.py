"""A layer whose op's fake kernel refuses what its real kernel runs still plans.

transformers' Mixtral calls ``torch._grouped_mm`` by default (``experts_implementation="grouped_mm"``),
whose fake kernel (torch 2.13) takes only bfloat16 while the CPU kernel runs float32 too: the Plan's
predictions, which run layers on fake tensors, fell over with torch's bare error although the step
runs. Such a layer now runs on zero-filled real stand-ins, as a layer that reads data to decide a
shape does, and the Plan notes it. A genuine error of a user's layer still reaches the user: the
stand-in run raises it again, from the real kernel.

float32: grouped_mm has no float64 kernel, so the equivalence check uses assert_equivalent's float32
tolerance (one ZeRO-3 step against the single-device step).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _mixtral_grouped_mm() -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(  # experts_implementation left at its default
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.MixtralForCausalLM(cfg)
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        pytest.skip("this transformers does not call grouped_mm by default")
    ids = torch.randint(32, (4, 7), generator=torch.Generator().manual_seed(1))
    batch = (ids[:, :-1], ids[:, 1:])
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=batch[0])
    return sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1)), params, batch


@pytest.mark.parametrize("stack", ["single", "dp2-zero3"])
def test_hf_mixtral_with_its_default_grouped_mm_plans_in_float32(stack: str, caplog: Any) -> None:
    step, params, batch = _mixtral_grouped_mm()
    composed, mesh = (step, None) if stack == "single" else (sw.shard_params(step, "dp", 3), sw.Mesh(dp=2))
    with caplog.at_level(logging.ERROR, logger="torch._subclasses.fake_tensor"):
        plan = composed.plan(mesh, params, batch)
    assert not caplog.records  # torch's log of the fake kernel's failure is not shown: it was handled
    assert all(n > 0 for n in plan.memory["kept_for_backward"])
    stood_in = {layer for layer, notes in plan.layers.items() if any("zero-filled stand-ins" in n for n in notes)}
    assert stood_in == {"model.layers.0", "model.layers.1"}, plan.layers
    if mesh is not None:
        sw.testing.assert_equivalent(composed, step, mesh, [batch], params)


def test_a_genuine_shape_error_in_a_users_layer_is_still_raised_by_the_plan() -> None:
    """Shapes that do not fit fail on fake tensors too; the stand-in run raises the real kernel's error."""
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(5, 2)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        step.plan(None, params, (torch.randn(3, 4), torch.randn(3, 2)))
