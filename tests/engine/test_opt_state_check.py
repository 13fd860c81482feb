"""A step refuses a TrainState whose optimizer state is not laid out as its optimizer makes it on the
rank (moments cast, replaced by one that broadcasts, a missing entry, a step count of another kind, a
state of another optimizer), naming the leaf as the user writes it; states copied, loaded or made by
the step itself run on, and so does a user's optimizer that makes its state at its first update."""

from __future__ import annotations

import math
import pickle
from typing import Any

import optree
import pytest
import torch

import shardwise as sw

from .test_held_check import STACKS
from .test_held_check import _problem as held_problem

POLICY = "params=f64,compute=f32,output=f64"


def _problem(optimizer: Any) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    return held_problem(optimizer, steps=3)


SGD = sw.optim.sgd(0.1, momentum=0.9)
ADAMW = sw.optim.adamw(1e-2)


def _run(stack: str, optimizer: Any, edit: Any, policy: str | None = None) -> list[list[torch.Tensor]]:
    """Step once, apply ``edit(step, state)``, step twice more; every rank's final parameters."""
    base, params, batches = _problem(optimizer)
    wrap, mesh_axes = STACKS[stack]
    step = wrap(base) if policy is None else sw.mixed_precision(wrap(base), policy)

    def main() -> list[torch.Tensor]:
        mesh = None if mesh_axes is None else sw.Mesh(**mesh_axes)
        state, _ = step(step.init(params, mesh), batches[0])
        state = edit(step, state)
        for batch in batches[1:]:
            state, _ = step(state, batch)
        return optree.tree_leaves(state.params)

    return [main()] if mesh_axes is None else sw.launch(main, world=2)


def _opt_cast(dtype: torch.dtype) -> Any:
    def edit(step: Any, state: Any) -> Any:
        cast = optree.tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, state.opt_state)
        return state._replace(opt_state=cast)
    return edit


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_momentum_cast_to_bfloat16_is_refused_not_rounded_once_and_trained_on(stack: str) -> None:
    """SGD's buffers cast to bfloat16 by hand were rounded once and promoted back at the next update: on one
    device the parameters ended 2e-4 off after two more steps, and no error."""
    field = r"momentum\['\d'\]" if stack == "zero3" or stack == "zero1" else r"momentum\['\d'\]\['bias'\]"
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=rf"state\.opt_state\.{field} is bfloat16 \[\d+\], but the step keeps it as float64"):
        _run(stack, SGD, _opt_cast(torch.bfloat16))


def test_adamw_moments_cast_are_named_not_a_foreach_dtype_error() -> None:
    """Before: RuntimeError: expected dtype c10::BFloat16 for `end` but got dtype double."""
    with pytest.raises(ValueError, match=r"state\.opt_state\.exp_avg\['0'\]\['bias'\] is bfloat16 \[8\], but the "
                                         r"step keeps it as float64 \[8\].*sw\.checkpoint\.save / load"):
        _run("one_device", ADAMW, _opt_cast(torch.bfloat16))


def test_moments_cast_to_the_compute_dtype_under_mixed_precision_are_refused() -> None:
    """The master dtype is float64: moments of float32 would update float64 master weights at float32."""
    with pytest.raises(ValueError, match=r"state\.opt_state\.exp_avg\['0'\]\['bias'\] is float32 \[8\], but the step "
                                         r"keeps it as float64 \[8\]"):
        _run("one_device", ADAMW, _opt_cast(torch.float32), POLICY)


def _replaced(field: str, fn: Any) -> Any:
    def edit(step: Any, state: Any) -> Any:
        tree = {k: dict(v) for k, v in getattr(state.opt_state, field).items()}
        fn(tree["0"])
        return state._replace(opt_state=state.opt_state._replace(**{field: tree}))
    return edit


def _broadcasting(layer: dict[str, torch.Tensor]) -> None:
    layer["bias"] = layer["bias"][:1].clone()


