"""The optimizers' flattening (engine/optim/flat.py) gives optree's leaves and rebuilds optree's trees."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import optree
import pytest
import torch

from shardwise.engine.optim import flat


def _trees() -> list[Any]:
    t = [torch.full((2,), float(i)) for i in range(6)]
    return [
        {"b": {"weight": t[0], "bias": t[1]}, "a": {"w": t[2]}, "10": {}, "9": {"z": t[3], "a": t[4]}},  # the fast path
        {"only": t[0]},  # a dict of tensors: optree's
        {"a": {"w": t[0], "n": None}},  # a None leaf: optree's
        {"a": OrderedDict(w=t[0], b=t[1])},  # another container: optree's
        [t[0], (t[1], {"k": t[2]})],
        {1: {"w": t[0]}, 0: {"w": t[1]}},  # keys that are not strings: optree's
        {},
    ]


@pytest.mark.parametrize("tree", _trees())
def test_flatten_and_unflatten_are_optrees(tree: Any) -> None:
    leaves, structure = flat.flatten(tree)
    want, spec = optree.tree_flatten(tree)
    assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want, strict=True))
    assert structure.spec == spec
    doubled = [x * 2 for x in leaves]
    rebuilt = flat.unflatten(structure, doubled)
    expected = optree.tree_unflatten(spec, doubled)
    assert optree.tree_structure(rebuilt) == spec
    assert repr(rebuilt) == repr(expected)  # key order included
    again = flat.leaves_like(rebuilt, structure, "grads")
    assert all(a is b for a, b in zip(again, doubled, strict=True))


def test_a_tree_of_another_structure_is_refused_by_name() -> None:
    t = torch.zeros(2)
    _, structure = flat.flatten({"a": {"w": t, "b": t}})
    for other in ({"a": {"w": t}}, {"a": {"w": t, "c": t}}, {"b": {"w": t, "b": t}}, {"a": [t, t]}):
        with pytest.raises(ValueError, match="grads: its tree structure"):
            flat.leaves_like(other, structure, "grads")
