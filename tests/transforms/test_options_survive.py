"""Every option of every transform survives every accepted order, and reaches the Plan.

For a drawn order of the four transforms with drawn options: the lowered Plan is the
same in every order, and changing any one option changes it (so no option is dropped
on the way: each is reflected in the actions, what they move, or the layer notes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing.models import mlp

MESH = sw.Mesh(dp=2, pp=2)


def _problem() -> tuple[sw.Step, dict, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 8, 8, 8, 3]))  # 4 units: 2 per pipeline rank
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    return step, params, (torch.randn(8, 6), torch.randn(8, 3))


def _transforms(options: dict[str, Any]) -> dict[str, Callable[[sw.Step], sw.Step]]:
    return {
        "shard_params": lambda s: sw.shard_params(
            s, "dp", options["stage"], **({"reshard_after_forward": options["reshard"], "prefetch": options["prefetch"]}
                                          if options["stage"] == 3 else {"overlap_gather": options["overlap"]})
        ),
        "pipeline": lambda s: sw.pipeline(
            s, "pp", options["schedule"], options["microbatches"],
            stages=4 if options["schedule"] == "interleaved_1f1b" else 2,
        ),
        "remat": lambda s: sw.remat(s, options["policy"], layers=options["layers"]),
        "mixed_precision": lambda s: sw.mixed_precision(s, options["precision"]),
    }


def _build(step: sw.Step, order: tuple[str, ...], options: dict[str, Any]) -> sw.Step:
    transforms = _transforms(options)
    for name in order:
        step = transforms[name](step)
    return step


OPTIONS = st.fixed_dictionaries({
    "stage": st.sampled_from([1, 2, 3]),
    "reshard": st.sampled_from([None, True, False]),
    "prefetch": st.integers(0, 2),
    "schedule": st.sampled_from(["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"]),
    "microbatches": st.sampled_from([2, 4]),
    "policy": st.sampled_from(["nothing_saveable", "dots_saveable"]),
    "layers": st.sampled_from(["all", "1", ["0", "2"]]),
    "precision": st.sampled_from(["params=f32,compute=bf16,output=f32", "params=f32,compute=f32", "compute=f16"]),
    "overlap": st.sampled_from([None, False]),
})

# What each option may be changed to; a change must change the Plan.
ALTERNATIVES: dict[str, Callable[[Any, dict[str, Any]], list[Any]]] = {
    "stage": lambda v, o: [s for s in (1, 2, 3) if s != v],
    "reshard": lambda v, o: [] if o["stage"] != 3 else [r for r in (True, False) if r != (False if v is None else v)],
    # Prefetch can only act where a rank's computes need different units: with two stages a rank.
    "prefetch": lambda v, o: [0 if v else 1] if o["stage"] == 3 and o["schedule"] == "interleaved_1f1b" else [],
    "schedule": lambda v, o: [s for s in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b") if s != v],
    "microbatches": lambda v, o: [6 - v],
    "policy": lambda v, o: ["everything_saveable"],
    "layers": lambda v, o: ["3"],
    "precision": lambda v, o: ["params=f32,compute=bf16,output=bf16,reduce=bf16"],
    # Stages 1-2: where the updated shards' all-gathers are waited for (the next forward, or the step's end).
    # None and False wait at the end on a CPU. A precision that narrows (bf16, f16 from f32) holds shards at
    # rest at stages 1-2 too, and gathers no updated parameters (overlap_gather=True is refused there).
    "overlap": lambda v, o: [] if o["stage"] == 3 or "compute=f32" not in o["precision"] else [True],
}


def _fingerprint(plan: sw.plan.Plan) -> tuple[Any, ...]:
    return plan.actions, tuple(sorted(plan.memory.items())), tuple(plan.layers.items())


@given(options=OPTIONS, order=st.permutations(["shard_params", "pipeline", "remat", "mixed_precision"]))
def test_the_plan_is_the_same_in_every_order_and_reflects_every_option(
    options: dict[str, Any], order: list[str]
) -> None:
    step, params, batch = _problem()
    canonical = ("shard_params", "pipeline", "remat", "mixed_precision")
    plan = _build(step, tuple(order), options).plan(MESH, params, batch)
    assert _fingerprint(plan) == _fingerprint(_build(step, canonical, options).plan(MESH, params, batch))
    # Without the batch (cheaper): the actions, what the collectives move and the layer notes.
    plan = _build(step, tuple(order), options).plan(MESH, params)
    for name, alternatives in ALTERNATIVES.items():
        for value in alternatives(options[name], options):
            changed = _build(step, tuple(order), {**options, name: value}).plan(MESH, params)
            assert _fingerprint(changed) != _fingerprint(plan), (
                f"{name}={value!r} instead of {options[name]!r} left the Plan unchanged"
            )
    if options["schedule"] != "interleaved_1f1b":  # one stage a rank: every compute needs the same units
        other = _build(step, tuple(order), {**options, "prefetch": 2 - options["prefetch"]}).plan(MESH, params)
        assert _fingerprint(other) == _fingerprint(plan)


def test_precision_and_remat_show_in_what_the_plan_moves_and_says() -> None:
    step, params, batch = _problem()
    options = {"stage": 3, "reshard": None, "prefetch": 1, "schedule": "1f1b", "microbatches": 2,
               "policy": "dots_saveable", "layers": ["0", "2"], "precision": "params=f32,compute=bf16,reduce=f32"}
    plan = _build(step, ("mixed_precision", "pipeline", "remat", "shard_params"), options).plan(MESH, params, batch)
    actions = [a for rank in plan.actions for a in rank]
    assert {w.dtype for a in actions if a.kind == "gather" for w in a.wire} == {"bfloat16"}
    assert {w.dtype for a in actions if a.kind == "reduce_scatter" for w in a.wire} == {"float32"}
    assert {w.dtype for a in actions if a.kind in ("send_activation", "send_grad") for w in a.wire} == {"bfloat16"}
    assert [layer for layer, notes in plan.layers.items() if "remat dots_saveable" in notes] == ["0", "2"]
    assert all("compute=bf16" in notes[-1] for notes in plan.layers.values())


def test_zero_under_a_pipeline_keeps_units_by_default_and_reshards_when_asked() -> None:
    """torchtitan's rule: under PP, ZeRO-3 gathers a stage's units once and keeps them; an explicit
    reshard_after_forward=True frees them after every forward and gathers them again for backward."""
    step, params, batch = _problem()
    piped = sw.pipeline(step, "pp", "1f1b", 4)
    default = sw.shard_params(piped, "dp", 3).plan(MESH, params, batch)
    resharded = sw.shard_params(piped, "dp", 3, reshard_after_forward=True).plan(MESH, params, batch)
    units_per_rank = 2
    assert default.count("gather", rank=0) == units_per_rank
    # Rank 0 runs F0 F1 | B0 F2 | B1 F3 | B2 B3: every forward followed by a backward frees the
    # units, so they are gathered for F0 and again for B0, B1 and B2 (B3 follows B2, which kept them).
    assert resharded.count("gather", rank=0) == units_per_rank * 4
    assert resharded.count("free", rank=0) == units_per_rank * 4
    assert resharded.memory["gathered_peak"] == default.memory["gathered_peak"]


def test_a_transform_applied_twice_is_refused_even_with_another_between() -> None:
    step, params, batch = _problem()
    with pytest.raises(ValueError, match="remat was applied twice"):
        sw.remat(sw.mixed_precision(sw.remat(step), "compute=bf16"))
    with pytest.raises(ValueError, match="mixed_precision was applied twice"):
        sw.mixed_precision(sw.remat(sw.mixed_precision(step, "compute=bf16")), "compute=bf16")
    for option in ({"reshard_after_forward": False}, {"prefetch": 2}, {"prefetch": 0}):
        with pytest.raises(ValueError, match=r"holds whole parameters here.*nothing to keep or prefetch"):
            sw.shard_params(step, "dp", 2, **option).plan(sw.Mesh(dp=2), params, batch)
