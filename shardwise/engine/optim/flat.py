"""A parameter tree's leaves in optree's order, and the tree rebuilt from new leaves.

The optimizers flatten the parameters, the gradients and each state tree every update. The
usual tree (a step's parameters: a dict of dicts of tensors with string keys) is read here in
Python, in optree's leaf order (each dict's keys sorted) and rebuilt in the tree's own key order,
as ``optree.tree_unflatten`` does, in about a third of optree's time; any other tree goes through
optree. ``tests/engine/test_optim_flat.py`` checks both against optree.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import optree
from torch import Tensor


class Structure:
    """How a tree was flattened: the template tree, and for a dict of dicts of tensors each leaf's
    (outer key, inner key) in leaf order; for any other tree its optree spec."""

    def __init__(self, template: Any, keys: list[tuple[str, str]] | None, spec: optree.PyTreeSpec | None) -> None:
        self.template = template
        self.keys = keys
        self._spec = spec

    @property
    def spec(self) -> optree.PyTreeSpec:
        """The template's optree spec (made when first asked, for a dict of dicts)."""
        if self._spec is None:
            self._spec = optree.tree_structure(self.template)
        return self._spec


def _nested_keys(tree: Any) -> list[tuple[str, str]] | None:
    """Each leaf's (outer, inner) key in optree's order, if ``tree`` is a dict of dicts of tensors
    with string keys; else None."""
    # The checks read with map (C-level loops), not generators: this runs on every tree an
    # update flattens (parameters, gradients, each moment), and a generator's resumptions cost more.
    if type(tree) is not dict or set(map(type, tree)) - {str}:
        return None
    keys: list[tuple[str, str]] = []
    for outer in sorted(tree):
        inner = tree[outer]
        if type(inner) is not dict or set(map(type, inner)) - {str} \
                or not all(map(isinstance, inner.values(), repeat(Tensor))):
            return None
        keys += zip(repeat(outer), sorted(inner))
    return keys


def flatten(tree: Any) -> tuple[list[Any], Structure]:
    """``optree.tree_flatten(tree)``: its leaves, and a :class:`Structure` to check and rebuild with."""
    keys = _nested_keys(tree)
    if keys is not None:
        return [tree[a][b] for a, b in keys], Structure(tree, keys, None)
    leaves, spec = optree.tree_flatten(tree)
    return leaves, Structure(tree, None, spec)


_DICT = {dict}


def leaves_like(tree: Any, structure: Structure, name: str) -> list[Any]:
    """``tree``'s leaves, paired with the template's: refused unless it has the template's structure."""
    template, keys = structure.template, structure.keys
    if keys is not None and type(tree) is dict and tree.keys() == template.keys():
        # Each inner dict's key set the template's (read with map, as _nested_keys: no generator)
        inner = [tree[k] for k in template]
        if set(map(type, inner)) <= _DICT and list(map(dict.keys, inner)) == list(map(dict.keys, template.values())):
            leaves = [tree[a][b] for a, b in keys]
            if all(map(isinstance, leaves, repeat(Tensor))):
                return leaves
    leaves, tree_spec = optree.tree_flatten(tree)
    if tree_spec != structure.spec:
        raise ValueError(
            f"{name}: its tree structure {tree_spec} differs from the params' {structure.spec}; "
            "pass one tensor per parameter, in the same containers"
        )
    return leaves


def unflatten(structure: Structure, leaves: list[Any]) -> Any:
    """``optree.tree_unflatten``: the template's structure with ``leaves`` (each dict in the
    template's key order)."""
    if structure.keys is None:
        return optree.tree_unflatten(structure.spec, leaves)
    if len(leaves) != len(structure.keys):
        raise ValueError(f"{len(leaves)} leaves for a tree of {len(structure.keys)}")
    get = dict(zip(structure.keys, leaves, strict=True)).__getitem__
    # (each inner dict made by dict(zip(...)) in C, not a comprehension per layer: this runs on every
    # tree an update returns)
    return {
        outer: dict(zip(inner, map(get, zip(repeat(outer), inner)), strict=True))
        for outer, inner in structure.template.items()
    }
