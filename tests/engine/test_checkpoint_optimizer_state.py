"""A user optimizer's tensors that do not mirror the parameters, kept per parameter (as torch.optim
keeps ``state[p]["step"]``), are saved from the pipeline stage that holds them and load on any layout.

Each stage's ranks hold only their parameters' counts; a save that wrote rank 0's alone lost the
others, and the checkpoint then loaded nowhere. The reference is the uninterrupted single-device
run in float64, to the equivalence tests' 1e-12.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.testing.models import mlp

from .test_checkpoint_buffers import _resume, _save_after

RTOL = 1e-12


class _CountedMomentum:
    """Momentum with a bias correction by a per-parameter step count (a 0-d tensor per parameter)."""

    elementwise = True

    def init(self, params: Any) -> Any:
        return {"count": optree.tree_map(lambda p: torch.zeros((), dtype=p.dtype), params),
                "m": optree.tree_map(torch.zeros_like, params)}

    @torch.no_grad()
    def update(self, grads: Any, state: Any, params: Any) -> Any:
        count = optree.tree_map(lambda c: c + 1, state["count"])
        m = optree.tree_map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], grads)
        new = optree.tree_map(lambda p, m, c: p - 0.1 * m / (1 - 0.9**c), params, m, count)
        return new, {"count": count, "m": m}


def _pp(step: Any) -> Any:
    return sw.pipeline(step, "pp", "1f1b", 2)


@pytest.mark.parametrize("reshard", ["pp2 -> pp2", "pp2 -> single", "single -> pp2"])
def test_per_parameter_optimizer_tensors_of_every_stage_are_saved(reshard: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 8, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, _CountedMomentum())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(4)]
    expected = sw.testing.record_history(step, step.init(params), batches)
    saving, loading = reshard.split(" -> ")
    layouts = {"pp2": (_pp(step), sw.Mesh(pp=2), 2), "single": (step, None, 1)}
    save_step, save_mesh, save_world = layouts[saving]
    load_step, load_mesh, load_world = layouts[loading]
    sw.launch(functools.partial(_save_after, save_step, params, save_mesh, batches[:2], tmp_path / "c"), save_world)
    per_rank = sw.launch(functools.partial(_resume, load_step, load_mesh, batches[2:], tmp_path / "c"), load_world)
    sw.testing.compare_histories(per_rank, expected[2:], rtol=RTOL)


def test_per_unit_counts_saved_under_zero3_are_refused_elsewhere_naming_the_layout(tmp_path: Path) -> None:
    """Under shard_params the optimizer updates one flat shard per ZeRO unit, so its per-tensor count is
    per unit (``count.0``), elsewhere per parameter (``count.0.weight``): such state does not reshard
    between the two, and the refusal says so (it said to load with the optimizer that saved it, which
    was this one)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, _CountedMomentum())
    batch = (torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    zero3 = sw.shard_params(step, "dp", stage=3)
    sw.launch(functools.partial(_save_after, zero3, params, sw.Mesh(dp=2), [batch], tmp_path / "c"), 2)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"one per ZeRO unit(.|\n)*under the ZeRO stage"):
        ck.load(tmp_path / "c", step)


def test_a_checkpoint_of_another_optimizer_is_refused_naming_the_way_to_its_weights(tmp_path: Path) -> None:
    """The refusal names init_from_dcp for the weights alone, and that call does start the step from them."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 3)).double())
    sgd = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    trained, _ = sgd(sgd.init(params), batch)
    sw.checkpoint.save(tmp_path / "ck", trained, sgd)
    adamw = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2))
    with pytest.raises(sw.checkpoint.CheckpointError,
                       match=r"load it with the optimizer that saved it, or start this step from its weights alone "
                             r"\(a fresh optimizer state\): sw\.checkpoint\.init_from_dcp\(step, path, mesh, "
                             r"prefix='model\.'\)"):
        sw.checkpoint.load(tmp_path / "ck", adamw)
    started = sw.checkpoint.init_from_dcp(adamw, tmp_path / "ck", None, prefix="model.")
    assert all(torch.equal(started.params[layer][n], trained.params[layer][n]) for layer in trained.params
               for n in trained.params[layer])
