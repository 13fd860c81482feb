"""The Plan of a tensor-parallel step is what it does, and what it does is Megatron's arithmetic.

* Contract: one step runs under ``comm_ledger()``; every rank's records, in order, are
  ``plan.collectives(rank)`` (op, axis, dtype, bytes), and the bytes each rank holds are the
  Plan's memory figures: with and without sequence parallel, with dp and pp, under mixed
  precision and remat.
* Volumes, computed here from the shapes alone (never from the Plan): per block, 2
  all-reduces of the activations (batch x seq x hidden x itemsize bytes each) in forward and
  2 in backward; under sequence parallel the same volume as all-gathers and reduce-scatters.
* Memory: per-rank parameter bytes = replicated + split / N, from the model's parameter shapes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.layout.state import tree_nbytes
from shardwise.engine.plan.actions import REPLICA_BINS
from shardwise.engine.simulate.costs import PlanCosts

F64 = 8  # bytes per element


def _ledgers(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[tuple[list, int, int]]:
    """Per rank: its ledger records of one step, and the bytes of its parameters and optimizer state."""

    def run() -> tuple[list, int, int]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            state, _ = step(state, batch)
        me = mesh.rank
        return [r for r in ledger.records if r.rank == me], tree_nbytes(state.params), tree_nbytes(state.opt_state)

    return sw.launch(run, mesh.size)


# -- the contract: ledger == Plan on every rank -------------------------------------------------


def _stack(name: str) -> Callable[[Any], tuple[sw.Step, sw.Mesh]]:
    """A tensor-parallel stack on a problem, by name: mesh, sequence parallel, other transforms."""

    def tp(problem: Any, sp: bool) -> sw.Step:
        return sw.tensor_parallel(problem.step, "tp", problem.plan, sequence_parallel=problem.blocks if sp else None)

    stacks: dict[str, Callable[[Any], tuple[sw.Step, sw.Mesh]]] = {
        "tp2": lambda p: (tp(p, False), sw.Mesh(tp=2)),
        "tp2-sp": lambda p: (tp(p, True), sw.Mesh(tp=2)),
        "tp4-sp": lambda p: (tp(p, True), sw.Mesh(tp=4)),
        "dp2xtp2-zero1": lambda p: (sw.shard_params(tp(p, False), "dp", 1), sw.Mesh(dp=2, tp=2)),
        "dp2xtp2-zero3-sp": lambda p: (sw.shard_params(tp(p, True), "dp", 3), sw.Mesh(dp=2, tp=2)),
        "pp2xtp2-zb_h1-sp": lambda p: (sw.pipeline(tp(p, True), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
        "dp2xpp2xtp2-sp": lambda p: (
            sw.shard_params(sw.pipeline(tp(p, True), "pp", "1f1b", 2), "dp", 3), sw.Mesh(dp=2, pp=2, tp=2)
        ),
        "tp2-sp-bf16": lambda p: (
            sw.mixed_precision(tp(p, True), "params=f64,compute=bf16,output=f64,reduce=f32"), sw.Mesh(tp=2)
        ),
        "tp2-sp-remat": lambda p: (sw.remat(tp(p, True)), sw.Mesh(tp=2)),
        "tp2-no-regions": lambda p: (sw.tensor_parallel(p.step, "tp", _without_regions(p.plan)), sw.Mesh(tp=2)),
    }
    return stacks[name]


def _without_regions(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan as torch's are written: each projection Colwise or Rowwise, no module holding them."""
    return {pattern: style for pattern, style in plan.items() if not isinstance(style, sw.tp.Region)}


