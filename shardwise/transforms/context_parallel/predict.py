"""Which collectives each compute of a context-parallel step issues, predicted on fake tensors.

Every stage (without a pipeline: every layer) runs forward, the loss on the last, and backward, on fake
tensors inside ``comm.predicting``: each attention records its ring ppermutes (or all-to-alls) and their
transposes, each parameter the psum of its gradient, in the order the run issues them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...engine.layout.state_layout import Placement
from ...engine.model.chain import Chain
from ...engine.plan.inside import predict_inside
from .comm import Issued, predicting

Predicted = dict[tuple[str, int], list[Issued]]  # (compute kind, stage) -> what it issues


def predict(
    chain: Chain,
    placement: Placement,
    shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
    loss_fn: Callable[[Any, Any], Any],
    inputs: Any,
    targets: Any,
    size: int,
) -> Predicted:
    """For every stage: the collectives of its forward, of the loss (last stage) and of its backward
    (the engine's ``predict_inside``, recording into this transform's ``comm.predicting``)."""
    return predict_inside(chain, placement, shapes, loss_fn, inputs, targets, functools.partial(predicting, size))
