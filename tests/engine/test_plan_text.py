"""A Plan's text: lines wrap between actions, never inside one; ranks with the same actions print once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardwise as sw
from shardwise.engine.plan.text import WIDTH, group_head, per_rank_figures, rank_list, wrap
from shardwise.testing.models import mlp


def _step() -> tuple[sw.Step, dict]:
    chain, params = sw.functionalize(mlp([3, 4, 2]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


def _pipelined_plan(dp: int) -> sw.plan.Plan:
    step, params = _step()
    composed = sw.pipeline(sw.shard_params(step, "dp", stage=3), "pp", "1f1b", microbatches=2)
    return composed.plan(sw.Mesh(dp=dp, pp=2), params, (torch.randn(8 * dp, 3), torch.randn(8 * dp, 2)))


def test_no_line_cuts_an_action() -> None:
    """Actions hold spaces of their own (``send_activation(stage0, mb=1, to=1)``): each is on one line."""
    plan = _pipelined_plan(dp=2)
    lines = str(plan).splitlines()
    bodies = [line[2:] for line in lines if line.startswith("  ")]
    for rank in (0, 1):
        texts = [str(a) for a in plan.for_rank(rank)]
        assert any(" " in t for t in texts)  # or the check below could not fail
        assert any(
            " ".join(texts) == " ".join(bodies[i:j]) for i in range(len(bodies)) for j in range(i, len(bodies) + 1)
        )
        assert all(any(t in body for body in bodies) for t in texts)
    assert all(len(line) <= WIDTH for line in lines if line.startswith("  "))


def test_wrap_keeps_every_token_whole_even_one_longer_than_a_line() -> None:
    tokens = ["a" * 10, "b(x, y)", "c" * 30, "d"]
    assert wrap(tokens, width=20) == ["  " + "a" * 10 + " b(x, y)", "  " + "c" * 30, "  d"]
    assert wrap([], width=20) == []


def test_ranks_with_the_same_actions_print_once_with_the_coordinates_they_share() -> None:
    text = str(_pipelined_plan(dp=2))
    assert "Plan on Mesh(dp=2, pp=2): 4 ranks\nranks 0, 2 (pp=0): 21 actions\n" in text
    assert "\nranks 1, 3 (pp=1): " in text
    assert "rank 2" not in text and "rank 3" not in text
    step, params = _step()
    one_group = str(step.plan(sw.Mesh(dp=4), params))
    assert one_group.splitlines()[1] == "ranks 0-3: 9 actions"


def test_a_rank_that_differs_in_a_few_actions_prints_as_another_but_those() -> None:
    plan = _pipelined_plan(dp=2)
    changed = list(plan.for_rank(2))
    changed[0] = dataclasses.replace(changed[0], layer="other")
    other = dataclasses.replace(plan, actions=(plan.actions[0], plan.actions[1], tuple(changed), plan.actions[3]))
    text = str(other)
    assert f"rank 2 (dp=1, pp=0): same as rank 0 but action 0 is {changed[0]} (not {plan.for_rank(0)[0]})" in text
    assert "ranks 0, 2" not in text and "rank 0 (dp=0, pp=0): 21 actions" in text


def test_rank_lists_fold_runs_and_strides() -> None:
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([0, 1, 2, 3]) == "ranks 0-3"
    assert rank_list([0, 2, 4, 6]) == "ranks 0, 2, ..., 6"
    assert rank_list([0, 1, 2, 5, 8, 9, 10]) == "ranks 0-2, 5, 8-10"


def test_a_long_group_is_named_by_its_coordinates() -> None:
    mesh = sw.Mesh(dp=16, pp=2, tp=2)
    ranks = [r for r in range(mesh.size) if mesh.coords_of(r)["pp"] == 0]
    assert group_head(mesh, ranks) == "the 32 ranks with pp=0"
    assert group_head(mesh, [0, 1]) == "ranks 0, 1 (dp=0, pp=0)"


def test_figures_per_rank_fold_when_alike() -> None:
    assert per_rank_figures((448, 448, 448)) == "448 on each of 3 ranks"
    assert per_rank_figures((448, 976)) == "[448, 976]"
    assert per_rank_figures((1,) * 8 + (2,) * 8) == "1 (ranks 0-7), 2 (ranks 8-15)"
    assert per_rank_figures((104,)) == "[104]"


def test_a_rank_a_kind_or_a_mesh_the_plan_does_not_have_is_refused_naming_it() -> None:
    """``for_rank(5)`` of a two-rank Plan raised a bare IndexError, ``for_rank(-1)`` gave the last rank's actions,
    ``count('nonsense')`` counted 0, and ``step.plan('pp=2', ...)`` failed with an AttributeError."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 16, 3]))
    step = sw.pipeline(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "1f1b", 2)
    batch = (torch.randn(8, 6), torch.randn(8, 3))
    plan = step.plan(sw.Mesh(pp=2), params, batch)
    for call in (lambda: plan.for_rank(5), lambda: plan.for_rank(-1), lambda: plan.count("gather", rank=9),
                 lambda: list(plan.collectives(7))):
        with pytest.raises(ValueError, match=r"rank=-?\d: an int, one of the ranks 0 to 1 of the Plan's mesh "
                                             r"Mesh\(pp=2\)"):
            call()
    with pytest.raises(ValueError, match=r"rank=1.0: an int"):
        plan.for_rank(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Plan.count\('nonsense'\): not an action kind; one of \['backward'"):
        plan.count("nonsense")
    assert plan.count("forward") == plan.count("forward", rank=0) + plan.count("forward", rank=1) == 4
    with pytest.raises(TypeError, match=r"mesh='pp=2': a sw.Mesh, e.g. sw.Mesh\(dp=2, pp=2\)"):
        step.plan("pp=2", params, batch)  # type: ignore[arg-type]
