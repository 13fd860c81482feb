"""The Plan is the unit of truth: a step issues exactly the collectives its Plan lists.

For drawn stacks (the public strategies: shard_params stages and options, pipeline
schedules and micro-batches, remat, mixed precision, in drawn orders) on dp, pp and
dp x pp meshes, one step runs under ``comm_ledger()``; every rank's records, in order,
must be the Plan's collectives for that rank, op by op, with equal axes, dtypes and
bytes. The bytes each rank holds afterwards must be the Plan's memory figures.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.layout.state import tree_nbytes
from shardwise.testing import strategies as sst
from shardwise.testing.models import mlp

F64 = "params=f64,compute=f64,output=f64"
PRECISIONS = [None, F64, "params=f64,compute=f32,output=f64", "params=f64,compute=bf16,output=f64,reduce=bf16"]


def _ledger_and_memory(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[tuple[list, int, int, int]]:
    def run() -> tuple[list, int, int, int]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            state, metrics = step(state, batch)
        me = mesh.rank
        got = [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == me]
        peak = int(metrics["peak_gathered_bytes"]) if "peak_gathered_bytes" in metrics else -1
        return got, tree_nbytes(state.params), tree_nbytes(state.opt_state), peak

    return sw.launch(run, mesh.size)


def _check_contract(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> sw.plan.Plan:
    plan = step.plan(mesh, params, batch)
    for rank, (got, held, opt, peak) in enumerate(_ledger_and_memory(step, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}: the ledger differs from the Plan\nledger: {got}\nplan:   {want}"
        assert held == plan.memory["params"][rank]
        assert opt == plan.memory["opt_state"][rank]
        if peak >= 0:
            assert peak == plan.memory["gathered_peak"][rank]
    return plan


@given(
    problem=sst.problems(max_depth=4, max_steps=1),
    dp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    precision=st.sampled_from(PRECISIONS),
    data=st.data(),
)
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(
    problem: sst.Problem, dp: int, pp: int, precision: str | None, data: st.DataObject
) -> None:
    stack = data.draw(sst.transform_stacks("dp", pp="pp", precision=precision))
    assume(len(problem.case.chain) >= pp)
    mesh = sw.Mesh(dp=dp, pp=pp)
    step = stack.apply(problem.step)
    if data.draw(st.booleans()):  # a quiet step exchanges only what a rule needs
        step = step.with_metrics(())
    batch = problem.batches_for(mesh, multiple=stack.microbatches)[0]
    plan = _check_contract(step, mesh, problem.params, batch)
    for rank in range(mesh.size):  # one update, or (ZeRO-1/2) one per bucket, each unit in one
        parts = [a.units or (a.layer,) for a in plan.for_rank(rank) if a.kind == "update"]
        assert parts and (parts == [(None,)] or len({u for p in parts for u in p}) == sum(map(len, parts)))


@given(
    problem=sst.problems(max_depth=4, max_steps=1),
    dp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    precision=st.sampled_from(PRECISIONS),
    data=st.data(),
)
def test_a_tensor_parallel_stack_issues_exactly_its_plan(
    problem: sst.Problem, dp: int, pp: int, precision: str | None, data: st.DataObject
) -> None:
    """The collectives the layers issue inside their computes too (listed after each compute), on
    tp alone, dp x tp, pp x tp and dp x pp x tp, at most 8 ranks."""
    # tp among the sizes that fit and divide a hidden width (a drawn one rarely does otherwise)
    sizes = [t for t in (2, 4) if dp * pp * t <= 8 and any(w % t == 0 for w in problem.case.widths[1:-1])]
    assume(sizes and len(problem.case.chain) >= pp)
    tp = data.draw(st.sampled_from(sizes))
    options = data.draw(sst.tensor_parallel_options(problem.case, tp))
    assume(options is not None)
    stack = data.draw(sst.transform_stacks("dp", pp="pp" if pp > 1 else None, precision=precision, tp=options))
    mesh = sw.Mesh(**{k: v for k, v in (("dp", dp), ("pp", pp), ("tp", tp)) if v > 1 or k == "tp"})
    if dp == 1:  # shard_params needs its axis: keep it at size 1
        mesh = sw.Mesh(dp=1, **mesh.shape)
    step = stack.apply(problem.step)
    batch = problem.batches_for(mesh, multiple=stack.microbatches)[0]
    plan = _check_contract(step, mesh, problem.params, batch)
    assert any(a.kind == "inside" and a.op == "psum" for r in range(mesh.size) for a in plan.for_rank(r))


@given(problem=sst.problems(max_depth=4, max_steps=1), dp=st.sampled_from([2, 3]), data=st.data())
def test_zero_alone_issues_exactly_its_plan(problem: sst.Problem, dp: int, data: st.DataObject) -> None:
    stack = data.draw(sst.transform_stacks("dp", precision=data.draw(st.sampled_from(PRECISIONS))))
    mesh = sw.Mesh(dp=dp)
    step = stack.apply(problem.step)
    _check_contract(step, mesh, problem.params, problem.batches_for(mesh, multiple=stack.microbatches)[0])


def test_a_pipeline_with_tied_weights_across_ranks_lists_their_exchange() -> None:
    """GPT's head shares the embedding: the two pipeline ranks exchange that gradient, in the Plan."""
    from shardwise.testing.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=24, d_model=8, n_heads=2, n_layers=2, seq_len=6, tie_weights=True).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(24, (8, 6), generator=gen), torch.randint(24, (8, 6), generator=gen))
    for composed, mesh in (
        (sw.pipeline(step, "pp", "1f1b", 2), sw.Mesh(pp=2)),
        (sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", 3), sw.Mesh(dp=2, pp=2)),
    ):
        plan = _check_contract(composed, mesh, params, batch)
        assert plan.count("send_tied") == plan.count("recv_tied") == mesh.size


def test_a_plan_without_its_payload_says_what_it_needs() -> None:
    chain, params = sw.functionalize(mlp([4, 6, 3]))
    step = sw.pipeline(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "gpipe", 2)
    plan = step.plan(sw.Mesh(pp=2), params)  # no batch: the activations' sizes are unknown
    try:
        list(plan.collectives(0))
    except ValueError as err:
        assert "payload is unknown" in str(err) and "batch" in str(err)
    else:  # pragma: no cover - the check must be able to fail
        raise AssertionError("a plan without a batch listed its transfers' bytes")
