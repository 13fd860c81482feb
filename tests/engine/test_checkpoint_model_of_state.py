"""A state written with the step of another model is refused: a checkpoint takes the buffers and frozen
parameters from the step and the trained ones from the state, so ``save(path, state_of_A, step_of_B)``
used to write A's trained weights beside B's frozen ones, and the checkpoint loaded without complaint.
The same model functionalized again, a copy of it, a model with nothing frozen, a pickled state: accepted."""

from __future__ import annotations

import copy
import functools
import io
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw

BATCH = (torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
         torch.randn(8, 4, generator=torch.Generator().manual_seed(2)))


def _module(seed: int, frozen: float | None = 1.0, norm: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)]
    if norm:  # in eval mode: it normalises with its running statistics, buffers a checkpoint carries
        layers.insert(1, torch.nn.BatchNorm1d(4).eval())
    m = torch.nn.Sequential(*layers)
    if frozen is not None:
        m[0].bias.requires_grad_(False)
        m[0].bias.data.fill_(frozen)
    return m


def _step(module: torch.nn.Module) -> tuple[Any, Any]:
    chain, params = sw.functionalize(module)
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def _trained(step: Any, params: Any) -> Any:
    state, _ = step(step.init(params), BATCH)
    return state


REFUSED = (r"made for another model than this step's \(by the step that made it, or last stepped it\): buffer or "
           r"frozen parameter '0\.bias' differs \(4 of its 4")


def test_a_state_saved_with_another_models_step_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """Before: accepted, and a load gave A's trained weights with B's frozen bias (-5.0 where A's is 1.0)."""
    step_a, params_a = _step(_module(0, frozen=1.0))
    step_b, _ = _step(_module(1, frozen=-5.0))
    state_a = _trained(step_a, params_a)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REFUSED + r".*pass the step that made the state"):
        sw.checkpoint.save(tmp_path / "ck", state_a, step_b)
    assert not (tmp_path / "ck").exists()
    with pytest.raises(ValueError, match=r"full_state_dict: this TrainState was " + REFUSED[:10]):
        sw.checkpoint.full_state_dict(step_b, state_a)
    with pytest.raises(ValueError, match=r"save_pretrained: this TrainState was " + REFUSED[:10]):
        sw.checkpoint.save_pretrained(step_b, state_a, tmp_path / "export")
    # With its own step it saves, and loads into a third model with A's frozen bias and A's weights.
    sw.checkpoint.save(tmp_path / "ck", state_a, step_a)
    module_c = _module(2, frozen=0.0)
    step_c, _ = _step(module_c)
    loaded = sw.checkpoint.load(tmp_path / "ck", step_c)
    assert module_c[0].bias.tolist() == [1.0] * 4
    for layer, tensors in state_a.params.items():
        for name, t in tensors.items():
            assert torch.equal(loaded.params[layer][name], t)
    # The loaded state is the third model's now: it saves with step_c, and not with step_b.
    sw.checkpoint.save(tmp_path / "again", loaded, step_c)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REFUSED.replace("4 of its 4", "4 of its 4")):
        sw.checkpoint.save(tmp_path / "b", loaded, step_b)


def test_running_buffers_of_another_model_are_refused(tmp_path: Path) -> None:
    """Two BatchNorm models: B's running statistics beside A's weights would be another model's too."""
    step_a, params_a = _step(_module(0, frozen=None, norm=True))
    module_b = _module(1, frozen=None, norm=True)
    module_b[1].running_mean.fill_(0.5)  # as B's own data left them (A's are BatchNorm's first ones)
    step_b, _ = _step(module_b)
    state_a = _trained(step_a, params_a)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"buffer or frozen parameter '1\.running_mean' differs"):
        sw.checkpoint.save(tmp_path / "ck", state_a, step_b)


def test_the_same_model_functionalized_again_or_copied_is_accepted(tmp_path: Path) -> None:
    module = _module(0, frozen=1.0, norm=True)
    step, params = _step(module)
    state = _trained(step, params)
    again, _ = _step(module)  # the module's own tensors: the same values
    copied, _ = _step(copy.deepcopy(module))  # other tensors holding equal values
    sharded = sw.shard_params(step, "dp", stage=3)  # a transform of the step: its chain
    for i, other in enumerate((again, copied)):
        sw.checkpoint.save(tmp_path / f"ck{i}", state, other)
        assert sw.checkpoint.full_state_dict(other, state)["0.bias"].tolist() == [1.0] * 4
    z3_state = sharded.init(params, sw.Mesh(dp=1))
    sw.checkpoint.save(tmp_path / "z3", z3_state, sharded)


def test_models_with_nothing_frozen_share_no_tensor_to_mix(tmp_path: Path) -> None:
    """Without buffers or frozen parameters a checkpoint is the state's alone, whichever step writes it."""
    step_a, params_a = _step(_module(0, frozen=None))
    step_b, _ = _step(_module(1, frozen=None))
    state_a = _trained(step_a, params_a)
    sw.checkpoint.save(tmp_path / "ck", state_a, step_b)
    loaded = sw.checkpoint.load(tmp_path / "ck", step_b)
    assert torch.equal(loaded.params["0"]["weight"], state_a.params["0"]["weight"])


