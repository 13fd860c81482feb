"""A user's optimizer that makes its state at its first update and whose update reads values (it cannot run on
meta tensors, so nothing predicts its state) loads its own checkpoints: save records the state's containers and
load rebuilds it from that record (engine/checkpoint/opt_structure.py). It was refused before ('its optimizer
state has per-parameter ['momentum'] and [], this step's optimizer has [] and []'). Float64 MLP; a resumed run
equals the uninterrupted one bitwise (the same operations in the same order); resharded, it equals the same
reshard of the optimizer whose state load predicts (the reading update is that one plus a check that passes)."""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
import sys
from pathlib import Path
from typing import Any, NamedTuple

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import save_load

from .test_held_check import _problem as held_problem
from .test_opt_state_check import _LazyInit, _LazyUpdate, _ReadingUpdate

READING = sw.optim.Optimizer(_LazyInit(), _ReadingUpdate(), elementwise=True)
LAZY = sw.optim.Optimizer(_LazyInit(), _LazyUpdate(), elementwise=True)  # its state is predicted on meta

LAYOUTS: dict[str, tuple[Any, dict[str, int] | None]] = {  # (wrap a step, its mesh's axes or None for one device)
    "one_device": (lambda step: step, None),
    "zero1": (lambda step: sw.shard_params(step, "dp", stage=1), {"dp": 2}),
    "zero2": (lambda step: sw.shard_params(step, "dp", stage=2), {"dp": 2}),
    "zero3": (lambda step: sw.shard_params(step, "dp", stage=3), {"dp": 2}),
    "zero3_dp4": (lambda step: sw.shard_params(step, "dp", stage=3), {"dp": 4}),
    "zero1_dp4": (lambda step: sw.shard_params(step, "dp", stage=1), {"dp": 4}),
    "pipeline": (lambda step: sw.pipeline(step, "pp", "1f1b", 2), {"pp": 2}),
}


def _on(layout: str, fn: Any) -> list[Any]:
    axes = LAYOUTS[layout][1]
    if axes is None:
        return [fn(None)]
    return sw.launch(lambda: fn(sw.Mesh(**axes)), world=math.prod(axes.values()))


def _saved_then_resumed(optimizer: Any, source: str, target: str, path: Path) -> list[torch.Tensor]:
    """One step under ``source``, saved, loaded by a fresh step under ``target``, two steps
    more there; rank 0's final parameters, whole."""
    def first(mesh: Any) -> None:
        base, params, batches = held_problem(optimizer, steps=3)
        step = LAYOUTS[source][0](base)
        state, _ = step(step.init(params, mesh), batches[0])
        sw.checkpoint.save(path, state, step)

    def rest(mesh: Any) -> list[torch.Tensor]:
        base, _, batches = held_problem(optimizer, steps=3)
        step = LAYOUTS[target][0](base)
        state = sw.checkpoint.load(path, step, mesh)
        for batch in batches[1:]:
            state, _ = step(state, batch)
        return optree.tree_leaves(step.full_params(state))

    _on(source, first)
    return _on(target, rest)[0]


def _uninterrupted(optimizer: Any, layout: str) -> list[torch.Tensor]:
    def run(mesh: Any) -> list[torch.Tensor]:
        base, params, batches = held_problem(optimizer, steps=3)
        step = LAYOUTS[layout][0](base)
        state = step.init(params, mesh)
        for batch in batches:
            state, _ = step(state, batch)
        return optree.tree_leaves(step.full_params(state))

    return _on(layout, run)[0]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", ["one_device", "zero1", "zero2", "zero3", "pipeline"])
def test_a_reading_optimizers_checkpoint_resumes_as_the_uninterrupted_run(layout: str, tmp_path: Path) -> None:
    resumed = _saved_then_resumed(READING, layout, layout, tmp_path / "c")
    assert len(resumed) == 6 and _equal(resumed, _uninterrupted(READING, layout))


@pytest.mark.parametrize(("source", "target"), [("zero3", "zero3_dp4"), ("zero1", "one_device"),
                                                ("one_device", "zero1_dp4"), ("pipeline", "zero3")])