CONTRACT = [
    ("mlp", "tp2"),
    ("llama", "tp2-no-regions"),
    ("tiny_gpt", "tp2"),
    ("tiny_gpt", "tp4-sp"),
    ("llama", "tp2-sp"),
    ("llama", "tp2"),
    ("gpt2", "tp4-sp"),
    ("tiny_gpt", "dp2xtp2-zero1"),
    ("tiny_gpt", "dp2xtp2-zero3-sp"),
    ("tiny_gpt", "pp2xtp2-zb_h1-sp"),
    ("tiny_gpt", "dp2xpp2xtp2-sp"),
    ("tiny_gpt", "tp2-sp-bf16"),
    ("tiny_gpt", "tp2-sp-remat"),
]


@pytest.mark.parametrize("family,stack", CONTRACT, ids=[f"{f}-{s}" for f, s in CONTRACT])
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(
    family: str, stack: str, build: dict[str, Callable]
) -> None:
    problem = build[family](steps=1)
    step, mesh = _stack(stack)(problem)
    batch = problem.batches[0]
    plan = step.plan(mesh, problem.params, batch)
    assert any(a.kind == "inside" for a in plan.for_rank(0))  # the contract covers the tp collectives
    for rank, (records, held, opt) in enumerate(_ledgers(step, mesh, problem.params, batch)):
        got = [(r.op, r.axis, r.dtype, r.nbytes) for r in records]
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}: the ledger differs from the Plan\nledger: {got}\nplan:   {want}"
        assert held == plan.memory["params"][rank]
        assert opt == plan.memory["opt_state"][rank]


def test_projections_sharing_an_input_outside_a_region_enter_once_as_in_one(build: dict[str, Callable]) -> None:
    """q, k and v (and gate and up) of one hidden state, each Colwise with no Region holding them: each
    entered the split on its own, so backward summed their input gradients over tp three times (twice
    for the MLP) where a Region sums them once. They now enter once per layer call: the same
    collectives, bytes included, as the plan with its Regions."""
    problem = build["llama"](steps=1)
    batch = problem.batches[0]
    with_regions = sw.tensor_parallel(problem.step, "tp", problem.plan)
    without = sw.tensor_parallel(problem.step, "tp", _without_regions(problem.plan))
    assert without.plan(sw.Mesh(tp=2), problem.params, batch).collectives(0)  # the plan holds tp's collectives
    ledgers = [_ledgers(step, sw.Mesh(tp=2), problem.params, batch) for step in (with_regions, without)]
    for (regions, _, _), (plain, _, _) in zip(*ledgers, strict=True):
        assert [(r.op, r.phase, r.nbytes) for r in plain] == [(r.op, r.phase, r.nbytes) for r in regions]


TRACED = [("tiny_gpt", "tp2"), ("llama", "tp2-sp"), ("tiny_gpt", "dp2xpp2xtp2-sp"), ("tiny_gpt", "tp2-sp-remat")]


@pytest.mark.parametrize("family,stack", TRACED, ids=[f"{f}-{s}" for f, s in TRACED])
def test_a_traced_step_times_every_action_of_its_plan_in_layer_collectives_included(
    family: str, stack: str, build: dict[str, Callable]
) -> None:
    problem = build[family](steps=1)
    step, mesh = _stack(stack)(problem)
    traced, batch = step.with_trace(), problem.batches[0]
    plan = step.plan(mesh, problem.params, batch)

    def run() -> tuple[list, dict, dict]:
        state, metrics = traced(traced.init(problem.params, mesh), batch)
        plain, _ = step(step.init(problem.params, mesh), batch)
        return list(metrics["action_times"]), state.params, plain.params

    ran = sw.launch(run, mesh.size)
    for _, held, plain in ran:  # tracing changes nothing of what the step computes
        leaves, plain_leaves = optree.tree_leaves(held), optree.tree_leaves(plain)
        assert len(leaves) == len(plain_leaves) and all(map(torch.equal, leaves, plain_leaves))
    measured = [times for times, _, _ in ran]
    for rank, times in enumerate(measured):
        actions = plan.actions[rank]
        assert [pos for pos, _, _ in times] == list(range(len(actions))), f"rank {rank}"
        # Each in-layer collective at its Plan position ran inside the compute listed before it.
        compute = None
        for pos, start, end in times:
            kind = actions[pos].kind
            if kind == "inside":
                assert compute is not None and compute[0] <= start <= end <= compute[1], (rank, actions[pos])
            elif kind in ("forward", "backward", "backward_input", "backward_weight", "loss"):
                compute = (start, end)
            else:
                compute = None
        assert sum(actions[pos].kind == "inside" for pos, _, _ in times) > 0
    # The measured step calibrates a simulation of the Plan (its in-layer actions are costed like any).
    costs = PlanCosts.fit(plan, [measured], statistic="mean")
    replayed = sw.simulate(plan, costs.of_step(plan, measured))
    assert replayed.makespan > 0 and 0 <= replayed.bubble_fraction < 1


