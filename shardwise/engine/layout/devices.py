"""Which device a rank computes on, read off the tensors it holds.

Tensors a transform makes itself (zeros for a gradient nobody produced, a rank's
metrics) go where the rank's parameters are: made without a device, they would
land on the CPU, or on whatever ``torch.set_default_device`` / ``with
torch.device(...)`` names, and the first operation mixing them with the
parameters would fail on a GPU. Host-side control data (message headers, step
counters) names ``device="cpu"`` instead.
"""

from __future__ import annotations

from typing import Any

import optree
import torch


def device_of(*trees: Any, default: torch.device | str = "cpu") -> torch.device:
    """The device of the first tensor among ``trees``' leaves, in order; ``default`` if none holds one.

    >>> device_of({"w": torch.zeros(2)}, default="meta")
    device(type='cpu')
    >>> device_of({}, [], default="meta")
    device(type='meta')
    """
    for tree in trees:
        first = _first_tensor(tree)
        if first is not None:
            return first.device
    return torch.device(default)


def _first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor among ``tree``'s leaves in optree's order (a dict's keys sorted): a step's
    parameters (a dict of dicts of tensors) walked to their first leaf, not flattened whole."""
    if isinstance(tree, torch.Tensor):
        return tree
    if type(tree) is dict and tree:
        try:
            first = min(tree)
        except TypeError:  # keys of types that do not compare: optree's order
            first = None
        if type(first) is str and not set(map(type, tree)) - {str}:
            found = _first_tensor(tree[first])
            if found is not None:
                return found
    return next((leaf for leaf in optree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)), None)


def host_scalar(value: bool | int | float) -> torch.Tensor:
    """A 0-d CPU tensor of a value the host already knows (a metric such as the loss scale).

    Named CPU, not left to the default device: reading it back is then never a device sync.
    """
    return torch.tensor(value, device="cpu")