EDITS = {
    # a moment of shape [1] broadcast in the update: another model, no error
    "broadcasting moment": (_replaced("exp_avg", _broadcasting),
                            r"state\.opt_state\.exp_avg\['0'\]\['bias'\] is float64 \[1\], but the step keeps it as "
                            r"float64 \[8\]"),
    "missing moment": (_replaced("exp_avg_sq", lambda layer: layer.pop("bias")),
                       r"state\.opt_state\.exp_avg_sq\['0'\]\['bias'\] is missing from the state: the optimizer's "
                       r"init makes it \(float64 \[8\]\)"),
    # counted on as a Python int, which save then refused ('keep numbers in 0-d tensors')
    "int step": (lambda step, state: state._replace(opt_state=state.opt_state._replace(step=1)),
                 r"state\.opt_state\.step is an int, but the step keeps it as a tensor, int64 \[\].*torch\.tensor\(n, "
                 r"dtype=torch\.int64\)"),
    "float step": (lambda step, state: state._replace(opt_state=state.opt_state._replace(step=torch.tensor(1.0))),
                   r"state\.opt_state\.step is float32 \[\], but the step keeps it as int64 \[\]"),
    # counted on: the step count of a [1] tensor (saved, it did not load into the 0-d one)
    "step of one element": (lambda step, state: state._replace(
        opt_state=state.opt_state._replace(step=torch.tensor([1]))),
        r"state\.opt_state\.step is int64 \[1\], but the step keeps it as int64 \[\]"),
    "another optimizer's state": (
        lambda step, state: state._replace(opt_state=SGD.init(state.params)),
        r"state\.opt_state is a SgdState\(step, momentum\), but this step's optimizer keeps an AdamWState\(step, "
        r"exp_avg, exp_avg_sq\)"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_optimizer_state_edited_by_hand_is_refused_naming_the_leaf(edit: str) -> None:
    fn, message = EDITS[edit]
    with pytest.raises((ValueError, TypeError), match=message):
        _run("one_device", ADAMW, fn)


def test_a_tensor_swapped_in_place_is_refused_though_it_is_the_same_object() -> None:
    """The usual call compares the state's signature with the one it accepted last: read from the tensors,
    not assumed from their identity, which ``.data =`` keeps."""
    def swap(step: Any, state: Any) -> Any:
        moment = state.opt_state.exp_avg["2"]["weight"]
        moment.data = moment.data.float()
        return state

    with pytest.raises(ValueError, match=r"state\.opt_state\.exp_avg\['2'\]\['weight'\] is float32 \[8, 8\]"):
        _run("one_device", ADAMW, swap)

    def swap_param(step: Any, state: Any) -> Any:
        param = state.params["2"]["bias"]
        param.data = param.data[:1]
        return state

    with pytest.raises(ValueError, match=r"state\.params\['2'\]\['bias'\] is float64 \[1\]"):
        _run("one_device", ADAMW, swap_param)


def test_a_moment_replaced_in_the_returned_dict_is_refused() -> None:
    """The dicts the step returned are the user's: one changed in place is read again, not trusted."""
    def replace_in_place(step: Any, state: Any) -> Any:
        state.opt_state.exp_avg["0"]["bias"] = torch.zeros(1, dtype=torch.float64)
        return state

    with pytest.raises(ValueError, match=r"state\.opt_state\.exp_avg\['0'\]\['bias'\] is float64 \[1\]"):
        _run("one_device", ADAMW, replace_in_place)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_copied_and_untouched_states_train_as_the_step_left_them(stack: str) -> None:
    """No false refusal: a state copied leaf by leaf trains exactly as the one the step returned."""
    untouched = _run(stack, ADAMW, lambda step, state: state)
    copied = _run(stack, ADAMW, lambda step, state: state._replace(
        params=optree.tree_map(torch.clone, state.params), opt_state=optree.tree_map(torch.clone, state.opt_state)))
    for a, b in zip(untouched, copied, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_save_refuses_a_state_whose_moments_were_cast(tmp_path: Any) -> None:
    """save wrote the cast moments, and load cast them back: the rounding unnoticed."""
    step, params, batches = _problem(ADAMW)
    state, _ = step(step.init(params), batches[0])
    cast = _opt_cast(torch.float32)(step, state)
    with pytest.raises(ValueError, match=r"state\.opt_state\.exp_avg\['0'\]\['bias'\] is float32 \[8\]"):
        sw.checkpoint.save(tmp_path / "c", cast, step)
    assert not (tmp_path / "c").exists()
    sw.checkpoint.save(tmp_path / "c", state, step)  # the state itself saves, and loads back and steps
    loaded = sw.checkpoint.load(tmp_path / "c", step)
    step(loaded, batches[1])


class _LazyInit:
    """A user's optimizer's init that makes no state: its update makes a momentum at the first step."""

    def __call__(self, params: Any) -> dict[str, Any]:
        return {}


class _LazyUpdate:
    @torch.no_grad()
    def __call__(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        old = state.get("momentum", optree.tree_map(torch.zeros_like, grads))
        momentum = optree.tree_map(lambda m, g: 0.9 * m + g, old, grads)
        return optree.tree_map(lambda p, m: p - 0.1 * m, params, momentum), {"momentum": momentum}


def test_a_user_optimizer_that_makes_its_state_at_the_first_update_runs_on() -> None:
    """Its state after the first step is not init's: one update's, predicted on meta tensors, is accepted too,
    for the state the step returned and for a copy of it; a cast copy is refused."""
    lazy = sw.optim.Optimizer(_LazyInit(), _LazyUpdate())
    untouched = _run("one_device", lazy, lambda step, state: state)
    copied = _run("one_device", lazy, lambda step, state: optree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state))
    assert all(torch.equal(x, y) for x, y in zip(untouched[0], copied[0], strict=True))
    with pytest.raises(ValueError, match=r"state\.opt_state\['momentum'\]\['0'\]\['bias'\] is float32 \[8\]"):
        _run("one_device", lazy, _opt_cast(torch.float32))


class _ReadingUpdate(_LazyUpdate):
    """The lazy update, reading a value first (as an update that skips on a non-finite gradient would):
    it cannot run on meta tensors, so its state after an update is not predicted."""

    @torch.no_grad()
    def __call__(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        if not math.isfinite(sum(float(g.sum()) for g in optree.tree_leaves(grads))):
            return params, state
        return super().__call__(grads, state, params)


def test_a_user_optimizer_whose_update_reads_values_runs_on_with_the_state_it_returned() -> None:
    """Refused at the second call before (only init's empty state was known): the state the step returned is
    accepted, and so is a copy of it."""
    reading = sw.optim.Optimizer(_LazyInit(), _ReadingUpdate())
    untouched = _run("one_device", reading, lambda step, state: state)
    copied = _run("one_device", reading, lambda step, state: optree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state))
    assert all(torch.equal(x, y) for x, y in zip(untouched[0], copied[0], strict=True))
    lazy = _run("one_device", sw.optim.Optimizer(_LazyInit(), _LazyUpdate()), lambda step, state: state)
    assert all(torch.equal(x, y) for x, y in zip(untouched[0], lazy[0], strict=True))
    with pytest.raises(ValueError, match=r"state\.opt_state\['momentum'\]\['0'\]\['bias'\] is float32 \[8\]"):
        _run("one_device", reading, _opt_cast(torch.float32))


def _resumed(optimizer: Any, edit: Any = lambda state: state) -> list[torch.Tensor]:
    """One step, the state pickled and (after ``edit``) handed to a fresh Step of the same optimizer, as a
    resumed process does; two steps more there. The final parameters."""
    step, params, batches = _problem(optimizer)
    state, _ = step(step.init(params), batches[0])
    blob = pickle.dumps(state)
    fresh, _, _ = _problem(optimizer)
    state = edit(pickle.loads(blob))._replace(layout=fresh.init(params).layout)
    for batch in batches[1:]:
        state, _ = fresh(state, batch)
    return optree.tree_leaves(state.params)


def test_a_reading_user_optimizers_state_resumed_in_a_fresh_step_trains_as_the_uninterrupted_run() -> None:
    """Refused before (a fresh Step knew only init's empty state): the state its update made is accepted and
    trains exactly as the run that kept its Step; a copy cast to float32 is refused, naming the leaf."""
    reading = sw.optim.Optimizer(_LazyInit(), _ReadingUpdate())
    kept = _run("one_device", reading, lambda step, state: state)[0]
    resumed = _resumed(reading)
    assert all(torch.equal(x, y) for x, y in zip(kept, resumed, strict=True))

    def cast(state: Any) -> Any:
        return state._replace(opt_state=optree.tree_map(lambda t: t.float(), state.opt_state))
    with pytest.raises(ValueError, match=r"state\.opt_state\['momentum'\]\['0'\]\['bias'\] is float32 \[8\] on cpu, "
                                         r"but the update made float64 \[8\] on cpu of it"):
        _resumed(reading, cast)


@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("stack", ["one_device", "zero1"])
def test_a_moment_on_another_device_is_refused_naming_it_not_a_device_error_deep_in_the_update(
        stack: str, optimizer: Any) -> None:
    """Same shape and dtype on the meta device (on a GPU box: the host): refused naming the leaf and both
    devices (was torch's 'Tensor on device cpu is not on the expected device meta!')."""
    def move(step: Any, state: Any) -> Any:
        return state._replace(opt_state=optree.tree_map(
            lambda t: torch.empty_like(t, device="meta") if t.dim() > 0 else t, state.opt_state))
    field = r"(momentum|exp_avg)\['0'\]" + ("" if stack == "zero1" else r"\['bias'\]")
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=rf"state\.opt_state\.{field} is float64 \[\d+\] on meta, but the step keeps it on cpu"):
        _run(stack, optimizer, move)


class _CountingInit:
    """A user's optimizer's state that mixes a tree of moments with a step count in one dict."""

    def __call__(self, params: Any) -> dict[str, Any]:
        return {"momentum": optree.tree_map(torch.zeros_like, params), "count": torch.zeros((), dtype=torch.int64)}


class _CountingUpdate:
    @torch.no_grad()
    def __call__(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        momentum = optree.tree_map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
        new = optree.tree_map(lambda p, m: p - 0.1 * m, params, momentum)
        return new, {"momentum": momentum, "count": state["count"] + 1}


def test_a_dict_state_mixing_trees_and_tensors_is_checked_at_every_call_not_once() -> None:
    """Such a dict had one signature whatever it held (the memo accepted any after the first): cast, refused."""
    counting = sw.optim.Optimizer(_CountingInit(), _CountingUpdate())
    with pytest.raises(ValueError, match=r"state\.opt_state\['momentum'\]\['0'\]\['bias'\] is float32 \[8\]"):
        _run("one_device", counting, _opt_cast(torch.float32))


def test_a_lazy_user_optimizers_checkpoint_loads_into_a_fresh_step_and_trains_as_the_uninterrupted_run(
        tmp_path: Any) -> None:
    """Refused before (load rebuilt init's empty state only: 'per-parameter ['momentum'] and [], this step's
    optimizer has [] and []'): the state one update makes, predicted on meta tensors, is what load rebuilds."""
    lazy = sw.optim.Optimizer(_LazyInit(), _LazyUpdate())
    kept = _run("one_device", lazy, lambda step, state: state)[0]
    step, params, batches = _problem(lazy)
    state, _ = step(step.init(params), batches[0])
    sw.checkpoint.save(tmp_path / "c", state, step)
    fresh, _, _ = _problem(lazy)
    state = sw.checkpoint.load(tmp_path / "c", fresh)
    for batch in batches[1:]:
        state, _ = fresh(state, batch)
    assert all(torch.equal(x, y) for x, y in zip(kept, optree.tree_leaves(state.params), strict=True))
