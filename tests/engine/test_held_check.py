"""A step refuses a TrainState whose parameters are not laid out as its init laid them out (a cast
state, a replaced tensor, full parameters put back into a ZeRO-3 state), naming the tensor; values
changed in place are the user's to change and train on."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp

POLICY = "params=f64,compute=f32,output=f64"


def _problem(optimizer: Any = None, steps: int = 2) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A float64 MLP's step (AdamW unless ``optimizer``), its parameters and ``steps`` batches."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 8, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, optimizer or sw.optim.adamw(1e-2))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(steps)]
    return step, params, batches


STACKS = {
    "one_device": (lambda step: step, None),
    "zero1": (lambda step: sw.shard_params(step, "dp", stage=1), {"dp": 2}),
    "zero3": (lambda step: sw.shard_params(step, "dp", stage=3), {"dp": 2}),
    "pipeline": (lambda step: sw.pipeline(step, "pp", "1f1b", 2), {"pp": 2}),
}


def _edited(stack: str, edit: Any, policy: str | None = None) -> list[float]:
    """Step once, apply ``edit(step, state)``, step again; the second step's loss on every rank."""
    base, params, batches = _problem()
    wrap, mesh_axes = STACKS[stack]
    step = wrap(base) if policy is None else sw.mixed_precision(wrap(base), policy)

    def main() -> float:
        mesh = None if mesh_axes is None else sw.Mesh(**mesh_axes)
        state, _ = step(step.init(params, mesh), batches[0])
        state, metrics = step(edit(step, state), batches[1])
        return float(metrics["loss"])

    return [main()] if mesh_axes is None else sw.launch(main, world=2)


def _to_f32(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_state_cast_to_the_compute_dtype_is_refused_not_trained_at_that_precision(stack: str) -> None:
    """Under mixed_precision the layers cast what they are given to the compute dtype, so a state cast
    to it (to save memory) ran on with float32 master weights and moments, silently."""
    with pytest.raises((ValueError, sw.collectives.RankFailed), match=r"state\.params\['\d'\].* is float32 .*float64"):
        _edited(stack, lambda step, state: optree.tree_map(_to_f32, state), POLICY)


def test_a_parameter_replaced_by_one_that_broadcasts_is_refused() -> None:
    """A bias of shape [1] broadcast in the forward and in the update: another model, no error."""
    def edit(step: Any, state: Any) -> Any:
        params = {k: dict(v) for k, v in state.params.items()}
        params["0"]["bias"] = params["0"]["bias"][:1].clone()
        return state._replace(params=params)

    with pytest.raises(ValueError, match=r"state\.params\['0'\]\['bias'\] is float64 \[1\], but the step keeps it "
                                         r"as float64 \[8\]"):
        _edited("one_device", edit)


def test_full_parameters_put_back_into_a_zero3_state_are_refused_naming_the_layers() -> None:
    with pytest.raises(sw.collectives.RankFailed, match=r"state\.params holds \['0', '1', '2', '3', '4'\], but this "
                                                        r"rank's state holds the layers \['0', '2', '4'\]"):
        _edited("zero3", lambda step, state: state._replace(params=step.full_params(state)))


@pytest.mark.parametrize("stack", ["one_device", "zero3"])
def test_values_changed_in_place_are_trained_on(stack: str) -> None:
    """The layout is checked, not the values: an in-place edit of every rank's tensors is the user's."""
    def zero_first_layer(step: Any, state: Any) -> Any:
        first = state.params["0"]
        for t in first.values() if isinstance(first, dict) else [first]:
            t.zero_()
        return state

    edited, untouched = _edited(stack, zero_first_layer), _edited(stack, lambda step, state: state)
    assert len(set(edited)) == 1 and edited[0] != untouched[0], (edited, untouched)


@pytest.mark.parametrize("call", ["save", "full_params", "full_state_dict"])
def test_a_cast_state_is_refused_by_save_and_by_the_full_parameters(call: str, tmp_path: Any) -> None:
    """save wrote a float32-cast state of a float64-master step, and load cast it back to float64: the
    rounding went unnoticed; full_params handed the cast values on. ZeRO-3's full parameters put back
    into its state failed on a raw error (unhashable type: 'slice')."""
    base, params, batches = _problem()
    step = sw.mixed_precision(sw.shard_params(base, "dp", stage=3), POLICY)

    def main(edit: Any) -> None:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
        state = edit(state)
        if call == "save":
            sw.checkpoint.save(tmp_path / "c", state, step)
        elif call == "full_params":
            step.full_params(state)
        else:
            sw.checkpoint.full_state_dict(step, state)

    with pytest.raises(sw.collectives.RankFailed, match=r"state\.params\['0'\] is float32 \[28\], but the step "
                                                        r"keeps it as float64 \[28\]"):
        sw.launch(lambda: main(lambda state: optree.tree_map(_to_f32, state)), world=2)
    with pytest.raises(sw.collectives.RankFailed, match=r"state\.params holds \['0', '1', '2', '3', '4'\]"):
        sw.launch(lambda: main(lambda state: state._replace(params=step.full_params(state))), world=2)
    assert not (tmp_path / "c").exists()


def _moved_to_meta(step: Any, state: Any) -> Any:
    """Layer 0's bias (its ZeRO-3 flat shard) replaced by a meta tensor of its shape and dtype (where a rank
    holds it)."""
    params = {k: dict(v) if isinstance(v, dict) else v for k, v in state.params.items()}
    if isinstance(params.get("0"), dict):
        params["0"]["bias"] = torch.empty_like(params["0"]["bias"], device="meta")
    elif "0" in params:
        params["0"] = torch.empty_like(params["0"], device="meta")
    return state._replace(params=params)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_parameter_moved_to_another_device_between_steps_is_refused_naming_both_devices(stack: str) -> None:
    """Same shape and dtype on the meta device (on a GPU box: the host). Before: 'Tensor on device meta is not
    on the expected device cpu!' from deep in the step, or, under ZeRO-3, 'cannot convert dictionary update
    sequence element #0 to a sequence'. The pipeline's rank 0 holds two parameters of layer 0: a tie, which
    the device the step accepted them on last breaks."""
    where = r"\['0'\]" if stack == "zero3" else r"\['0'\]\['bias'\]"
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=rf"state\.params{where} is float64 \[\d+\] on meta, but the step keeps it on cpu, where "
                             r"this rank's other parameters are"):
        _edited(stack, _moved_to_meta)