def test_a_pickled_state_names_no_model_and_is_not_checked(tmp_path: Path) -> None:
    """``torch.save`` of a TrainState keeps working (the tag travels empty: a weak reference does not
    pickle), and a layout copied in memory keeps naming its model."""
    step_a, params_a = _step(_module(0, frozen=1.0))
    step_b, _ = _step(_module(1, frozen=-5.0))
    state_a = _trained(step_a, params_a)
    buffer = io.BytesIO()
    torch.save(state_a, buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    assert unpickled.layout == state_a.layout and unpickled.layout.model.chain is None
    sw.checkpoint.save(tmp_path / "ck", unpickled, step_a)
    copied = state_a._replace(layout=copy.deepcopy(state_a.layout))
    with pytest.raises(sw.checkpoint.CheckpointError, match=REFUSED):
        sw.checkpoint.save(tmp_path / "b", copied, step_b)


def _save_on_ranks(step_of_state: Any, step_to_save: Any, params: Any, path: Path) -> str:
    state = step_of_state.init(params, sw.Mesh(dp=2))
    try:
        sw.checkpoint.save(path, state, step_to_save)
    except sw.checkpoint.CheckpointError as err:
        return str(err)
    return "saved"


def test_every_rank_refuses_alike_under_zero3(tmp_path: Path) -> None:
    """The refusal is agreed before any file is made: each rank raises it, none waits on another."""
    step_a, params_a = _step(_module(0, frozen=1.0))
    step_b, _ = _step(_module(1, frozen=-5.0))
    zero_a, zero_b = sw.shard_params(step_a, "dp", stage=3), sw.shard_params(step_b, "dp", stage=3)
    outcomes = sw.launch(functools.partial(_save_on_ranks, zero_a, zero_b, params_a, tmp_path / "ck"), 2)
    assert len(outcomes) == 2 and all("made for another model" in o for o in outcomes), outcomes
    assert not (tmp_path / "ck").exists()
    assert sw.launch(functools.partial(_save_on_ranks, zero_a, zero_a, params_a, tmp_path / "ok"), 2) == ["saved"] * 2


def test_a_state_stepped_by_another_models_step_is_that_models() -> None:
    """The review: a state made by A's init and stepped by B (which accepts a state of its shapes) was saved with A,
    writing A's frozen bias beside weights trained against B's, and refused with B. The step that last stepped it
    names the model now."""
    step_a, params_a = _step(_module(0, frozen=1.0))
    step_b, _ = _step(_module(1, frozen=-5.0))
    state = step_a.init(params_a)
    for _ in range(2):
        state, _ = step_b(state, BATCH)
    assert sw.checkpoint.full_state_dict(step_b, state)["0.bias"].tolist() == [-5.0] * 4
    with pytest.raises(ValueError, match=REFUSED):
        sw.checkpoint.full_state_dict(step_a, state)


def test_a_nan_in_a_buffer_is_the_same_nan_in_the_same_module_functionalized_again(tmp_path: Path) -> None:
    """The review: a persistent buffer holding NaN (a running statistic not yet seen) made a copy of the model, or
    the same module functionalized again, count as another model (NaN != NaN)."""
    module = _module(0, frozen=1.0)
    module.register_buffer("seen", torch.tensor([float("nan"), 1.0]))
    step, params = _step(module)
    state = _trained(step, params)
    for i, other in enumerate((_step(module)[0], _step(copy.deepcopy(module))[0])):
        sw.checkpoint.save(tmp_path / f"ck{i}", state, other)


def test_a_meta_built_model_split_twice_names_the_step_whose_frozen_parameters_were_never_filled(
    tmp_path: Path,
) -> None:
    # Its second split's frozen parameters are stand-ins (a zero, expanded) until an init or load of that step
    # fills them: the state was made by the first; the refusal said "another model" and named differing values.
    stored = {k: v.clone() for k, v in _module(0).state_dict().items()}
    with torch.device("meta"):
        meta = _module(0, frozen=None)
    meta[0].bias.requires_grad_(False)
    first, _ = _step(meta)
    second, _ = _step(meta)
    state = sw.checkpoint.init_from_state_dict(first, stored)
    state, _ = first(state, BATCH)
    expected = r"this step's frozen \(requires_grad=False\) parameter '0\.bias' holds no values: .*meta device"
    with pytest.raises(sw.checkpoint.CheckpointError, match=expected):
        sw.checkpoint.save(tmp_path / "ckpt", state, second)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="full_state_dict: " + expected):
        sw.checkpoint.full_state_dict(second, state)
    sw.checkpoint.save(tmp_path / "ckpt", state, first)  # the step that made it