# -- Megatron's volumes, from the shapes ---------------------------------------------------------

BATCH, SEQ, HIDDEN, LAYERS, VOCAB = 4, 8, 32, 2, 64
ACT = BATCH * SEQ * HIDDEN * F64  # one activation tensor of the residual stream
TOKENS = BATCH * SEQ
# the most that one of the step's closing exchanges may carry: the replica check's bins and the batch's fingerprint
STEP_END_BYTES = (2 * REPLICA_BINS + 1) * F64


def _without_step_end(records: list) -> list:
    """The records up to the end of backward. After it a step exchanges only a few scalars (the
    check that the replicated gradients agree over tp, the metrics): not Megatron's traffic, and
    not fixed by it, so they are bounded here rather than listed."""
    end = len(records)
    while end and records[end - 1].phase == "forward":
        end -= 1
    tail = records[end:]
    assert tail, "a step ends with its metrics' exchange"
    assert all(r.nbytes <= STEP_END_BYTES for r in tail), [(r.op, r.nbytes) for r in tail]
    return records[:end]


def _blocks_only(problem: Any) -> dict[str, Any]:
    """TinyGPT's plan without the embedding and the head: the blocks' collectives alone."""
    return {pattern: style for pattern, style in problem.plan.items() if pattern.startswith("blocks.")}


def _tp_records(step: sw.Step, params: Any, n: int, batch: Any) -> list:
    """Rank 0's ledger of one step on ``Mesh(tp=n)``, after checking that every rank's is alike."""
    records = _ledgers(step, sw.Mesh(tp=n), params, batch)
    first = records[0][0]
    for other, _, _ in records[1:]:  # every tp rank issues the same collectives, with the same bytes
        assert [(r.op, r.phase, r.nbytes) for r in other] == [(r.op, r.phase, r.nbytes) for r in first]
    return first


def _megatron_problem(build: dict[str, Callable], plan: str, sp: bool) -> tuple[sw.Step, Any]:
    problem = build["tiny_gpt"](steps=1)
    assert (problem.batches[0][0].shape, problem.model.blocks[0].ln1.normalized_shape) == ((BATCH, SEQ), (HIDDEN,))
    styles = _blocks_only(problem) if plan == "blocks" else problem.plan
    step = sw.tensor_parallel(problem.step, "tp", styles, sequence_parallel=problem.blocks if sp else None)
    return step, problem


