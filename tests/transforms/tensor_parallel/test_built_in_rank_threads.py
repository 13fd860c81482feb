"""tensor_parallel built inside each rank's function (``launch(main, 2)`` where ``main`` builds the step) runs
the same computation, bit for bit, as the step built once before the launch.

Both ranks' builds share the rewritten chain (engine/stack/compose.py keeps one per source chain and stack),
so the rank that built it first must not leave its own call's state (its tensors, the prediction's fake ones)
in what the other rank copies its module from (engine/model/module_call.py, ThreadReplicas). The race is
timing-dependent here (before the fix: a meta-device error in layer 'head', or other losses, silently, in about
one run in three), so each case runs three times; tests/engine/test_thread_replicas_on_ranks.py forces it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.collectives.launch import launch


def _run(step: sw.Step, params: Any, batches: list[Any], plan: dict[str, Any], build_here: bool,
         tp_step: sw.Step | None = None) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    if build_here:
        tp_step = sw.tensor_parallel(step, "tp", plan)
    assert tp_step is not None
    mesh = sw.Mesh(tp=2)
    state = tp_step.init(params, mesh)
    losses = []
    for batch in batches:
        state, metrics = tp_step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, tp_step.full_params(state)


@pytest.mark.parametrize("family", ["gpt2", "tiny_gpt", "mlp"])
def test_built_in_each_rank_equals_built_before_launch(build, family):
    problem = build[family]()
    before = sw.tensor_parallel(problem.step, "tp", problem.plan)
    want = launch(functools.partial(_run, problem.step, problem.params, problem.batches, problem.plan, False,
                                    before), 2)
    for _ in range(3):
        # a fresh source chain each time, as a user's program has: nothing of an earlier run is reused
        problem = build[family]()
        got = launch(functools.partial(_run, problem.step, problem.params, problem.batches, problem.plan, True), 2)
        for (want_losses, want_params), (got_losses, got_params) in zip(want, got, strict=True):
            assert got_losses == want_losses
            for layer, named in want_params.items():
                for name, t in named.items():
                    assert torch.equal(got_params[layer][name], t), (layer, name)
