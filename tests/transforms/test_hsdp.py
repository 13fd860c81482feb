"""HSDP: shard_params(axis, replicate=r) shards over ``axis`` and replicates the shards over ``r``.

float64 on thread ranks, 1e-12 relative against the single-device step (as tests/transforms/
test_shard_params.py: sharding only reorders sums, a few ulps; a missing all-reduce over the
replicas, a gradient counted twice in the norm or a batch cut once too few is an error of the
order of an update). The Plan lists the all-reduce of every gradient shard over ``r``, and each
rank issues exactly the Plan's collectives on both axes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.layout.state import tree_nbytes
from shardwise.testing.models import TinyGPT, mlp

F64_RTOL = 1e-12
HSDP = sw.Mesh(node=2, dp=2)  # dp (the shards) varies fastest: within a "node"


def _mlp(sizes: tuple[int, ...] = (5, 7, 3, 6), optimizer: Any = None) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp(list(sizes)).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, optimizer or sw.optim.sgd(0.1, momentum=0.9),
                         clip_norm=0.5)  # the norm is used: a shard counted on every replica would show
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, sizes[0], generator=gen, dtype=torch.float64),
                torch.randn(8, sizes[-1], generator=gen, dtype=torch.float64)) for _ in range(3)]
    return step, params, batches


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def _gpt() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()  # head tied to tok_emb
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.5, momentum=0.9), clip_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(32, (8, 8), generator=gen), torch.randint(32, (8, 8), generator=gen)) for _ in range(2)]
    return step, params, batches


CASES = [
    (1, {}),
    (2, {"accumulation": 2}),
    (2, {"bucket_mb": 1e-4}),  # buckets of a unit or two: the all-reduce goes per bucket too
    (3, {}),
    (3, {"reshard_after_forward": False, "prefetch": 2, "reduce_in_flight": 1}),
    (3, {"accumulation": 2}),
]


@pytest.mark.parametrize("stage,options", CASES, ids=[f"zero{s}-{o}" for s, o in CASES])
def test_hsdp_is_the_single_device_step(stage: int, options: dict) -> None:
    step, params, batches = _mlp()
    hsdp = sw.shard_params(step, "dp", stage, replicate="node", **options)
    sw.testing.assert_equivalent(hsdp, step, HSDP, batches, params, rtol=F64_RTOL)


def test_uneven_shards_and_a_tied_gpt() -> None:
    """Three shards per replica (the units padded to a multiple of 3), and TinyGPT's head tied to its
    embedding's unit, on node 2 x dp 3."""
    step, params, batches = _gpt()
    batches = [(x.repeat(3, 1)[:12], y.repeat(3, 1)[:12]) for x, y in batches]
    hsdp = sw.shard_params(step, "dp", 3, replicate="node")
    sw.testing.assert_equivalent(hsdp, step, sw.Mesh(node=2, dp=3), batches, params, rtol=F64_RTOL)


