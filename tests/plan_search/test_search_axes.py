"""Context parallel, expert parallel and HSDP in the search space: tried where the model takes
them, bounded like the rest, and never returned over budget or failing equivalence."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.plan_search import FlopCompute, Space, params_per_layer
from shardwise.plan_search.bounds import Bounds
from shardwise.plan_search.rank import meta, simulated_time
from shardwise.testing.models import MoEBlock, TinyGPT, mlp

COMM = sw.plan.CommModel.two_level(intra=sw.plan.CommModel.link(1e9, 1e-5), inter=sw.plan.CommModel.link(1e8, 1e-4),
                                   ranks_per_node=2)
SPACE = Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), remat=(None,))


def gpt() -> tuple[Any, Any, list[Any]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d_model=16, n_heads=4, n_layers=2, seq_len=16).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()),
                         sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 16, (4, 16), generator=gen), torch.randint(0, 16, (4, 16), generator=gen))
               for _ in range(2)]
    return step, params, batches


def moe() -> tuple[Any, Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), nn.Linear(8, 3)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


def mlp_problem() -> tuple[Any, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 32, 32, 8]).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    return step, params, [(torch.randn(8, 8, generator=gen, dtype=torch.float64),
                           torch.randn(8, 8, generator=gen, dtype=torch.float64)) for _ in range(2)]


CASES = {"cp": (gpt, Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), remat=(None,), cp=(1, 2))),
         "ep": (moe, Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), remat=(None,), ep=(1, 2))),
         "hsdp": (mlp_problem, Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), remat=(None,),
                                     replicate=(1, 2)))}


def flops(step: Any, params: Any, batch: Any) -> FlopCompute:
    return FlopCompute(params_per_layer(step, params), 1e6, batch[0].shape[0], batch[0].shape[1] if batch[0].dim() > 2
                       else 1)


@pytest.mark.parametrize("axis", sorted(CASES))
def test_every_returned_layout_fits_and_is_certified(axis: str) -> None:
    make, space = CASES[axis]
    step, params, batches = make()
    compute = flops(step, params, batches[0])
    every = sw.search(step, params, batches[0], world=4, memory_per_rank="1GB", comm=COMM, compute=compute,
                      space=space, top=1000, prune=False)
    attr = "replicate" if axis == "hsdp" else axis
    assert any(getattr(p.candidate, attr) == 2 for p in every.ranked), every.table()
    peaks = sorted(p.memory for p in every.ranked)
    budget = peaks[len(peaks) // 2]
    fitting = sorted(q.time for q in every.ranked if q.memory <= budget)
    found = sw.search(step, params, batches[0], world=4, memory_per_rank=budget, comm=COMM, compute=compute,
                      space=space, top=3, certify_with=(step, params, batches))
    assert len(found.ranked) == min(3, len(fitting)) and found.ranked, found.table()
    for p in found.ranked:
        replanned = p.candidate.apply(step).plan(p.candidate.mesh, params, batches[0])
        assert max(replanned.memory["peak"]) <= budget, p.candidate
        assert p.certified is not None and p.certified.startswith("equivalent"), p.candidate
    assert [p.time for p in found.ranked] == fitting[:3]  # certified by the checker, and the fastest


@pytest.mark.parametrize("axis", sorted(CASES))
def test_the_bounds_hold_on_the_new_axes(axis: str) -> None:
    make, space = CASES[axis]
    step, params, batches = make()
    shapes, compute = meta(params), flops(step, params, batches[0])
    bounds = Bounds(step, shapes, batches[0], compute, COMM)
    base_opt = step.plan(None, shapes).memory["opt_state"][0]
    attr = "replicate" if axis == "hsdp" else axis
    seen = 0
    for c in space.candidates(4, tensor_parallel=False):
        if getattr(c, attr) == 1:
            continue
        try:
            applied = c.apply(step)
            plan = applied.plan(c.mesh, shapes, batches[0])
        except ValueError:
            continue
        bound = bounds(c, applied)
        t = simulated_time(plan, applied, c, compute(c), shapes, comm=COMM, cores=None, base_opt_bytes=base_opt)
        assert 0 < bound.memory <= max(plan.memory["peak"]), c
        assert 0 < bound.time <= t * (1 + 1e-12), c
        seen += 1
    assert seen >= 2


def test_a_model_without_attention_or_experts_skips_cp_and_ep_with_the_reason() -> None:
    step, params, batches = mlp_problem()
    found = sw.search(step, params, batches[0], world=4, memory_per_rank="1GB", compute=flops(step, params, batches[0]),
                      space=Space(zero_stages=(1,), schedules=("1f1b",), microbatches=(1,), remat=(None,), cp=(1, 2),
                                  ep=(1, 2)))
    assert all(p.candidate.cp == 1 and p.candidate.ep == 1 for p in found.ranked) and found.ranked
    assert [s.split(":")[0] for s in found.skipped] == ["tensor parallel shapes (tp > 1)", "cp > 1", "ep > 1"]
