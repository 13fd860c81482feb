"""The values gradients flow through in a layer's input or output: its floating-point tensors."""

from __future__ import annotations

from typing import Any

import optree
import torch


def float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree`` in pytree order: the values gradients flow through."""
    if isinstance(tree, torch.Tensor):  # the usual layer output
        return [tree] if tree.is_floating_point() else []
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]
