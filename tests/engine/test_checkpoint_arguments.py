"""Checkpoint calls with their arguments in another order, or of another kind, are refused naming the
argument and the call (not with an AttributeError from inside)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw


@pytest.fixture(scope="module")
def made() -> tuple[Any, Any]:
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    return step, step.init(params)


CALLS: dict[str, tuple[Callable[[Path, Any, Any], Any], str]] = {
    "save(state, path, step)": (lambda p, step, st: sw.checkpoint.save(st, p, step),
                                r"save: path is a TrainState, not a path .*the call is save\(path, state, step\)"),
    "save(path, step, state)": (lambda p, step, st: sw.checkpoint.save(p, step, st),
                                r"save: state is a step, not the TrainState .*the call is save\(path, state, step\)"),
    "save(path, params, step)": (lambda p, step, st: sw.checkpoint.save(p, st.params, step),
                                 r"save: state is a dict, not the TrainState .*not its params"),
    "load(path, mesh, step)": (lambda p, step, st: sw.checkpoint.load(p, sw.Mesh(dp=1), step),
                               r"load: step is a Mesh, not the step .*the call is load\(path, step, mesh\)"),
    "load(path, step, step)": (lambda p, step, st: sw.checkpoint.load(p, step, step),
                               r"load: mesh is a step, not a Mesh or None"),
    "full_state_dict(state, step)": (lambda p, step, st: sw.checkpoint.full_state_dict(st, step),
                                     r"full_state_dict: step is a TrainState, .*full_state_dict\(step, state\)"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_arguments_out_of_order_are_refused_naming_the_call(call: str, made: tuple[Any, Any], tmp_path: Path) -> None:
    step, state = made
    sw.checkpoint.save(tmp_path / "c", state, step)
    fn, message = CALLS[call]
    with pytest.raises(TypeError, match=message):
        fn(tmp_path / "c", step, state)