def test_a_missing_replica_all_reduce_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: without the all-reduce over the replicas each trains on its own rows."""
    from shardwise.engine.run import zero

    class Skipped:  # the handle of an all-reduce that never happened: each replica keeps its own shard
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

        def wait(self) -> torch.Tensor:
            return self.x

    monkeypatch.setattr(zero, "psum_async", lambda x, axis, mesh=None: Skipped(x))
    step, params, batches = _mlp()
    hsdp = sw.shard_params(step, "dp", 3, replicate="node")
    with pytest.raises(AssertionError, match="first divergence at step 1"):
        sw.testing.assert_equivalent(hsdp, step, HSDP, batches, params, rtol=F64_RTOL)


def test_mixed_precision() -> None:
    """A loss scale (unscaled after the all-reduce) in float64 to 1e-12; and bf16 compute against the
    same policy on one device, to 2^-8 as tests/transforms/test_mixed_precision.py argues (each rank's
    gradient is rounded to bf16 once, over its quarter of the batch, the reference once over all)."""
    step, params, batches = _mlp()
    f64 = sw.mixed_precision(step, "params=f64,compute=f64,output=f64", loss_scale=1024.0)
    hsdp = sw.shard_params(f64, "dp", 3, replicate="node")
    sw.testing.assert_equivalent(hsdp, f64, HSDP, batches, params, rtol=F64_RTOL)
    bf16 = sw.mixed_precision(step, "compute=bf16")
    report = sw.testing.assert_equivalent(sw.shard_params(bf16, "dp", 2, replicate="node"), bf16, HSDP, batches,
                                          params, rtol=2**-8)
    assert max(report.max_rel_err) > 0  # bf16 rounding really differs: the comparison is not vacuous


@pytest.mark.parametrize("order", ["pipeline(hsdp)", "hsdp(pipeline)"])
def test_with_a_pipeline_over_a_third_axis(order: str) -> None:
    step, params, batches = _mlp((5, 7, 4, 3, 6))
    if order == "pipeline(hsdp)":
        composed = sw.pipeline(sw.shard_params(step, "dp", 3, replicate="node"), "pp", "1f1b", 2)
    else:
        composed = sw.shard_params(sw.pipeline(step, "pp", "gpipe", 2), "dp", 2, replicate="node")
    sw.testing.assert_equivalent(composed, step, sw.Mesh(node=2, dp=2, pp=2), batches, params, rtol=F64_RTOL)


def test_with_tensor_parallel_over_a_third_axis() -> None:
    step, params, batches = _gpt()
    composed = sw.shard_params(sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan()), "dp", 3, replicate="node")
    sw.testing.assert_equivalent(composed, step, sw.Mesh(node=2, dp=2, tp=2), batches, params, rtol=F64_RTOL)


# -- the Plan -----------------------------------------------------------------------------------


def _ledger_is_the_plan(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> sw.plan.Plan:
    """Each rank issues exactly its Plan's collectives (both axes, in order, with their dtypes and
    bytes) and holds the Plan's bytes (as tests/engine/test_plan_contract.py)."""
    plan = step.plan(mesh, params, batch)

    def run() -> tuple[list, int, int, int]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            state, metrics = step(state, batch)
        got = [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]
        return got, tree_nbytes(state.params), tree_nbytes(state.opt_state), int(metrics["peak_gathered_bytes"])

    for rank, (got, held, opt, peak) in enumerate(sw.launch(run, mesh.size)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}: the ledger differs from the Plan\nledger: {got}\nplan:   {want}"
        assert (held, opt, peak) == (plan.memory["params"][rank], plan.memory["opt_state"][rank],
                                     plan.memory["gathered_peak"][rank])
    return plan


@pytest.mark.parametrize("stage,options,precision", [
    (1, {}, None),
    (2, {"bucket_mb": 1e-4}, "compute=bf16,reduce=bf16"),
    (3, {"accumulation": 2}, None),
    (3, {"reshard_after_forward": False}, "params=f64,compute=f32,output=f64"),
])
def test_the_ledger_is_the_plan_on_both_axes(stage: int, options: dict, precision: str | None) -> None:
    step, params, batches = _mlp()
    if precision is not None:
        step = sw.mixed_precision(step, precision)
    hsdp = sw.shard_params(step, "dp", stage, replicate="node", **options)
    plan = _ledger_is_the_plan(hsdp, HSDP, params, batches[0])
    # Every unit's gradient: reduce-scattered over dp (its padded length), then its shard all-reduced
    # over node, in the reduce dtype; the metrics' psum goes over both axes too.
    layout = hsdp.layout(HSDP, params)
    assert layout.sharding is not None
    reduce = torch.bfloat16 if precision and "reduce=bf16" in precision else torch.float64
    size = torch.empty((), dtype=reduce).element_size()
    units = layout.sharding.units.values()
    comm = plan.comm_bytes()
    # (Stage 3 reduce-scatters each micro-batch's gradients: shard_params' reduce_each_microbatch.)
    reductions = options.get("accumulation", 1) if stage == 3 else 1
    assert comm[("dp", "psum_scatter")] == (sum(u.padded_numel for u in units) * size * reductions,) * 4
    metrics = plan.comm_bytes()[("dp", "psum")][0]  # the metrics' vector, summed over dp then node
    assert comm[("node", "psum")] == (sum(u.shard_numel for u in units) * size + metrics,) * 4
    assert ("node", "all_gather") not in comm and ("node", "psum_scatter") not in comm
    assert plan.memory["replica_buffers"][0] == sum(u.shard_numel for u in units) * size  # all in flight at the end


