"""Which collectives each compute of an expert-parallel step issues, predicted on fake tensors.

Every stage (without a pipeline: every layer) runs forward, the loss on the last, and backward, on fake
tensors inside ``comm.predicting``: each MoE block records its count all-gather and its two all-to-alls
(and their transposes in backward), each replicated parameter the psum of its gradient. The all-to-alls'
rows are fixed at their bound (blocks.EPForward), so the recorded shapes are the run's. Remat and the
precision casts are part of the rewritten layers, so a recomputed forward's collectives show in the
backward, as they run.
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
