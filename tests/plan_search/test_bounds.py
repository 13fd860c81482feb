"""The search's arithmetic bounds and its one-replica simulation: below what the Plan and the
simulation give, the same times, and the same layouts returned as an exhaustive search."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.model.reuse import sharing_runs
from shardwise.engine.simulate.simulation import simulate
from shardwise.plan_search import Candidate, FlopCompute, Space, params_per_layer
from shardwise.plan_search.bounds import Bounds
from shardwise.plan_search.rank import MEMORY, meta, plan_costs, simulated_time
from shardwise.testing.models import mlp

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BF16 = "params=f32,compute=bf16,output=f32"
# Two nodes of two ranks, the network 10x slower than the node: dp groups cross it, pp and tp do not.
COMM = sw.plan.CommModel.two_level(intra=sw.plan.CommModel.link(1e9, 1e-5), inter=sw.plan.CommModel.link(1e8, 1e-4),
                                   ranks_per_node=2)


def mlp_problem(batch: int = 16) -> tuple[Any, Any, Any, FlopCompute]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 32, 32, 32, 8]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3))
    data = (torch.randn(batch, 8), torch.randn(batch, 8))
    return step, params, data, FlopCompute(params_per_layer(step, params), 1e8, batch)


def llama_problem() -> tuple[Any, Any, Any, FlopCompute]:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    example = torch.zeros((1, 8), dtype=torch.long)
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=example)
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y), sw.optim.adamw(1e-3))
    ids = torch.zeros((8, 16), dtype=torch.long)
    return step, params, (ids, ids), FlopCompute(params_per_layer(step, params), 1e8, 8, 16)


@sharing_runs()  # as search plans them
def planned(space: Space, world: int, step: Any, params: Any, batch: Any, tp_plan: Any = None) -> list[tuple[Any, ...]]:
    out = []
    for c in space.candidates(world, tensor_parallel=tp_plan is not None):
        try:
            applied = c.apply(step, tp_plan)
            out.append((c, applied, applied.plan(c.mesh, params, batch)))
        except ValueError:
            continue
    return out


def test_a_search_shares_its_fake_runs_and_plans_what_each_layout_plans_alone() -> None:
    """``planned`` (as search) plans every layout inside one sharing_runs block: layers rewritten alike,
    updates of like shards, run once. Each Plan must be the one made alone: ZeRO 1-3, pipelines,
    bf16, SGD's in-place update and AdamW's out-of-place one."""
    for optimizer in (sw.optim.adamw(1e-3), sw.optim.sgd(0.1, momentum=0.9)):
        step, params, batch, _ = mlp_problem()
        step = sw.train_step(step.chain, torch.nn.functional.mse_loss, optimizer)
        shapes = meta(params)
        space = Space(microbatches=(1, 2), schedules=("1f1b", "zb_h1"), precision=(None, BF16), remat=(None,))
        seen = planned(space, 4, step, shapes, batch)
        assert len(seen) > 20
        with sharing_runs():  # the other way round: a run stored by a later layout, read by an earlier one
            backwards = [applied.plan(c.mesh, shapes, batch) for c, applied, _ in reversed(seen)][::-1]
        for (c, _, plan), other in zip(seen, backwards, strict=True):
            alone = c.apply(step).plan(c.mesh, shapes, batch)
            assert plan.actions == alone.actions == other.actions, c
            assert dict(plan.memory) == dict(alone.memory) == dict(other.memory), c


@pytest.mark.parametrize("problem", ["mlp", "llama"])
def test_the_bounds_are_below_the_plans_peak_and_the_simulated_time(problem: str) -> None:
    if problem == "mlp":
        step, params, batch, compute = mlp_problem()
        space, tp_plan = Space(microbatches=(1, 2, 4), schedules=("gpipe", "1f1b", "zb_h1"),
                               reshard_under_pipeline=(None, False), precision=(None, BF16)), None
    else:
        step, params, batch, compute = llama_problem()
        space, tp_plan = Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), precision=(None, BF16)), \
            sw.tp.llama_plan()
    shapes = meta(params)
    bounds = Bounds(step, shapes, batch, compute, COMM)
    base_opt = step.plan(None, shapes).memory["opt_state"][0]
    seen = planned(space, 4, step, shapes, batch, tp_plan)
    assert len(seen) > 30 and any(c.tp > 1 for c, _, _ in seen) == (tp_plan is not None)
    for c, applied, plan in seen:
        bound = bounds(c, applied)
        t = simulated_time(plan, applied, c, compute(c), shapes, comm=COMM, cores=None, base_opt_bytes=base_opt)
        assert 0 < bound.memory <= max(plan.memory["peak"]), c
        assert 0 < bound.time <= t * (1 + 1e-12), c


def test_one_replica_simulates_what_every_rank_would() -> None:
    step, params, batch, compute = mlp_problem()
    shapes = meta(params)
    base_opt = step.plan(None, shapes).memory["opt_state"][0]
    seen = [s for s in planned(Space(microbatches=(1, 2), reshard_under_pipeline=(None, False)), 8, step, shapes, batch)
            if s[0].dp > 1]
    assert len(seen) > 20
    for c, applied, plan in seen:
        whole = simulate(plan, plan_costs(plan, applied, c, compute(c), shapes, comm=COMM, cores=None,
                                          base_opt_bytes=base_opt)).makespan
        one = simulated_time(plan, applied, c, compute(c), shapes, comm=COMM, cores=None, base_opt_bytes=base_opt)
        assert one == pytest.approx(whole, rel=1e-12), c


@pytest.fixture(scope="module")
def exhaustive_world_8() -> tuple[Any, Any, Any, FlopCompute, Space, Any]:
    """The problem of the pruning test and its exhaustive search's best 4 (searched once: the best 1
    is its first)."""
    step, params, batch, _ = mlp_problem()
    # Compute that outweighs the messages' latency: the bounds (mostly compute) then tell layouts apart.
    compute = FlopCompute(params_per_layer(step, params), 1e6, 16)
    space = Space(microbatches=(1, 2, 4), precision=(None, BF16))
    every = sw.search(step, params, batch, world=8, memory_per_rank="1GB", comm=COMM, compute=compute, space=space,
                      top=4, prune=False)
    return step, params, batch, compute, space, every


@pytest.mark.parametrize("top", [1, 4])
def test_pruning_returns_what_the_exhaustive_search_returns(
    top: int, exhaustive_world_8: tuple[Any, Any, Any, FlopCompute, Space, Any]
) -> None:
    step, params, batch, compute, space, every = exhaustive_world_8
    found = sw.search(step, params, batch, world=8, memory_per_rank="1GB", comm=COMM, compute=compute, space=space,
                      top=top)
    best = every.ranked[:top]
    assert [(str(p.candidate), p.time) for p in found.ranked] == [(str(p.candidate), p.time) for p in best]
    assert every.bounded == 0 and found.bounded > 0 and found.fitting + found.bounded <= every.fitting
    assert found.bounded_above == found.ranked[-1].time and "not planned" in found.table()


def test_a_memory_bound_refuses_only_what_would_not_fit() -> None:
    step, params, batch, compute = mlp_problem()
    space = Space(microbatches=(1, 2), precision=(None, BF16))
    every = sw.search(step, params, batch, world=4, memory_per_rank="1GB", compute=compute, space=space, top=1000)
    # A budget that only the leanest layouts meet: the bounds then tell many apart before any Plan.
    budget = sorted({p.memory for p in every.ranked})[1]
    found = sw.search(step, params, batch, world=4, memory_per_rank=budget, compute=compute, space=space, top=1000)
    by_bound = [r for r in found.refused if r.stage == MEMORY and r.reason.startswith("a lower bound")]
    assert by_bound, found.table()  # the bounds did refuse some, and each would have been over
    over = {str(p.candidate) for p in every.ranked if p.memory > budget}
    assert {str(r.candidate) for r in by_bound} <= over
    assert {str(p.candidate) for p in found.ranked} == {str(p.candidate) for p in every.ranked} - over


def test_a_certification_failure_reaches_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fastest layout fails certification: the next fastest is returned, priced if the bounds had
    left it out."""
    from shardwise.plan_search import driver
    from shardwise.testing.equivalence import NotEquivalentError

    step, params, batch, compute = mlp_problem()
    space = Space(microbatches=(1, 2), precision=(None,))
    every = sw.search(step, params, batch, world=4, memory_per_rank="1GB", comm=COMM, compute=compute, space=space,
                      top=3, prune=False)
    fastest = every.ranked[0].candidate

    def certify(candidate: Candidate, *args: Any, **kwargs: Any) -> str:
        if candidate == fastest:
            raise NotEquivalentError("planted: params differ", 0, "0.weight", 0, 1.0, 1.0)
        return "equivalent (made up)"

    monkeypatch.setattr(driver, "certify", certify)
    found = sw.search(step, params, batch, world=4, memory_per_rank="1GB", comm=COMM, compute=compute, space=space,
                      top=2, certify_with=(step, params, [batch]))
    assert [p.candidate for p in found.ranked] == [p.candidate for p in every.ranked[1:3]]
    assert [r.candidate for r in found.refused if r.stage == "certify"] == [fastest]


def test_the_70b_search_path_at_a_few_layers() -> None:
    """benchmarks/search_at_scale.py's path (a meta-built Llama of the 70B widths over 512 ranks of
    80 GB, the bounds and one-replica simulation) at two decoder layers: quick, and its best is a
    layout no other beats."""
    pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location("search_at_scale", BENCHMARKS / "search_at_scale.py")
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, "search_at_scale", bench)
        spec.loader.exec_module(bench)
        start = time.perf_counter()
        space = Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(8,), remat=(None,), precision=(BF16,),
                      max_tp=8)
        row = bench.run(layers=2, top=2, space=space)
    found = row["result"]
    # Its CPU time, not its wall time: on a shared machine the wall time measures the others' load.
    assert row["cpu_s"] < 90, (row["cpu_s"], time.perf_counter() - start)
    assert len(found.ranked) == 2 and all(p.memory <= 80e9 for p in found.ranked)
    assert found.bounded > 0 and row["planned"] < row["candidates"]
    assert found.ranked[0].time <= min(p.time for p in found.others)
