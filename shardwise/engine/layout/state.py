"""TrainState: everything a training step carries from one call to the next.

A NamedTuple, so optree flattens it with no registration, leaf order is the
same on every rank, and it saves and loads with ``torch.save`` as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from ..model.chain import Chain

Params = dict[str, dict[str, torch.Tensor]]
"""Parameter pytree: layer name -> local parameter name -> tensor (see Chain)."""


def map_params(fn: Callable[[torch.Tensor], torch.Tensor], params: Mapping[str, Mapping[str, torch.Tensor]]) -> Params:
    """Apply ``fn`` to every tensor of a params pytree, keeping its two-level structure."""
    return {layer: {name: fn(t) for name, t in tensors.items()} for layer, tensors in params.items()}


class TrainState(NamedTuple):
    """Parameters (or this rank's shards of them), optimizer state, step count, loss scale.

    ``step`` counts the step's calls, a skipped one too (a mixed-precision step whose gradient
    was not finite); the optimizer state counts the updates it applied, which is what a
    learning-rate schedule and AdamW's bias corrections read, so a skipped step moves neither.
    ``loss_scale`` is ``None`` unless a
    mixed-precision transform with loss scaling put one there. ``mesh`` and
    ``layout`` are static: the mesh the state lives on and how the parameters
    are laid out on it (a ``sw.layout.StateLayout``). ``rng`` is the seed of
    the step's random streams: with ``step`` it decides every
    dropout mask, so a resumed run continues identically.

    After a ZeRO-1/2 step with ``overlap_gather`` (the default off a CPU), ``params`` is a read-only
    mapping: the full parameters while the all-gathers that make them are in flight, which
    any read waits for first (pickled or flattened, it is the plain dict).
    """

    params: Any
    opt_state: Any
    step: int = 0
    loss_scale: Any = None
    mesh: Any = None
    layout: Any = None
    rng: Any = None


def check_params(chain: Chain, params: Any) -> None:
    """Refuse a params pytree that does not match the chain, naming the layer and the names."""
    if not isinstance(params, Mapping):
        raise TypeError(
            "params must be a dict layer name -> dict of tensors (as functionalize returns), "
            f"got {type(params).__name__}"
        )
    unknown = set(params) - set(chain.names)
    if unknown:
        raise ValueError(
            f"params has layers {sorted(unknown)} that the chain does not have; chain layers: {list(chain.names)}"
        )
    for layer in chain.layers:
        expected = set(chain.owned_param_names(layer.name))
        got = set(params.get(layer.name, {}))
        if expected != got:
            raise ValueError(
                f"params[{layer.name!r}] does not match the chain: missing {sorted(expected - got)}, "
                f"unexpected {sorted(got - expected)}"
            )
        for name, value in params.get(layer.name, {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"params[{layer.name!r}][{name!r}] is a {type(value).__name__}, not a tensor")


def tree_nbytes(tree: Any) -> int:
    """Bytes of every tensor leaf of ``tree`` (meta tensors count their would-be size)."""
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))
