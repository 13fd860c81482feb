"""A token-weighted step (``train_step(tokens=...)``) under an f16 policy with a loss scale.

Its micro-batches' losses are sums over their tokens, divided by the global count in the update; seeded with the
loss scale alone, the f16 backward made gradients as many times a mean loss's as the micro-batch has tokens. Under
GradScaler's usual static 65536, which a mean loss trains with, every step overflowed and was skipped, the
parameters never moved, without an error; a dynamic scale backed off 32x (five steps skipped) on 128 tokens. The
scale is now divided by about the tokens of a micro-batch (a power of two read off the targets' shape, the same
on every rank) before seeding, and the unscaling divides by the same: the update is unchanged, exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import TinyGPT

POLICY = "params=f32,compute=f16,output=f32"


def _chain() -> tuple[Any, Any]:
    torch.manual_seed(0)
    return sw.functionalize(TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16),
                            units=["tok_emb", "blocks", "head"])


def _mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _summed(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def _batches(padded: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for k in range(4):
        ids = torch.randint(64, (8, 17), generator=gen)
        targets = ids[:, 1:].clone()
        if padded:
            for row in range(8):
                targets[row, 4 + (row + k) % 12:] = -100
        out.append((ids[:, :-1], targets))
    return out


@pytest.mark.parametrize("tokens", ["count_fn", "sum"])
@pytest.mark.parametrize("scale", [65536.0, "dynamic"])
def test_a_token_sum_trains_under_the_loss_scale_a_mean_trains_under(tokens: str, scale: Any) -> None:
    """No padding: the token-weighted loss is the mean loss, and both steps skip nothing and update alike."""
    chain, params = _chain()
    counted = sw.mixed_precision(
        sw.train_step(chain, _summed if tokens == "sum" else _mean, sw.optim.adamw(1e-3),
                      tokens="sum" if tokens == "sum" else (lambda inputs, targets: (targets != -100).sum())),
        POLICY, loss_scale=scale)
    mean = sw.mixed_precision(sw.train_step(chain, _mean, sw.optim.adamw(1e-3)), POLICY, loss_scale=scale)
    states = {"counted": counted.init(params), "mean": mean.init(params)}
    for batch in _batches(padded=False):
        for name, step in (("counted", counted), ("mean", mean)):
            states[name], metrics = step(states[name], batch)
            assert not bool(metrics["skipped"]), f"{name}: a step skipped at scale {float(metrics['loss_scale'])}"
    for layer, tensors in counted.full_params(states["counted"]).items():
        for name, value in tensors.items():  # (f16 sums over the tokens in another order: rounding apart)
            torch.testing.assert_close(value, mean.full_params(states["mean"])[layer][name], rtol=1e-3, atol=1e-5)


def test_zero2_with_padded_labels_trains_under_a_static_scale() -> None:
    """Padded labels need ``tokens=``: the same on two data-parallel ranks, every step skipped before."""
    chain, params = _chain()
    step = sw.mixed_precision(sw.train_step(chain, _mean, sw.optim.adamw(1e-3),
                                            tokens=lambda inputs, targets: (targets != -100).sum()),
                              POLICY, loss_scale=65536.0)
    sharded = sw.shard_params(step, "dp", stage=2)
    batches = _batches(padded=True)

    def run() -> tuple[list[bool], float]:
        state, skipped = sharded.init(params, sw.Mesh(dp=2)), []
        for batch in batches:
            state, metrics = sharded(state, batch)
            skipped.append(bool(metrics["skipped"]))
        full = sharded.full_params(state)
        return skipped, max(float((full[k][n] - params[k][n]).abs().max()) for k in params for n in params[k])

    skipped, moved = sw.launch(run, world=2)[0]
    assert skipped == [False] * len(batches) and moved > 1e-4
    sw.testing.assert_equivalent(sharded, step, sw.Mesh(dp=2), batches, params, rtol=2 ** -8)


def test_the_divisor_counts_tokens_not_a_distributions_elements() -> None:
    """The review's case: a distillation loss's targets (labels [8, 16], the teacher's probabilities [8, 16, 1024])
    made the divisor 131072, from the largest tensor, where the tokens are 128: f16 had 1024x less headroom than the
    mean loss's step. The labels decide, else the floating targets' rows."""
    from shardwise.engine.step.run_inputs import token_sum_divisor

    ids = labels = torch.zeros(8, 16, dtype=torch.long)
    probs = torch.ones(8, 16, 1024)
    assert token_sum_divisor([(ids, (labels, probs))]) == 128.0
    assert token_sum_divisor([(torch.ones(8, 16, 4), probs)]) == 128.0
    assert token_sum_divisor([(ids, torch.ones(8, 3))]) == 128.0  # (the inputs' ids, before float targets)
    assert token_sum_divisor([(torch.ones(6, 4), torch.ones(6, 3))]) == 8.0  # rows: the power of two nearest 6
