"""A checkpoint's buffers and frozen (``requires_grad=False``) weights come back on load.

``functionalize`` carries them in the chain, not in the state, so a resume has to restore the
saved values into the chain: the process that resumes rebuilds its model, under another seed or
on the meta device, and would otherwise train on its own values. The reference is the
uninterrupted single-device run in float64, to the equivalence tests' 1e-12.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import CheckpointError

RTOL = 1e-12


class _Shifted(nn.Module):
    """A linear layer whose output is shifted by a persistent buffer and scaled by one the module
    does not persist."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("shift", torch.randn(n))
        self.register_buffer("scale", torch.ones(n), persistent=False)

    def reset_parameters(self) -> None:  # what a meta-built one is made with
        with torch.no_grad():
            self.shift.normal_()
            self.scale.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


def _model(seed: int, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(nn.Embedding(10, 4), _Shifted(4), nn.Linear(4, 3)).double()
    model[0].weight.requires_grad_(False)  # a frozen pretrained embedding: a chain buffer
    return model


def _step(model: nn.Module) -> tuple[Any, Any]:
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def _batches(n: int = 4) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 10, (8,), generator=gen), torch.randn(8, 3, generator=gen, dtype=torch.float64))
            for _ in range(n)]


def _zero3(step: Any) -> Any:
    return sw.shard_params(step, "dp", stage=3)


def _save_after(step: Any, params: Any, mesh: sw.Mesh | None, batches: list, path: Path) -> None:
    state = step.init(params, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    ck.save(path, state, step)


def _resume(step: Any, mesh: sw.Mesh | None, batches: list, path: Path) -> Any:
    return sw.testing.record_history(step, ck.load(path, step, mesh), batches)


@pytest.mark.parametrize("rebuilt", ["another seed", "meta device"])
@pytest.mark.parametrize("layouts", ["single -> single", "dp2-zero3 -> pp2"])
def test_a_rebuilt_model_resumes_with_the_saved_frozen_weight_and_buffers(rebuilt: str, layouts: str,
                                                                          tmp_path: Path) -> None:
    step, params = _step(_model(0))
    batches = _batches()
    expected = sw.testing.record_history(step, step.init(params), batches)
    if layouts == "single -> single":
        save_t, save_mesh, load_t, load_mesh = (lambda s: s), None, (lambda s: s), None
    else:
        save_t, save_mesh = _zero3, sw.Mesh(dp=2)
        load_t, load_mesh = (lambda s: sw.pipeline(s, "pp", "1f1b", 2)), sw.Mesh(pp=2)
    sw.launch(functools.partial(_save_after, save_t(step), params, save_mesh, batches[:2], tmp_path / "c"),
              1 if save_mesh is None else save_mesh.size)
    # The resuming job builds its model again: its frozen embedding and buffer are not the saved ones.
    step2, _ = _step(_model(1, meta=rebuilt == "meta device"))
    resumed = load_t(step2)
    per_rank = sw.launch(functools.partial(_resume, resumed, load_mesh, batches[2:], tmp_path / "c"),
                         1 if load_mesh is None else load_mesh.size)
    sw.testing.compare_histories(per_rank, expected[2:], rtol=RTOL)


def test_the_same_model_resumed_keeps_its_tensors_and_a_non_persistent_buffer_its_value(tmp_path: Path) -> None:
    """Nothing to restore: the chain's tensors stay the module's own (no copy), and a buffer the module
    does not persist is not in the checkpoint, so a load leaves it as the model has it."""
    model = _model(0)
    step, params = _step(model)
    ck.save(tmp_path / "c", step.init(params), step)
    step.base_chain["1"].buffers["scale"].fill_(2.0)  # not saved: the resuming model's value stands
    ck.load(tmp_path / "c", step)
    assert step.base_chain["0"].buffers["weight"].data_ptr() == model[0].weight.data_ptr()
    assert torch.equal(step.base_chain["1"].buffers["scale"], torch.full((4,), 2.0, dtype=torch.float64))


def test_a_buffer_saved_with_another_shape_is_refused_naming_it(tmp_path: Path) -> None:
    step, params = _step(_model(0))
    ck.save(tmp_path / "c", step.init(params), step)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Embedding(10, 4), _Shifted(4), nn.Linear(4, 3)).double()
    other[1].shift = torch.zeros(1, 4, dtype=torch.float64)  # broadcasts as before, saved as [4]
    other[0].weight.requires_grad_(False)
    step2, _ = _step(other)
    with pytest.raises(CheckpointError, match=r"'1.shift' is \[4\] there, \[1, 4\] in the model"):
        ck.load(tmp_path / "c", step2)


def test_a_load_refused_after_its_first_checks_leaves_the_buffers_as_they_were(tmp_path: Path) -> None:
    """Buffers are restored last, once every rank has its state: a load refused on the way (here the
    optimizer that saved it is another) leaves the running model's frozen weights alone. They were
    restored first, so a refused load changed what the running state computes (review)."""
    step, params = _step(_model(0))
    ck.save(tmp_path / "c", step.init(params), step)
    chain, params2 = sw.functionalize(_model(1))  # another embedding, and another optimizer
    adamw = sw.train_step(chain, nn.functional.mse_loss, sw.optim.adamw(0.1))
    state = adamw.init(params2)
    before = {name: t.clone() for layer in chain for name, t in layer.buffers.items()}
    loss = adamw(state, _batches(1)[0])[1]["loss"]
    with pytest.raises(CheckpointError, match="load it with the optimizer that saved it"):
        ck.load(tmp_path / "c", adamw)
    assert all(torch.equal(t, before[name]) for layer in chain for name, t in layer.buffers.items())
    assert torch.equal(adamw(state, _batches(1)[0])[1]["loss"], loss)


@pytest.mark.parametrize("source", ["init_from_pretrained", "init_from_state_dict"])
@pytest.mark.parametrize("mesh", [None, sw.Mesh(dp=2)])
def test_a_meta_built_model_starts_from_the_stored_frozen_weight(source: str, mesh: sw.Mesh | None,
                                                                tmp_path: Path) -> None:
    """Starting from stored weights fills a frozen weight and a buffer (which the chain carries) from
    them too, once on ranks sharing the chain (threads), and trains as the model they were saved from."""
    real = _model(0)
    save_file(real.state_dict(), str(tmp_path / "model.safetensors"))
    step, _ = _step(_model(1, meta=True))
    expected_step, params = _step(_model(0))
    batches = _batches(2)
    expected = sw.testing.record_history(expected_step, expected_step.init(params), batches)
    sharded = step if mesh is None else _zero3(step)

    def run() -> Any:
        if source == "init_from_pretrained":
            state = sw.checkpoint.init_from_pretrained(sharded, tmp_path, mesh)
        else:
            state = sw.checkpoint.init_from_state_dict(sharded, real.state_dict(), mesh)
        return sw.testing.record_history(sharded, state, batches)

    sw.testing.compare_histories(sw.launch(run, 1 if mesh is None else mesh.size), expected, rtol=RTOL)
    full = sw.checkpoint.full_state_dict(step, step.init(params))
    for key in ("0.weight", "1.shift"):
        assert torch.equal(full[key], real.state_dict()[key]), key
