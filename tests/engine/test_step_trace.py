"""step.with_trace(): any stack reports when each action of its rank's Plan ran, and a measured step
of a stack without a pipeline becomes a timeline like a simulated one."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.plan.actions import COMPUTES, FORWARD, GATHER, INSIDE, LOSS, REDUCE_SCATTER, SHORT
from shardwise.engine.simulate.timeline import PlanTimeline
from shardwise.testing.models import MoEBlock, TinyGPT, mlp


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



def _split_steps() -> dict[str, tuple[sw.Step, sw.Mesh, dict, tuple]]:
    """A step of each split whose layers' collectives run inside library code or autograd's transposes
    (ring attention's ppermutes, Ulysses' and the MoE's all-to-alls), and its mesh, parameters and batch."""
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=16, d_model=16, n_heads=4, n_layers=2, seq_len=16).double()
    chain, gpt_params = sw.functionalize(gpt, units=["tok_emb", "blocks", "head"])
    gpt_step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    ids = torch.randint(0, 16, (2, 17))
    shifted = (ids[:, :-1], ids[:, 1:])  # context_parallel refuses targets that are the inputs themselves
    moe = nn.Sequential(nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), nn.Linear(8, 3)).double()
    moe_chain, moe_params = sw.functionalize(moe)
    moe_step = sw.train_step(moe_chain, F.mse_loss, sw.optim.sgd(0.1))
    moe_batch = (torch.randn(4, 4, 6, dtype=torch.float64), torch.randn(4, 4, 3, dtype=torch.float64))
    return {
        "cp4-ring": (sw.context_parallel(gpt_step, "cp"), sw.Mesh(cp=4), gpt_params, shifted),
        "cp2-ulysses": (
            sw.context_parallel(gpt_step, "cp", attention="ulysses"), sw.Mesh(cp=2), gpt_params, shifted
        ),
        "ep2": (sw.expert_parallel(moe_step, "ep"), sw.Mesh(ep=2), moe_params, moe_batch),
    }


@pytest.mark.parametrize("split", ["cp4-ring", "cp2-ulysses", "ep2"])
def test_a_traced_split_step_times_each_in_layer_collective_at_its_plan_position(split: str) -> None:
    """Every collective a compute issues is timed where it runs, whoever issues it (a library function,
    autograd's transpose), so each action of the Plan, the in-layer ones included, has its time."""
    step, mesh, params, batch = _split_steps()[split]
    plan = step.plan(mesh, params, batch)
    per_rank = _traced_run(step.with_trace(), mesh, params, batch, steps=1)
    for r in range(mesh.size):
        times = per_rank[r][-1][0]
        actions = plan.actions[r]
        assert [pos for pos, _, _ in times] == list(range(len(actions))), f"rank {r}"
        compute = None
        for pos, start, end in times:  # each in-layer collective inside the compute listed before it
            if actions[pos].kind == INSIDE:
                assert compute is not None and compute[0] <= start <= end <= compute[1], (r, actions[pos])
            else:
                compute = (start, end) if actions[pos].kind in (*COMPUTES, LOSS) else None
        assert any(actions[pos].kind == INSIDE for pos, _, _ in times)