def test_a_reading_optimizers_checkpoint_reshards(source: str, target: str, tmp_path: Path) -> None:
    """Equal bitwise to the same save and load of the optimizer whose state load predicts; within rounding
    (1e-12 relative: the gradients are averaged over another number of ranks) of the uninterrupted run."""
    resumed = _saved_then_resumed(READING, source, target, tmp_path / "r")
    predicted = _saved_then_resumed(LAZY, source, target, tmp_path / "p")
    assert _equal(resumed, predicted)
    for got, want in zip(resumed, _uninterrupted(READING, target), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def _gloo_rank(directory: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """ZeRO-3 on two gloo processes: the uninterrupted run, and one saved after its first step and resumed by a
    fresh step; each's final parameters."""
    mesh = sw.Mesh(dp=2)
    base, params, batches = held_problem(READING, steps=3)
    step = sw.shard_params(base, "dp", stage=3)
    state = step.init(params, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    kept = optree.tree_leaves(step.full_params(state))
    state, _ = step(step.init(params, mesh), batches[0])
    sw.checkpoint.save(Path(directory) / "c", state, step)
    fresh = sw.shard_params(held_problem(READING, steps=3)[0], "dp", stage=3)
    state = sw.checkpoint.load(Path(directory) / "c", fresh, mesh)
    for batch in batches[1:]:
        state, _ = fresh(state, batch)
    return kept, optree.tree_leaves(fresh.full_params(state))


@pytest.mark.gloo
def test_a_reading_optimizers_checkpoint_resumes_on_gloo_processes(gloo2: Any, tmp_path: Path) -> None:
    for kept, resumed in gloo2.run(_gloo_rank, str(tmp_path)):
        assert _equal(kept, resumed)


def test_a_cast_moment_saved_before_a_step_confirmed_it_is_refused_at_the_first_step_after_load(
        tmp_path: Path) -> None:
    """A fresh step cannot confirm a reading optimizer's state before its update ran (save accepts it): save
    writes the moment as it was given (float32, recorded so), load rebuilds it so, and the first step's update,
    which made float64 of it, refuses it naming the leaf before it returns."""
    step, params, batches = held_problem(READING, steps=3)
    state, _ = step(step.init(params), batches[0])
    fresh, fresh_params, _ = held_problem(READING, steps=3)  # a resumed process: the state pickled, a new Step
    resumed = pickle.loads(pickle.dumps(state))._replace(layout=fresh.init(fresh_params).layout)
    cast = resumed._replace(opt_state=optree.tree_map(lambda t: t.float(), resumed.opt_state))
    sw.checkpoint.save(tmp_path / "c", cast, fresh)
    loaded = sw.checkpoint.load(tmp_path / "c", held_problem(READING, steps=3)[0])
    assert loaded.opt_state["momentum"]["0"]["bias"].dtype == torch.float32  # written and read as given
    again, _, _ = held_problem(READING, steps=3)
    with pytest.raises(ValueError, match=r"state\.opt_state\['momentum'\]\['0'\]\['bias'\] is float32 \[8\] on cpu, "
                                         r"but the update made float64 \[8\] on cpu of it"):
        again(loaded, batches[1])


def test_a_checkpoint_without_the_record_is_refused_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint saved before save recorded the state's containers (or by ranks whose states differ)."""
    monkeypatch.setattr(save_load, "_structure", lambda *args: None)
    step, params, batches = held_problem(READING, steps=3)
    state, _ = step(step.init(params), batches[0])
    sw.checkpoint.save(tmp_path / "c", state, step)
    with pytest.raises(sw.checkpoint.CheckpointError,
                       match=r"per-parameter \['momentum'\] and \[\], this step's optimizer has \[\] and \[\]"):
        sw.checkpoint.load(tmp_path / "c", held_problem(READING, steps=3)[0])


def test_another_optimizers_checkpoint_is_refused_not_rebuilt_from_its_record(tmp_path: Path) -> None:
    """The record would rebuild AdamW's state, which the reading update would then be given."""
    step, params, batches = held_problem(sw.optim.adamw(1e-2), steps=3)
    state, _ = step(step.init(params), batches[0])
    sw.checkpoint.save(tmp_path / "c", state, step)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"saved by the update .*, this step's is "
                                                            r".*_ReadingUpdate.*load it with the optimizer that saved"):
        sw.checkpoint.load(tmp_path / "c", held_problem(READING, steps=3)[0])


# -- a state of other containers: rebuilt as its own type, or refused naming it ------------------------------
class Kept(NamedTuple):
    momentum: Any
    count: torch.Tensor


def _reading(made: Any) -> Any:
    """A reading lazy optimizer whose state is ``made(momentum, count)``."""
    class Update:
        @torch.no_grad()
        def __call__(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
            if not math.isfinite(sum(float(g.sum()) for g in optree.tree_leaves(grads))):
                return params, state
            old = state.momentum if hasattr(state, "momentum") else state.get("momentum") if state else None
            momentum = optree.tree_map(lambda g: g.clone(), grads) if old is None else optree.tree_map(
                lambda m, g: 0.9 * m + g, old, grads)
            count = state.count + 1 if hasattr(state, "count") else torch.ones((), dtype=torch.int64)
            return optree.tree_map(lambda p, m: p - 0.1 * m, params, momentum), made(momentum, count)

    return sw.optim.Optimizer(_LazyInit(), Update(), elementwise=True)


def _save_one_step(optimizer: Any, path: Path) -> tuple[Any, list[Any]]:
    step, params, batches = held_problem(optimizer, steps=3)
    state, _ = step(step.init(params), batches[0])
    sw.checkpoint.save(path, state, step)
    return step, batches


def test_a_named_tuple_state_round_trips_as_its_own_type(tmp_path: Path) -> None:
    optimizer = _reading(Kept)
    step, batches = _save_one_step(optimizer, tmp_path / "c")
    kept = step.init(held_problem(optimizer, steps=3)[1])
    for batch in batches:
        kept, _ = step(kept, batch)
    fresh, _, _ = held_problem(optimizer, steps=3)
    state = sw.checkpoint.load(tmp_path / "c", fresh)
    assert type(state.opt_state) is Kept and state.opt_state.count.dtype == torch.int64
    for batch in batches[1:]:
        state, _ = fresh(state, batch)
    assert int(state.opt_state.count) == 3
    assert _equal(optree.tree_leaves(state.params), optree.tree_leaves(kept.params))


def test_a_named_tuple_whose_class_changed_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer = _reading(Kept)
    _save_one_step(optimizer, tmp_path / "c")
    monkeypatch.setattr(sys.modules[__name__], "Kept",
                        NamedTuple("Kept", [("momentum", Any), ("steps", torch.Tensor)]))
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"optimizer state's <root> is a .*Kept\(momentum, count\), "
                                                            r"but .*Kept is now \['momentum', 'steps'\]"):
        sw.checkpoint.load(tmp_path / "c", held_problem(optimizer, steps=3)[0])


def test_a_named_tuple_defined_in_a_function_and_an_ordered_dict_are_refused_naming_them(tmp_path: Path) -> None:
    class Local(NamedTuple):
        momentum: Any
        count: torch.Tensor

    optimizer = _reading(Local)
    _save_one_step(optimizer, tmp_path / "l")
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"Local\(momentum, count\), which cannot be found: a "
                                                            r"class defined inside a function"):
        sw.checkpoint.load(tmp_path / "l", held_problem(optimizer, steps=3)[0])
    ordered = _reading(lambda m, c: collections.OrderedDict(momentum=m, count=c))
    _save_one_step(ordered, tmp_path / "o")
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"<root> is a collections\.OrderedDict, a container load "
                                                            r"cannot rebuild"):
        sw.checkpoint.load(tmp_path / "o", held_problem(ordered, steps=3)[0])


@dataclasses.dataclass
class DataState:
    momentum: Any
    count: torch.Tensor


def test_a_dataclass_state_is_refused_naming_it_never_saved(tmp_path: Path) -> None:
    """Not a tree of tensors: refused by save (and by the step's next call) naming it, where both said 'a state of
    another optimizer, or one edited by hand'; never written to be loaded as another type."""
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"state\.opt_state is a DataState: this optimizer's "
                                                            r"update cannot run.*dicts, lists, tuples and NamedTuples"):
        _save_one_step(_reading(DataState), tmp_path / "d")
    assert not (tmp_path / "d").exists()
    step, params, batches = held_problem(_reading(DataState), steps=3)
    state, _ = step(step.init(params), batches[0])
    with pytest.raises(TypeError, match=r"state\.opt_state is a DataState: this optimizer's update cannot run"):
        step(state, batches[1])
