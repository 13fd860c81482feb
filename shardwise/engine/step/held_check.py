"""A TrainState's parameters must be laid out as ``Step.init`` laid them out on this rank.

A state is a plain NamedTuple, so a user can change it: cast it (``optree.tree_map(lambda t:
t.half(), state)`` to save memory), put ``full_params(state)`` back into it, replace one tensor.
Some such states run on without an error and train something else: under ``mixed_precision`` the
layers cast whatever they are given to the compute dtype, so a state cast to it goes on with master
weights and moments of that precision; a bias of shape ``[1]`` broadcasts in the forward and in the
update. Others fail deep in the executor, naming nothing the user wrote. So every call compares
the state's parameters with what init makes for the rank (its layers, its ZeRO shards, its
tensor-parallel slices, the master dtype): shapes and dtypes only, no values. The usual call
compares a signature with the one last accepted instead (state_check.py); this full comparison
runs for any other state, and names the first difference. opt_check.py does the same for the
optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ..layout.in_flight import InFlightParams
from ..layout.state_layout import StateLayout
from .init_state import held_params

# (layer -> meta tensor of a ZeRO-3 unit's flat shard, or name -> meta tensor) as init makes it
Expected = dict[str, Any]


def expected_held(layout: StateLayout, mesh: Mesh | None,
                  to_local: Callable[[Mapping[str, Any], str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                  ) -> Expected:
    """What ``Step.init`` holds on this rank, as meta tensors (memoised in the layout per rank)."""
    return expected_trees(layout, mesh, to_local)[0]


def expected_trees(layout: StateLayout, mesh: Mesh | None,
                   to_local: Callable[[Mapping[str, Any], str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                   ) -> tuple[Expected, dict[str, Any]]:
    """(what ``Step.init`` holds on this rank, what it gives the optimizer's init), as meta tensors
    (memoised in the layout per rank): the second is the tree the optimizer state mirrors (ZeRO's
    flat shards, else the held parameters)."""
    index = layout.index_of(mesh)
    sharding = layout.sharding
    dp_index = 0 if sharding is None or mesh is None else mesh.axis_index(sharding.axis)
    key = ("held meta", index, dp_index)
    found = layout.cache.get(key)
    if found is not None:
        return found
    shapes: dict[str, dict[str, torch.Tensor]] = {layer: {} for layer in layout.layers}
    for (layer, name), spec in layout.leaves.items():
        shapes[layer][name] = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    made = held_params(
        shapes, layout, index, dp_index,
        make=lambda layer, names: {n: shapes[layer][n] for n in names},
        to_local=lambda layer, values: to_local(shapes, layer, values),
    )
    layout.cache[key] = made
    return made


def check_held(params: Any, expected: Expected) -> None:
    """Refuse ``state.params`` unless it holds exactly the expected tensors, in shape and dtype."""
    if isinstance(params, InFlightParams):  # made by the previous call of the step itself
        return
    if isinstance(params, Mapping) and params.keys() == expected.keys():
        for layer, want in expected.items():  # the usual call: one pass, no message built
            have = params[layer]
            if isinstance(want, torch.Tensor):
                if not (isinstance(have, torch.Tensor) and have.dtype is want.dtype and have.shape == want.shape):
                    break
            elif not (isinstance(have, Mapping) and have.keys() == want.keys() and all(
                    isinstance(t, torch.Tensor) and t.dtype is w.dtype and t.shape == w.shape
                    for t, w in ((have[n], w) for n, w in want.items()))):
                break
        else:
            return
    _refuse(params, expected)


def _refuse(params: Any, expected: Expected) -> None:
    """The first difference, named."""
    fix = ("A TrainState's params are the step's own layout: change values in place (tensor.copy_), "
           "not the tensors; to cast, reshard or replace parameters, go through sw.checkpoint.save / "
           "load, or step.init(params, mesh) with the new values")
    if not isinstance(params, Mapping) or set(params) != set(expected):
        got = type(params).__name__ if not isinstance(params, Mapping) else sorted(params)
        raise ValueError(
            f"state.params holds {got}, but this rank's state holds the layers {sorted(expected)} "
            f"(as step.init made it). {fix}"
        )
    for layer, want in expected.items():
        have = params[layer]
        if isinstance(want, torch.Tensor):  # ZeRO-3: the unit's flat shard
            _check_tensor(f"state.params[{layer!r}]", have, want, "this rank's flat ZeRO shard of the layer", fix)
            continue
        if not isinstance(have, Mapping) or set(have) != set(want):
            got = type(have).__name__ if not isinstance(have, Mapping) else sorted(have)
            raise ValueError(f"state.params[{layer!r}] holds {got}, expected the parameters {sorted(want)}. {fix}")
        for name, like in want.items():
            _check_tensor(f"state.params[{layer!r}][{name!r}]", have[name], like, "", fix)
    raise AssertionError("check_held found no difference to name")  # unreachable: the fast pass found one


def _check_tensor(where: str, have: Any, like: torch.Tensor, what: str, fix: str) -> None:
    if not isinstance(have, torch.Tensor):
        raise TypeError(f"{where} is a {type(have).__name__}, expected a tensor. {fix}")
    if have.shape != like.shape or have.dtype != like.dtype:
        said = f" ({what})" if what else ""
        raise ValueError(
            f"{where} is {_text(have)}, but the step keeps it as {_text(like)}{said}: the master dtype of "
            f"its precision policy, this rank's part of it. {fix}"
        )


def _text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
