"""Zero-bubble's input and weight passes are predicted only where the schedule splits a backward.

The predictions of the collectives a split's layers issue inside each compute (the engine's,
``engine/plan/inside.py``, and tensor parallel's own) run a stage's split backward, ``I`` then ``W``,
beside its whole backward ``B``: a second backward of every layer (tensor parallel's also a second
forward, since the first backward frees its graph). A schedule without a weight pass (no pipeline,
GPipe, 1F1B) never reads those lists, so the Plan asks for them only where its schedule has ``W``
(``planning._splits_backward``), and a plan search's bounds, which price ``B`` alone, never.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.layout.state_layout import Placement
from shardwise.engine.plan.inside import predict_inside
from shardwise.engine.stack.compose import add
from shardwise.engine.stack.in_layer import Issued
from shardwise.transforms.tensor_parallel import predict as tp_predict

from .test_splits_per_axis import DataSplit

BACKWARDS = [0]


class _CountedIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        BACKWARDS[0] += 1
        return grad


class _Counted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CountedIdentity.apply(x)


@contextlib.contextmanager
def _recording() -> Iterator[list[Issued]]:
    yield []


def _problem() -> tuple[Any, Placement, dict[str, dict[str, tuple[torch.Size, torch.dtype]]]]:
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(8, 8), _Counted(), nn.Linear(8, 8)))
    shapes = {layer: {k: (t.shape, t.dtype) for k, t in tensors.items()} for layer, tensors in params.items()}
    return chain, Placement("pp", (("0", "1"), ("2",)), (0, 1)), shapes


PREDICTIONS = {"engine": predict_inside, "tensor_parallel": tp_predict.predict}


@pytest.mark.parametrize("prediction", list(PREDICTIONS))
def test_without_the_split_backward_a_stage_runs_one_backward_and_lists_the_rest_alike(prediction: str) -> None:
    predict = PREDICTIONS[prediction]
    chain, placement, shapes = _problem()
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = lambda y, t: ((y - t) ** 2).sum()  # noqa: E731
    runs = {}
    found = {}
    for split in (None, True, False):
        BACKWARDS[0] = 0
        found[split] = predict(chain, placement, shapes, loss_fn, x, target, _recording, split_backward=split)
        runs[split] = BACKWARDS[0]
    # The first stage holds the counted layer: its B, and with the split its W (the first stage's input
    # needs no gradient, so its I is empty and its W a backward to the weights).
    assert runs == {None: 2, True: 2, False: 1}
    assert found[None] == found[True]  # None: under a pipeline (placement.axis), split
    assert {kind for kind, _ in found[True]} == {"forward", "loss", "backward", "backward_input", "backward_weight"}
    assert {kind for kind, _ in found[False]} == {"forward", "loss", "backward"}
    assert found[False] == {key: v for key, v in found[True].items() if key[0] in ("forward", "loss", "backward")}


def test_without_a_pipeline_none_runs_no_split_backward() -> None:
    chain, _, shapes = _problem()
    whole = Placement(None, (tuple(chain.names),), (0,))
    for predict in PREDICTIONS.values():
        BACKWARDS[0] = 0
        found = predict(chain, whole, shapes, lambda y, t: y.sum(), torch.randn(4, 8), None, _recording)
        assert BACKWARDS[0] == 1 and {kind for kind, _ in found} == {"forward", "loss", "backward"}


@dataclass(frozen=True)
class _OwnPrediction(DataSplit):
    """A split bringing its own prediction, written to the protocol before ``split_backward``."""

    name: ClassVar[str] = "own_prediction"
    calls: ClassVar[list[dict[str, Any]]] = []

    def inner_collectives(self, chain: Any, placement: Any, shapes: Any, loss_fn: Any, inputs: Any, targets: Any,
                          recording: Any) -> Any:
        _OwnPrediction.calls.append({})
        return predict_inside(chain, placement, shapes, loss_fn, inputs, targets, recording)


def test_an_own_prediction_without_the_keyword_is_called_as_before_and_plans_what_the_engines_does() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch, mesh = (torch.randn(4, 8), torch.randn(4, 8)), sw.Mesh(ds=2)
    _OwnPrediction.calls.clear()
    own = add(step, _OwnPrediction("ds")).plan(mesh, params, batch)
    assert len(_OwnPrediction.calls) == 1
    engine = add(step, DataSplit("ds")).plan(mesh, params, batch)
    assert own.actions == engine.actions
    assert any(a.kind == "inside" for a in own.actions[0])  # the layers' collectives, predicted


def test_the_keyword_goes_where_the_prediction_takes_it_and_nowhere_else() -> None:
    import functools

    from shardwise.engine.stack.roles import prediction_keywords

    def old(chain: Any, placement: Any, shapes: Any, loss_fn: Any, inputs: Any, targets: Any, recording: Any) -> Any:
        return {}

    @functools.wraps(old)
    def forwarding(*args: Any, **kwargs: Any) -> Any:
        return predict_inside(*args, **kwargs)

    def positional(chain: Any, split_backward: bool = True, /) -> Any:
        return {}

    assert prediction_keywords(predict_inside, False) == {"split_backward": False}
    assert prediction_keywords(tp_predict.predict, True) == {"split_backward": True}
    assert prediction_keywords(old, False) == {}
    assert prediction_keywords(functools.partial(old, None), False) == {}
    assert prediction_keywords(forwarding, False) == {"split_backward": False}  # its own **kwargs, not old's
    assert prediction_keywords(positional, False) == {}
