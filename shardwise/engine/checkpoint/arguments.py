"""Checks of the arguments ``save``, ``load`` and ``full_state_dict`` take, so that a call with them
in another order (``torch.save``'s object first) or of another kind (the params for the state) is
refused naming the argument and the call, not with an ``AttributeError`` from deep inside.

A step is recognised by what the checkpoint code uses of it (``engine/step`` sits above this
folder), a state by its class.
"""

from __future__ import annotations

import os
from typing import Any

from ...collectives.mesh import Mesh
from ..layout.state import TrainState


def _kind(value: Any) -> str:
    if isinstance(value, TrainState):
        return "a TrainState"
    if _is_step(value):
        return "a step"
    if isinstance(value, Mesh):
        return "a Mesh"
    if isinstance(value, (str, os.PathLike)):
        return f"a path ({str(value)!r})"
    return f"a {type(value).__name__}"


def _is_step(value: Any) -> bool:
    return hasattr(value, "transforms") and hasattr(value, "base_chain")


def _refuse(call: str, name: str, value: Any, wanted: str) -> None:
    raise TypeError(f"{call.split('(')[0]}: {name} is {_kind(value)}, not {wanted}; the call is {call}")


def check_path(call: str, path: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        _refuse(call, "path", path, "a path (str or os.PathLike)")


def check_state(call: str, state: Any) -> None:
    if not isinstance(state, TrainState):
        _refuse(call, "state", state, "the TrainState step.init or a step call returned (not its params)")


def check_step(call: str, step: Any) -> None:
    if not _is_step(step):
        _refuse(call, "step", step, "the step (sw.train_step and its transforms) that makes the state")


def check_mesh(call: str, mesh: Any) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        _refuse(call, "mesh", mesh, "a Mesh or None")
