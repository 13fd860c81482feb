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

import collections
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import optree
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


def check_held(params: Any, expected: Expected, previous: torch.device | None = None) -> torch.device | None:
    """Refuse ``state.params`` unless it holds exactly the expected tensors, in shape and dtype, all on one
    device: a parameter moved alone (to ``meta``, to the host) failed deep in the step naming no parameter
    ('Tensor on device meta is not on the expected device cpu!'), or, under ZeRO-3, as a dict update error.
    Where that device is is the state's to say (init makes it where its params are; a whole state moved
    keeps its optimizer state beside its parameters, which opt_check.py compares): the device most of them are
    on, on a tie ``previous`` (where the step last accepted them) if it is one of those. Returns that device."""
    if isinstance(params, InFlightParams):  # made by the previous call of the step itself
        return previous
    device = _usual_device(params, previous)
    if isinstance(params, Mapping) and params.keys() == expected.keys():
        for layer, want in expected.items():  # the usual call: one pass, no message built
            have = params[layer]
            if isinstance(want, torch.Tensor):
                if not (isinstance(have, torch.Tensor) and have.dtype is want.dtype and have.shape == want.shape
                        and have.device == device):
                    break
            elif not (isinstance(have, Mapping) and have.keys() == want.keys() and all(
                    isinstance(t, torch.Tensor) and t.dtype is w.dtype and t.shape == w.shape and t.device == device
                    for t, w in ((have[n], w) for n, w in want.items()))):
                break
        else:
            return device
    _refuse(params, expected, device)


def _usual_device(params: Any, previous: torch.device | None) -> torch.device | None:
    """The device most of ``params``' tensors are on; on a tie ``previous`` if it is one of those, else the
    first of them in order."""
    tree: Any = params  # optree's stubs take no Mapping
    tensors = [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)] if isinstance(
        params, Mapping) else []
    if not tensors:
        return None
    counts = collections.Counter(t.device for t in tensors).most_common()
    tied = [d for d, n in counts if n == counts[0][1]]
    return previous if previous in tied else tied[0]


def _refuse(params: Any, expected: Expected, device: torch.device | None) -> NoReturn:
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
            _check_tensor(f"state.params[{layer!r}]", have, want, "this rank's flat ZeRO shard of the layer", fix,
                          device)
            continue
        if not isinstance(have, Mapping) or set(have) != set(want):
            got = type(have).__name__ if not isinstance(have, Mapping) else sorted(have)
            raise ValueError(f"state.params[{layer!r}] holds {got}, expected the parameters {sorted(want)}. {fix}")
        for name, like in want.items():
            _check_tensor(f"state.params[{layer!r}][{name!r}]", have[name], like, "", fix, device)
    raise AssertionError("check_held found no difference to name")  # unreachable: the fast pass found one


def _check_tensor(where: str, have: Any, like: torch.Tensor, what: str, fix: str,
                  device: torch.device | None) -> None:
    if not isinstance(have, torch.Tensor):
        raise TypeError(f"{where} is a {type(have).__name__}, expected a tensor. {fix}")
    if have.shape != like.shape or have.dtype != like.dtype:
        said = f" ({what})" if what else ""
        raise ValueError(
            f"{where} is {_text(have)}, but the step keeps it as {_text(like)}{said}: the master dtype of "
            f"its precision policy, this rank's part of it. {fix}"
        )
    if device is not None and have.device != device:
        raise ValueError(
            f"{where} is {_text(have)} on {have.device}, but the step keeps it on {device}, where this rank's other "
            f"parameters are: the step would fail on it naming no parameter, or compute across two devices. Move "
            f"it back (tensor.to('{device}')), or, to move a whole state to another device, save it with "
            "sw.checkpoint.save and load it with sw.checkpoint.load(..., device=...)"
        )


def _text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