def test_the_ledger_is_the_plan_with_a_pipeline() -> None:
    step, params, batches = _mlp((5, 7, 4, 3, 6))
    composed = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", 3, replicate="node")
    plan = _ledger_is_the_plan(composed, sw.Mesh(node=2, dp=2, pp=2), params, batches[0])
    # Each unit's micro-batches' shares are summed: its shard goes over the replicas once.
    finals = sum(a.kind == "reduce_scatter" and a.microbatch is None for r in range(8) for a in plan.for_rank(r))
    assert plan.count("reduce_replicas") == plan.count("wait_replicas") == finals < plan.count("reduce_scatter")


def test_memory_is_a_replica_group_s_share() -> None:
    """A rank holds a dp-th of the model, as ZeRO over dp alone (not a (node x dp)-th, as over 4)."""
    step, params, _ = _mlp((8, 16, 16, 8))  # every unit divides by 4: no padding in the comparison
    for stage in (1, 2, 3):
        hsdp = sw.shard_params(step, "dp", stage, replicate="node").plan(HSDP, params).memory
        two = sw.shard_params(step, "dp", stage).plan(sw.Mesh(dp=2), params).memory
        four = sw.shard_params(step, "dp", stage).plan(sw.Mesh(dp=4), params).memory
        for key in ("params", "grads", "opt_state", "gathered_peak"):
            assert hsdp[key][0] == two[key][0], key
        assert hsdp["grads"][0] == 2 * four["grads"][0]  # the gradient shards (the optimizer updates)


def test_the_layout_says_the_replicas() -> None:
    step, params, _ = _mlp()
    layout = sw.shard_params(step, "dp", 3, replicate="node").layout(HSDP, params)
    spec = layout.leaves[("0", "weight")]
    assert (spec.dp_axis, spec.shards, spec.replicate_axis) == ("dp", 2, "node")
    assert "ZeRO-3: kept as a flat shard over 'dp' of 2, replicated over 'node'" in spec.describe()
    assert "replicate='node'" in str(sw.shard_params(step, "dp", 3, replicate="node").sharding_spec)


@pytest.mark.parametrize("there,back", [("hsdp", "flat"), ("flat", "hsdp")])
def test_checkpoints_move_between_hsdp_and_flat_zero3(there: str, back: str, tmp_path: Any) -> None:
    """Saved on one layout after a step, loaded on the other (resharded), the next steps are the
    single-device step's."""
    step, params, batches = _mlp()
    layouts = {"hsdp": (sw.shard_params(step, "dp", 3, replicate="node"), HSDP),
               "flat": (sw.shard_params(step, "dp", 3), sw.Mesh(dp=4))}
    (first, first_mesh), (second, second_mesh) = layouts[there], layouts[back]

    def save() -> None:
        state = first.init(params, first_mesh)
        state, _ = first(state, batches[0])
        sw.checkpoint.save(tmp_path / "ckpt", state, first)

    def resume() -> list:
        state = sw.checkpoint.load(tmp_path / "ckpt", second, second_mesh)
        return sw.testing.record_history(second, state, batches[1:])

    sw.launch(save, first_mesh.size)
    single = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories(sw.launch(resume, second_mesh.size), single[1:], rtol=F64_RTOL)


def test_bad_spellings_are_refused() -> None:
    step, params, _ = _mlp()
    with pytest.raises(TypeError, match=r"spelled shard_params\(step, 'dp', replicate='node'\)"):
        sw.shard_params(step, ("node", "dp"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"replicate=\['node'\].*one mesh axis name"):
        sw.shard_params(step, "dp", replicate=["node"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharded and replicated over the same axis"):
        sw.shard_params(step, "dp", replicate="dp")
    with pytest.raises(ValueError, match=r"replicate='pp'\) and pipeline both use axis 'pp'"):
        sw.pipeline(sw.shard_params(step, "dp", replicate="pp"), "pp", "1f1b", 2)
    with pytest.raises(ValueError, match=r"replicate='tp'\) and tensor_parallel both use axis 'tp'"):
        sw.shard_params(sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}), "dp",
                        replicate="tp")
    with pytest.raises(ValueError, match=r"shard_params\(replicate='node'\): .* has no axis 'node'"):
        sw.shard_params(step, "dp", replicate="node").plan(sw.Mesh(dp=2), params)