def _ring(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends (ring algorithms; the ledger's convention)."""
    wire = {"psum": 2 * nbytes * (n - 1) // n, "all_gather": (n - 1) * nbytes, "psum_scatter": nbytes * (n - 1) // n}
    return wire[op]


@pytest.mark.parametrize("n", [2, 4])
def test_per_block_two_all_reduces_forward_and_two_backward(n: int, build: dict[str, Callable]) -> None:
    step, problem = _megatron_problem(build, "blocks", sp=False)
    records = _without_step_end(_tp_records(step, problem.params, n, problem.batches[0]))
    forward = [("psum", "forward", ACT)] * (2 * LAYERS)  # attention's and the MLP's g
    backward = [("psum", "backward", ACT)] * (2 * LAYERS)  # their f, transposed
    assert [(r.op, r.phase, r.nbytes) for r in records] == forward + backward
    activations = [r for r in records if r.nbytes == ACT]
    assert sum(r.sent_bytes for r in activations) == 4 * LAYERS * _ring("psum", ACT, n)


def _replicated_per_block(problem: Any) -> list[int]:
    """Bytes of each replicated parameter of one block (norms, the Rowwise biases): under sequence
    parallel each acts on a slice of the sequence, so its gradient is summed over tp."""
    split = re.compile(r"(attn\.qkv|mlp\.0)\.(weight|bias)$|(attn\.proj|mlp\.2)\.weight$")
    return [t.numel() * F64 for name, t in problem.model.blocks[0].named_parameters() if not split.search(name)]


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_moves_the_same_volume_as_gathers_and_scatters(n: int, build: dict[str, Callable]) -> None:
    step, problem = _megatron_problem(build, "blocks", sp=True)
    records = _without_step_end(_tp_records(step, problem.params, n, problem.batches[0]))
    acts = [(r.op, r.phase, r.nbytes) for r in records if r.nbytes in (ACT, ACT // n)]
    # Per block and pair: gather the sequence in, reduce-scatter it out; backward the transposes.
    # The first block's input is cut to this rank's slice (its gradient gathered in backward) and
    # the last block's output gathered (its gradient sliced).
    pair_forward = [("all_gather", "forward", ACT // n), ("psum_scatter", "forward", ACT)]
    pair_backward = [("all_gather", "backward", ACT // n), ("psum_scatter", "backward", ACT)]
    boundary_forward, boundary_backward = [("all_gather", "forward", ACT // n)], [("all_gather", "backward", ACT // n)]
    assert acts == pair_forward * 2 * LAYERS + boundary_forward + pair_backward * 2 * LAYERS + boundary_backward
    small = Counter((r.op, r.phase, r.nbytes) for r in records if r.nbytes not in (ACT, ACT // n))
    replicated = _replicated_per_block(problem)
    assert len(replicated) == 6  # ln1, ln2 (weight, bias), attn.proj.bias, mlp.2.bias
    assert small == Counter([("psum", "backward", b) for b in replicated] * LAYERS)
    # Megatron-SP: an all-gather plus a reduce-scatter send what one all-reduce sends.
    in_blocks = acts[: 4 * LAYERS] + acts[4 * LAYERS + 1 : -1]
    sent = {(r.op, r.phase, r.nbytes): r.sent_bytes for r in records}
    assert sum(sent[a] for a in in_blocks) == 4 * LAYERS * _ring("psum", ACT, n)


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_ends_reduce_scatter_as_dtensor_does(n: int, build: dict[str, Callable]) -> None:
    """With the embedding and the head split too, the region's ends move what torch's DTensor plan moves
    (``RowwiseParallel(output_layouts=Shard(1))`` on the embedding, ``ColwiseParallel(input_layouts=
    Shard(1))`` on the head): the lookups are reduce-scattered into the first block (all-gathered in
    backward), the last block's output is all-gathered by the head and the head's input gradient
    reduce-scattered. No activation is all-reduced: Megatron's all-reduce-then-slice at each end sends
    twice a reduce-scatter's bytes. The final norm runs on the slice, so its weight and bias have their
    gradients summed (as DTensor's SequenceParallel norm does)."""
    step, problem = _megatron_problem(build, "all", sp=True)
    records = _without_step_end(_tp_records(step, problem.params, n, problem.batches[0]))
    acts = [(r.op, r.phase, r.nbytes) for r in records if r.nbytes in (ACT, ACT // n)]
    pair_forward = [("all_gather", "forward", ACT // n), ("psum_scatter", "forward", ACT)]
    pair_backward = [("all_gather", "backward", ACT // n), ("psum_scatter", "backward", ACT)]
    into, out_of = ("psum_scatter", "forward", ACT), ("all_gather", "forward", ACT // n)
    into_back, out_of_back = ("all_gather", "backward", ACT // n), ("psum_scatter", "backward", ACT)
    assert acts == [into, *pair_forward * 2 * LAYERS, out_of, out_of_back, *pair_backward * 2 * LAYERS, into_back]
    assert not [r for r in records if r.op == "psum" and r.nbytes >= ACT // n], "an activation was all-reduced"
    # Per step: the blocks' volume (Megatron-SP: one all-reduce's bytes per pair and direction), plus at each
    # end one reduce-scatter and one all-gather of the activation (DTensor's), nothing more.
    sent = sum(r.sent_bytes for r in records if r.nbytes in (ACT, ACT // n))
    assert sent == (4 * LAYERS + 2) * (_ring("psum_scatter", ACT, n) + _ring("all_gather", ACT // n, n))
    small = Counter((r.op, r.phase, r.nbytes) for r in records if r.nbytes not in (ACT, ACT // n))
    final_norm = [t.numel() * F64 for t in problem.model.ln_f.parameters()]
    assert small == Counter(
        [("psum", "backward", b) for b in _replicated_per_block(problem)] * LAYERS
        + [("psum", "backward", b) for b in final_norm]
        + [("all_gather", "forward", TOKENS * F64)] + [("psum", "forward", TOKENS * F64)] * 2  # the loss
    )


def test_a_tied_head_does_not_sum_the_embedding_lookup_it_replays(build: dict[str, Callable]) -> None:
    """GPT-2's head layer replays the code before the first block (its output is discarded), and its tied
    head makes the vocabulary-split embedding the layer's: under sequence parallel the replayed lookup
    is left unsummed, and never used, so no activation is all-reduced in forward."""
    problem = build["gpt2"](steps=1)
    step = sw.tensor_parallel(problem.step, "tp", problem.plan, sequence_parallel=problem.blocks)
    records = _without_step_end(_tp_records(step, problem.params, 2, problem.batches[0]))
    forward = [(r.op, r.nbytes) for r in records if r.phase == "forward"]
    assert ("psum_scatter", ACT) in forward  # the embedding's lookups, into the first block
    assert not [op for op in forward if op[0] == "psum" and op[1] >= ACT // 2], forward


@pytest.mark.parametrize("n", [2, 4])
def test_the_vocabulary_parallel_embedding_and_loss(n: int, build: dict[str, Callable]) -> None:
    """On top of the blocks: the split embedding's lookups are summed (an all-reduce of the
    activations); the head's input gradient is summed in backward; the loss moves three values per
    token (the maximum gathered, the exponentials' sum and the target logit summed), never logits."""
    step, problem = _megatron_problem(build, "all", sp=False)
    records = _without_step_end(_tp_records(step, problem.params, n, problem.batches[0]))
    forward = [("psum", "forward", ACT)] * (1 + 2 * LAYERS)
    loss = [
        ("all_gather", "forward", TOKENS * F64),
        ("psum", "forward", TOKENS * F64),
        ("psum", "forward", TOKENS * F64),
    ]
    backward = [("psum", "backward", ACT)] * (1 + 2 * LAYERS)
    assert [(r.op, r.phase, r.nbytes) for r in records] == forward + loss + backward
    gathered = build["tiny_gpt"](steps=1, vocab_parallel=False)
    step = sw.tensor_parallel(gathered.step, "tp", gathered.plan)
    first_gather = next(r for r in _tp_records(step, gathered.params, n, problem.batches[0]) if r.op == "all_gather")
    assert (first_gather.phase, first_gather.nbytes) == ("forward", TOKENS * VOCAB // n * F64)  # the head's output


# -- memory: replicated + split / N --------------------------------------------------------------

SPLIT_PARAMETERS = {  # what each family's ready plan cuts, by parameter name
    "tiny_gpt": r"(attn\.qkv|mlp\.0)\.(weight|bias)$|(attn\.proj|mlp\.2)\.weight$|^tok_emb\.weight$",
    "llama": r"(q|k|v|o|gate|up|down)_proj\.weight$|embed_tokens\.weight$|^lm_head\.weight$",
    "gpt2": r"(attn\.c_attn|mlp\.c_fc)\.(weight|bias)$|c_proj\.weight$|wte\.weight$",
}


def _expected_bytes(model: torch.nn.Module, family: str, n: int) -> int:
    """From the model's parameters (a tied weight once): the replicated ones whole, the split ones / n."""
    split = re.compile(SPLIT_PARAMETERS[family])
    total = 0
    for name, t in model.named_parameters():
        nbytes = t.numel() * t.element_size()
        if split.search(name):
            assert nbytes % n == 0
            total += nbytes // n
        else:
            total += nbytes
    return total


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("family", ["tiny_gpt", "llama", "gpt2"])
def test_per_rank_parameter_bytes_are_replicated_plus_split_over_n(
    family: str, n: int, build: dict[str, Callable]
) -> None:
    problem = build[family](steps=1)
    step = sw.tensor_parallel(problem.step, "tp", problem.plan, sequence_parallel=problem.blocks)
    mesh = sw.Mesh(tp=n)
    expected = _expected_bytes(problem.model, family, n)
    assert expected < tree_nbytes(problem.params)  # the plan splits something
    # SGD's momentum: one buffer per parameter, and what the optimizer keeps besides (its step count)
    alone = problem.step.init(problem.params)
    expected_opt = expected + tree_nbytes(alone.opt_state) - tree_nbytes(alone.params)
    plan = step.plan(mesh, problem.params, problem.batches[0])
    assert list(plan.memory["params"]) == [expected] * n
    assert list(plan.memory["opt_state"]) == [expected_opt] * n

    def held() -> tuple[int, int]:
        state = step.init(problem.params, mesh)
        return tree_nbytes(state.params), tree_nbytes(state.opt_state)

    assert sw.launch(held, n) == [(expected, expected_opt)] * n


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_shards_the_tensor_parallel_slices(stage: int, build: dict[str, Callable]) -> None:
    """dp x tp: ZeRO-1 keeps each rank's slices whole; ZeRO-3 cuts them over dp (plus the padding of
    each unit's flat buffer to a multiple of dp)."""
    problem = build["tiny_gpt"](steps=1)
    step = sw.shard_params(sw.tensor_parallel(problem.step, "tp", problem.plan), "dp", stage)
    mesh = sw.Mesh(dp=2, tp=2)
    per_tp_rank = _expected_bytes(problem.model, "tiny_gpt", 2)
    plan = step.plan(mesh, problem.params, problem.batches[0])
    _, held, _ = zip(*_ledgers(step, mesh, problem.params, problem.batches[0]), strict=True)
    assert list(held) == list(plan.memory["params"])
    if stage == 1:
        assert list(held) == [per_tp_rank] * 4
    else:
        units = len(problem.step.chain)
        for h in held:
            assert per_tp_rank <= 2 * h < per_tp_rank + 2 * units * F64


def test_a_plan_without_a_batch_says_its_in_layer_collectives_are_not_listed(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"]()
    step = sw.tensor_parallel(problem.step, "tp", problem.plan)
    mesh = sw.Mesh(tp=2)
    without, with_batch = step.plan(mesh, problem.params), step.plan(mesh, problem.params, problem.batches[0])
    assert not [a for a in without.for_rank(0) if a.kind == "inside"]
    assert [a for a in with_batch.for_rank(0) if a.kind == "inside"]
    missing = "collectives inside the layer are not listed"
    split_layers = [layer for layer, notes in with_batch.layers.items() if any("tensor parallel" in n for n in notes)]
    assert split_layers
    for layer in split_layers:
        assert any(missing in n for n in without.layers[layer]), without.layers[layer]
        assert not any(missing in n for n in with_batch.layers[layer])
    assert missing in str(without)
