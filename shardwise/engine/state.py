"""TrainState: everything a training step carries from one call to the next.

A NamedTuple, so optree flattens it with no registration, leaf order is the
same on every rank, and it saves and loads with ``torch.save`` as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

Params = dict[str, dict[str, torch.Tensor]]
"""Parameter pytree: layer name -> local parameter name -> tensor (see Chain)."""


def map_params(fn: Callable[[torch.Tensor], torch.Tensor], params: Mapping[str, Mapping[str, torch.Tensor]]) -> Params:
    """Apply ``fn`` to every tensor of a params pytree, keeping its two-level structure."""
    return {layer: {name: fn(t) for name, t in tensors.items()} for layer, tensors in params.items()}


class TrainState(NamedTuple):
    """Parameters (or this rank's shards of them), optimizer state, step count, loss scale.

    ``step`` counts completed updates. ``loss_scale`` is ``None`` unless a
    mixed-precision transform with loss scaling put one there. ``mesh`` and
    ``layout`` are static: the mesh the state lives on and how the parameters
    are laid out on it (engine/layout.py's StateLayout). ``rng`` is the seed of
    the step's random streams (engine/rng.py): with ``step`` it decides every
    dropout mask, so a resumed run continues identically.
    """

    params: Any
    opt_state: Any
    step: int = 0
    loss_scale: Any = None
    mesh: Any = None
    layout: Any = None
    rng: Any = None
