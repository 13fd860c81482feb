"""step.with_trace(): any stack reports when each action of its rank's Plan ran, and a measured step
of a stack without a pipeline becomes a timeline like a simulated one."""

from __future__ import annotations

import itertools

import torch

import shardwise as sw
from shardwise.engine.plan.actions import COMPUTES, FORWARD, GATHER, REDUCE_SCATTER, SHORT
from shardwise.engine.simulate.timeline import PlanTimeline
from shardwise.testing.models import TinyGPT, mlp


def _mlp_step() -> tuple[sw.Step, dict]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 12, 3]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def _traced_run(step: sw.Step, mesh: sw.Mesh, params: dict, batch: tuple, steps: int = 2) -> list:
    def run() -> list:
        state, out = step.init(params, mesh), []
        for _ in range(steps):
            state, metrics = step(state, batch)
            out.append((metrics.get("action_times"), metrics.get("trace"), state.params))
        return out

    return sw.launch(run, mesh.size)


def test_a_zero3_step_without_a_pipeline_reports_every_action_of_its_plan() -> None:
    step, params = _mlp_step()
    sharded = sw.shard_params(step, "dp", stage=3)
    mesh, batch = sw.Mesh(dp=2), (torch.randn(8, 6), torch.randn(8, 3))
    plan = sharded.plan(mesh, params, batch)
    traced = sharded.with_trace()
    assert traced.traced and not sharded.traced
    per_rank = _traced_run(traced, mesh, params, batch)
    plain = _traced_run(sharded, mesh, params, batch)
    for r in range(mesh.size):
        times, events, held = per_rank[r][-1]
        assert [pos for pos, _, _ in times] == list(range(len(plan.actions[r])))  # each action once, in order
        assert all(end >= start for _, start, end in times)
        assert all(b[1] >= a[2] for a, b in itertools.pairwise(times))  # one after another
        computes = [a for a in plan.actions[r] if a.kind in COMPUTES]  # their labels: stage, letter, micro-batch
        assert [label for _, label, _, _ in events] == [f"{a.stage}{SHORT[a.kind]}{a.microbatch}" for a in computes]
        assert plain[r][-1][0] is None and plain[r][-1][1] is None  # untraced: no times
        # Tracing changes nothing of what the step computes.
        assert all(torch.equal(held[k], plain[r][-1][2][k]) for k in held)
    timeline = PlanTimeline.from_measured(plan, [per_rank[r][-1][0] for r in range(mesh.size)])
    kinds = {slot.kind for row in timeline.ranks for slot in row}
    assert {GATHER, REDUCE_SCATTER, FORWARD} <= kinds and timeline.makespan > 0
    assert not traced.with_trace(False).traced


def test_the_trace_survives_every_transform_applied_after_it() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=16, d_model=8, n_heads=2, n_layers=2, seq_len=4))
    step = sw.train_step(chain, lambda logits, t: torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten()),
                         sw.optim.sgd(0.1))
    stacked = sw.remat(sw.mixed_precision(sw.shard_params(step.with_trace(), "dp", stage=2),
                                          "params=f32,compute=f32,output=f32"))
    assert stacked.traced
    mesh = sw.Mesh(dp=2)
    batch = (torch.randint(0, 16, (4, 4)), torch.randint(0, 16, (4, 4)))
    plan = stacked.plan(mesh, params, batch)
    per_rank = _traced_run(stacked, mesh, params, batch, steps=1)
    assert [len(per_rank[r][0][0]) for r in range(mesh.size)] == [len(a) for a in plan.actions]


def test_with_trace_false_turns_a_pipelines_trace_off() -> None:
    step, _ = _mlp_step()
    piped = sw.pipeline(step, "pp", "1f1b", 2, trace=True)
    assert piped.traced and not piped.with_trace(False).traced and piped.with_trace(False).with_trace().traced
    assert not sw.pipeline(step, "pp", "1f1b", 2).traced

