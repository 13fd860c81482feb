"""expert_parallel with a capacity factor: a step that would drop an assignment is refused unless told.

Each rank drops the assignments over an expert's capacity among its own tokens, so what drops depends
on how the mesh cuts the batch (ep=2 and ep=4 drop different tokens), and the single-device step (the
modules' own forwards) drops none. A drop would train another model than the single-device step's,
without an error: refused, naming ``drop_per_rank=True``. float64 on thread ranks; a capacity that
drops nothing on the batches is the single-device step to rounding (assert_equivalent's default).
"""

from __future__ import annotations

from typing import Any

import pytest

import shardwise as sw
from shardwise.collectives.launch import RankFailed

from .test_ep_router_aux import _mixtral
from .test_ep_step import batches, moe_model

STACKS = {
    "ep=2": (lambda s: s, sw.Mesh(ep=2)),
    "dp=2 x ep=2, ZeRO-3": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2, ep=2)),
    "pp=2 x ep=2, 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2, ep=2)),
}


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, data: list[Any]) -> list[Any]:
    def main() -> Any:
        state = step.init(params, mesh)
        for batch in data:
            state, _ = step(state, batch)
        return step.full_params(state)

    return sw.launch(main, mesh.size, timeout=120)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_capacity_that_drops_is_refused_naming_drop_per_rank(stack: str) -> None:
    step, params = moe_model()
    transform, mesh = STACKS[stack]
    ep = transform(sw.expert_parallel(step, "ep", capacity_factor=1.0))
    with pytest.raises(RankFailed, match=r"expert_parallel\(capacity_factor=1.0\): 1.moe would drop \d+ token "
                                         r"assignments(.|\n)*drop_per_rank=True"):
        _run(ep, mesh, params, batches())


def test_drop_per_rank_trains_on_and_its_drop_depends_on_the_mesh() -> None:
    """Why it is refused by default: the opted-in step is not the single-device step, and ep=2 and ep=4
    (each rank dropping over its own tokens) train different models."""
    step, params = moe_model()
    ep = sw.expert_parallel(step, "ep", capacity_factor=1.0, drop_per_rank=True)
    assert "drop_per_rank=True" in str(ep.split.parts[0])
    with pytest.raises(AssertionError, match="first divergence"):
        sw.testing.assert_equivalent(ep, step, sw.Mesh(ep=2), batches(), params)
    two, four = (_run(ep, sw.Mesh(ep=n), params, batches())[0] for n in (2, 4))
    w2, w4 = two["1"]["moe.gate.weight"], four["1"]["moe.gate.weight"]
    assert (w2 - w4).abs().max() > 1e-6  # far above float64 rounding


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_capacity_that_drops_nothing_needs_no_opt_in(stack: str) -> None:
    # ceil(4.0 * tokens * top_k / 4) >= every expert's assignments on a rank: nothing would drop.
    step, params = moe_model()
    transform, mesh = STACKS[stack]
    ep = transform(sw.expert_parallel(step, "ep", capacity_factor=4.0))
    sw.testing.assert_equivalent(ep, step, mesh, batches(), params)


def test_hf_mixtral_with_a_dropping_capacity_is_refused_and_runs_when_told() -> None:
    _, step, params, data = _mixtral()
    data = data[:1]
    mesh = sw.Mesh(ep=2)
    with pytest.raises(RankFailed, match=r"model\.layers\.\d\.mlp would drop \d+ token assignments"):
        _run(sw.expert_parallel(step, "ep", capacity_factor=0.5), mesh, params, data)
    _run(sw.expert_parallel(step, "ep", capacity_factor=0.5, drop_per_rank=True), mesh, params, data)


def test_bad_drop_options_are_refused_when_applied() -> None:
    step, _ = moe_model()
    with pytest.raises(ValueError, match=r"drop_per_rank=True\) without capacity_factor= drops nothing"):
        sw.expert_parallel(step, "ep", drop_per_rank=True)
    with pytest.raises(TypeError, match="drop_per_rank='yes'"):
        sw.expert_parallel(step, "ep", capacity_factor=1.0, drop_per_rank="yes")  # type: ignore[arg-type]
