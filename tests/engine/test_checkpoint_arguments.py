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


def test_a_step_on_a_mesh_loaded_without_one_is_refused_naming_the_mesh_argument(
        made: tuple[Any, Any], tmp_path: Path) -> None:
    """Before: "shard_params(axis='dp') needs the mesh: call step.init(params, mesh)", from inside the layout."""
    step, state = made
    sw.checkpoint.save(tmp_path / "ck", state, step)
    zero3 = sw.shard_params(step, "dp", stage=3)
    with pytest.raises(ValueError, match=r"load\(path, step, mesh\): this step \(shard_params\(axis='dp'.*\) runs on a "
                                         r"mesh of axes \['dp'\], and no mesh was given.*load\(path, step, sw\.Mesh"):
        sw.checkpoint.load(tmp_path / "ck", zero3)
    assert sw.checkpoint.load(tmp_path / "ck", zero3, sw.Mesh(dp=1)).step == 0


def test_a_save_into_an_empty_directory_made_for_it_needs_no_overwrite(made: tuple[Any, Any], tmp_path: Path) -> None:
    """path = tempfile.mkdtemp(): nothing there to lose (before: "exists; pass overwrite=True"). A directory holding
    a checkpoint still needs overwrite=True."""
    step, state = made
    (tmp_path / "made").mkdir()
    sw.checkpoint.save(tmp_path / "made", state, step)
    assert sw.checkpoint.load(tmp_path / "made", step).step == 0
    with pytest.raises(sw.checkpoint.CheckpointError, match="exists; pass overwrite=True to replace it"):
        sw.checkpoint.save(tmp_path / "made", state, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made"]  # no .previous nor .partial left


def test_a_tied_models_checkpoint_loaded_untied_says_they_were_tied(tmp_path: Path) -> None:
    """Before: "this step's model has parameters ['head.weight'] that it lacks", though the checkpoint holds it as
    the tie it was; now the refusal says so, and the way it names (init_from_dcp) loads the untied model."""
    from shardwise.testing.models import TinyGPT

    def built(tie: bool) -> tuple[sw.Step, Any]:
        torch.manual_seed(0)
        model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8, tie_weights=tie).double()
        chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
        loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
        return sw.train_step(chain, loss, sw.optim.sgd(0.1)), params

    tied, params = built(True)
    sw.checkpoint.save(tmp_path / "ck", tied.init(params), tied)
    untied, _ = built(False)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"its model tied them: \['head\.weight \(saved as a tie of "
                                                            r"tok_emb\.weight\)'\].*init_from_dcp"):
        sw.checkpoint.load(tmp_path / "ck", untied)
    state = sw.checkpoint.init_from_dcp(untied, tmp_path / "ck", None, prefix="model.")
    assert torch.equal(state.params["head"]["head.weight"], state.params["tok_emb"]["tok_emb.weight"])
