"""save_only_these_names against the names the remat'd layers tag.

A name no checkpoint_name call in the remat'd layers tags saves nothing: the layers ran as plain
checkpointing, without a word (a typo, ``"atn_out"`` for ``"attn_out"``). Once every remat'd layer has
run a forward with gradients, such a name is refused, naming the names the layers do tag. A name tagged
in only some layers is what the policy is for, and runs bitwise as the step without remat.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.transforms.remat import checkpoint_name, offload_to_cpu, remat, save_only_these_names, saved_bytes


class _Tagging(nn.Module):
    """A residual MLP block that tags its hidden value ``name`` (None: tags nothing)."""

    def __init__(self, width: int, name: str | None) -> None:
        super().__init__()
        self.fc1, self.fc2, self.name = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.name is not None:
            h = checkpoint_name(h, self.name)
        return x + self.fc2(h)


def _step(*names: str | None) -> tuple[sw.Step, Any]:
    """Layers '0', '1', ... each tagging its name in ``names`` (None: nothing)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(*(_Tagging(6, n) for n in names)).double())
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
             torch.randn(8, 6, generator=gen, dtype=torch.float64)) for _ in range(n)]


def _run(step: sw.Step, params: Any) -> Any:
    return step(step.init(params), _batches(1)[0])


def test_a_name_no_remat_layer_tags_is_refused_naming_the_names_they_tag() -> None:
    """It was plain checkpointing (the saved bytes of nothing_saveable), silently."""
    step, params = _step("attn_out", None, "mlp_out")
    typo = remat(step, save_only_these_names("atn_out", "mlp_out"))
    refusal = (r"remat\(save_only_these_names\('atn_out', 'mlp_out'\)\): no remat'd layer tags 'atn_out' "
               r"\(layers \['0', '1', '2'\].*plain checkpointing; the names they tag are 'attn_out', 'mlp_out'")
    with pytest.raises(ValueError, match=refusal):
        _run(typo, params)
    with pytest.raises(ValueError, match=refusal):  # and again at the next call
        _run(typo, params)
    with pytest.raises(ValueError, match=r"no remat'd layer tags 'atn_out'"):
        saved_bytes(remat(step, save_only_these_names("atn_out")), params, _batches(1)[0])
    with pytest.raises(ValueError, match=r"remat\(offload_to_cpu\(save_only_these_names\('x'\)\)\).*tags 'x'"):
        _run(remat(step, offload_to_cpu(save_only_these_names("x"))), params)


def test_a_name_tagged_only_outside_the_remat_layers_is_refused() -> None:
    """Only the remat'd layers' tags count: the policy saves nothing in a layer it does not run."""
    step, params = _step("attn_out", None, "mlp_out")
    with pytest.raises(ValueError, match=r"tags 'mlp_out' \(layers \['0', '1'\].*the names they tag are 'attn_out'"):
        _run(remat(step, save_only_these_names("mlp_out"), layers=["0", "1"]), params)
    with pytest.raises(ValueError, match=r"tags 'attn_out' \(layers \['1'\].*no layer tags any name.*checkpoint_name"):
        _run(remat(step, save_only_these_names("attn_out"), layers="1"), params)


def test_names_tagged_in_only_some_layers_run_exactly_and_save_the_tagged_values() -> None:
    step, params = _step("attn_out", None, "mlp_out")
    batch = _batches(1)[0]
    names = remat(step, save_only_these_names("attn_out", "mlp_out"))
    plain = saved_bytes(remat(step), params, batch)
    saved = saved_bytes(names, params, batch)
    tagged = 8 * 12 * 8  # rows x hidden width x float64
    assert saved == {"0": plain["0"] + tagged, "1": plain["1"], "2": plain["2"] + tagged}
    sw.testing.assert_equivalent(sw.shard_params(names, "dp", 3), step, sw.Mesh(dp=2), _batches(), params)
    every_other = remat(step, save_only_these_names("attn_out", "mlp_out"), every=2)  # layers 0 and 2
    sw.testing.assert_equivalent(sw.shard_params(every_other, "dp", 3), step, sw.Mesh(dp=2), _batches(), params)


def test_under_data_parallel_every_rank_stops_with_the_refusal() -> None:
    step, params = _step("attn_out", "attn_out")
    typo = sw.shard_params(remat(step, save_only_these_names("atn_out")), "dp", 3)
    with pytest.raises(sw.collectives.RankFailed, match=r"no remat'd layer tags 'atn_out'"):
        sw.launch(lambda: typo(typo.init(params, sw.Mesh(dp=2)), _batches(1)[0]), world=2)


def test_a_pipeline_over_rank_threads_hears_the_names_of_every_stage() -> None:
    """Each stage's rank runs its own layers: a name tagged only on the last stage's is no typo."""
    step, params = _step(None, None, "mlp_out", "mlp_out")
    names = remat(step, save_only_these_names("mlp_out"))
    sw.testing.assert_equivalent(sw.pipeline(names, "pp", "1f1b", 2), step, sw.Mesh(pp=2), _batches(), params)
    typo = sw.pipeline(remat(step, save_only_these_names("mlp_uot")), "pp", "1f1b", 2)
    with pytest.raises(sw.collectives.RankFailed, match=r"no remat'd layer tags 'mlp_uot'"):
        sw.launch(lambda: typo(typo.init(params, sw.Mesh(pp=2)), _batches(1)[0]), world=2)
