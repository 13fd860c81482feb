"""A value a layer's forward keeps outside the chain (a forward hook's list), read by the loss: refused where the
step runs that layer's backward apart from the loss's, or where a rank reads another's (engine/run/cut_graphs.py).

The review (s38 layers F5): an activation penalty on a hooked feature under ``shard_params(stage=3)`` trained as if
the penalty were detached (grad_norm 3.17e-3 off, no error); on thread ranks a rank read the other rank's activation
(the loss 4.1e-4 off); under accumulation the step failed with torch's raw DataDependentOutputException.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

torch_dtype = torch.float64


def _model(keep: Callable[[torch.Tensor], None]) -> nn.Sequential:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch_dtype)
    model[2].register_forward_hook(lambda mod, args, out: keep(out))
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(8, 4, dtype=torch_dtype), torch.randn(8, 2, dtype=torch_dtype)) for _ in range(2)]


class PerThread(threading.local):
    """Each rank thread's own capture list (as each process has its own)."""

    def __init__(self) -> None:
        self.feats: list[torch.Tensor] = []


def _penalized(feats: Callable[[], list[torch.Tensor]]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) + 0.1 * feats()[-1].pow(2).mean()

    return loss_fn


def test_one_device_trains_the_hooked_penalty_as_torch_does() -> None:
    """One device runs the whole backward in one call: the penalty's gradient is kept (no refusal)."""
    kept = PerThread()
    batch = _batches()[0]
    reference = _model(kept.feats.append)
    loss = _penalized(lambda: kept.feats)(reference(batch[0]), batch[1])
    loss.backward()
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in reference.parameters()]  # type: ignore[operator]
    kept.feats.clear()
    chain, params = sw.functionalize(_model(kept.feats.append))
    step = sw.train_step(chain, _penalized(lambda: kept.feats), sw.optim.sgd(0.1))
    state, _ = step(step.init(params), batch)
    got = [t for layer in ("0", "2", "4") for t in (state.params[layer]["weight"], state.params[layer]["bias"])]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("options", [{"stage": 3}, {"stage": 2, "bucket_mb": 1e-5}], ids=["zero3", "zero2 buckets"])
def test_zero_refuses_a_loss_reading_a_hooked_activation_naming_it(options: dict[str, float]) -> None:
    """ZeRO-3 runs each layer's backward alone, ZeRO-2 each gradient bucket's layers (one bucket per layer here)."""
    kept = PerThread()
    chain, params = sw.functionalize(_model(lambda out: kept.feats.append(out)))
    step = sw.train_step(chain, _penalized(lambda: kept.feats), sw.optim.sgd(0.1))
    zero3 = sw.shard_params(step, "dp", **options)  # type: ignore[arg-type]
    batches = _batches()

    def main() -> None:
        state = zero3.init(params, sw.Mesh(dp=2))
        zero3(state, batches[0])

    with pytest.raises(sw.collectives.RankFailed, match=(
            r"the backward of the loss reaches parameter '(weight|bias)' of layer '2'.*forward hook.*"
            r"the step runs the backward of layers? ('\d' to )?'4' alone, so the gradient through that value would be "
            r"dropped")):
        sw.launch(main, world=2)


def test_a_rank_reading_another_ranks_activation_is_refused() -> None:
    """A pipeline on thread ranks: layer 2 runs on rank 0, the loss on rank 1 reads the list they share."""
    feats: list[torch.Tensor] = []
    chain, params = sw.functionalize(_model(feats.append))
    step = sw.train_step(chain, _penalized(lambda: feats), sw.optim.sgd(0.1))
    piped = sw.pipeline(step, "pp", microbatches=2, schedule="1f1b", partition=[3, 2])
    batches = _batches()

    def main() -> None:
        state = piped.init(params, sw.Mesh(pp=2))
        piped(state, batches[0])

    with pytest.raises(sw.collectives.RankFailed, match=(
            r"the backward of the loss on rank 1 reaches rank 0's parameter '(weight|bias)' of layer '2'.*"
            r"another rank computed")):
        sw.launch(main, world=2)


def test_a_loss_reading_what_the_shape_prediction_left_is_refused() -> None:
    """Under accumulation the step predicts its output's shapes on fake tensors first (the loss probe), and the
    hook keeps the fake activation: the loss read it (torch's raw DataDependentOutputException before)."""
    kept = PerThread()
    chain, params = sw.functionalize(_model(lambda out: kept.feats.append(out)))
    step = sw.train_step(chain, _penalized(lambda: kept.feats), sw.optim.sgd(0.1))
    zero2 = sw.shard_params(step, "dp", stage=2, accumulation=2)
    batches = _batches()

    def main() -> None:
        state = zero2.init(params, sw.Mesh(dp=2))
        zero2(state, batches[0])

    with pytest.raises(sw.collectives.RankFailed, match=(
            r"loss_fn returned a fake tensor: it, or the model's output it is computed from, read a tensor that a "
            r"run of the layers on fake tensors left behind.*forward hook")):
        sw.launch(main, world=2)


def test_a_hook_keeping_a_detached_copy_trains_as_one_device() -> None:
    """What only looks (a detached copy kept for logging) reaches no graph: not refused."""
    kept = PerThread()
    chain, params = sw.functionalize(_model(lambda out: kept.feats.append(out.detach())))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    zero3 = sw.shard_params(step, "dp", stage=3)
    sw.testing.assert_equivalent(zero3, step, sw.Mesh(dp=2), _batches(), params)
