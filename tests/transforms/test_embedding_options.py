"""``scale_grad_by_freq`` and ``sparse`` on nn.Embedding / nn.EmbeddingBag (engine/model/embedding_options.py).

``scale_grad_by_freq=True`` divides each row's gradient by its count in the batch the layer is called on: a
batch statistic, so a step that cuts the batch trained another model without an error (grad_norm rel err
1.1e-3 for Embedding, 1.1e-2 for EmbeddingBag before, hunt3 F2) and now refuses when the transform is added, as
for BatchNorm. The one-device step stays bitwise equal to torch's loop, and a pipeline of one micro-batch (the
batch not cut) equal to it. ``sparse=True`` failed even on one device with a raw NotImplementedError from the
gradient norm (hunt3 F5) and is refused by ``train_step``. float64, threads backend.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw

from ._torch_loop import assert_one_device_equals_torch_sgd

MODELS: dict[str, Callable[[], nn.Module]] = {
    "Embedding": lambda: nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 2)),
    "EmbeddingBag": lambda: nn.Sequential(nn.EmbeddingBag(10, 4, scale_grad_by_freq=True, mode="sum"),
                                          nn.Linear(4, 2)),
}

CUTS: dict[str, tuple[Callable[[sw.Step], sw.Step], str]] = {
    "zero1 dp2": (lambda s: sw.shard_params(s, "dp", 1), "under shard_params (data parallel over axis 'dp')"),
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", 3), "under shard_params (data parallel over axis 'dp')"),
    "dp1 accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
                           "under shard_params (data parallel over axis 'dp', accumulation=2)"),
    "pp2 mb2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), "under pipeline with 2 micro-batches"),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(10, (8, 3), generator=g), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(3)]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().double()


def _step(name: str) -> tuple[sw.Step, object]:
    chain, params = sw.functionalize(_model(name))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


@pytest.mark.parametrize("name", list(MODELS))
def test_scale_grad_by_freq_on_one_device_equals_torch(name: str) -> None:
    """Losses and parameters bitwise equal to torch's loop over 3 steps."""
    model = _model(name)
    assert_one_device_equals_torch_sgd(model, _batches())


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_scale_grad_by_freq_is_refused_where_the_batch_is_cut(name: str, cut: str) -> None:
    transform, words = CUTS[cut]
    step, _ = _step(name)
    with pytest.raises(ValueError) as caught:
        transform(step)
    text = str(caught.value)
    assert text.startswith(f"'0' ({name}, scale_grad_by_freq=True) divides each row's gradient by how often"), text
    assert f"{words} each rank (or micro-batch) calls it on a part of the batch" in text, text
    assert "set scale_grad_by_freq=False" in text, text


def test_scale_grad_by_freq_under_a_pipeline_of_one_micro_batch_equals_one_device() -> None:
    """The batch is not cut: the counts are the whole batch's, as on one device."""
    step, params = _step("Embedding")
    reference, _ = _step("Embedding")
    report = sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 1), reference, sw.Mesh(pp=2),
                                          _batches(), params)
    assert max(report.max_rel_err) == 0.0, report


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_a_sparse_embedding_is_refused_when_the_step_is_built(kind: type[nn.Module]) -> None:
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(3, 3), kind(10, 4, sparse=True)))
    with pytest.raises(ValueError, match=rf"'1' is an {kind.__name__} with sparse=True, which makes its weight's "
                                         r"gradient a sparse tensor: .* set sparse=False"):
        sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
