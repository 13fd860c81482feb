"""pipeline runs any valid schedule and equals the single-device step on the whole batch.

float64 on the threads backend: 1e-12 relative, for the reason given in
test_shard_params.py (only the order of the micro-batch sums changes).
SGD with momentum throughout: Adam's scale invariance would hide a wrong 1/m.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing.models import TinyGPT, mlp

F64_RTOL = 1e-12

# name -> (stages per rank, microbatches must be a multiple of the ranks)
BUILTINS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "zb_h1": 1, "zb_v": 2}


def _mlp_problem(depth: int, seed: int, batch: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    widths = [3 + (i * 5) % 7 for i in range(depth + 1)]
    chain, params = sw.functionalize(mlp(widths, "tanh").double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(batch, widths[0], generator=gen, dtype=torch.float64),
                torch.randn(batch, widths[-1], generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


@given(
    name=st.sampled_from(sorted(BUILTINS)),
    p=st.integers(1, 4),
    m_factor=st.integers(1, 3),
    seed=st.integers(0, 100),
)
def test_every_builtin_schedule_equals_single_device(name: str, p: int, m_factor: int, seed: int) -> None:
    v = BUILTINS[name]
    m = p * m_factor
    stages = v * p
    # Enough layers for every stage (an MLP of depth d has 2d - 1 layers), uneven counts on purpose.
    step, params, batches = _mlp_problem(depth=stages + 1, seed=seed, batch=2 * m)
    piped = sw.pipeline(step, "pp", name, m, stages=stages, poison=True)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=p), batches, params, rtol=F64_RTOL)


def test_custom_schedule_as_text_and_as_function() -> None:
    step, params, batches = _mlp_problem(depth=2, seed=0, batch=4)
    text = """
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1
    """
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", text, 2), step, sw.Mesh(pp=2), batches, params,
                                 rtol=F64_RTOL)
    from shardwise.transforms.pipeline import Schedule

    def mine(ranks: int, stages: int, microbatches: int) -> Schedule:
        return Schedule.parse(text)

    sw.testing.assert_equivalent(sw.pipeline(step, "pp", mine, 2), step, sw.Mesh(pp=2), batches, params,
                                 rtol=F64_RTOL)


def test_explicit_uneven_partition() -> None:
    step, params, batches = _mlp_problem(depth=3, seed=1, batch=4)  # 5 layers
    piped = sw.pipeline(step, "pp", "1f1b", 2, partition=[4, 1])
    plan = piped.plan(sw.Mesh(pp=2), params)
    assert plan.memory["params"][1] < plan.memory["params"][0]
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params, rtol=F64_RTOL)


def test_a_partition_of_more_stages_than_the_schedule_runs_names_stages() -> None:
    """interleaved_1f1b on 2 ranks runs 2 stages unless stages= says more: a partition of 4 was refused as
    "gives 4 stages, the schedule has 2", without saying what to pass; with stages=4 it trains."""
    step, params, batches = _mlp_problem(depth=3, seed=1, batch=4)  # 5 layers
    with pytest.raises(ValueError, match=r"partition=\[2, 1, 1, 1\]\) gives 4 stages, and "
                                         r"schedule='interleaved_1f1b' on 2 ranks .* pass stages=4"):
        sw.pipeline(step, "pp", "interleaved_1f1b", 2, partition=[2, 1, 1, 1]).plan(sw.Mesh(pp=2), params)
    piped = sw.pipeline(step, "pp", "interleaved_1f1b", 2, stages=4, partition=[2, 1, 1, 1])
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params, rtol=F64_RTOL)


def test_untied_gpt_pipelined_on_a_dp_pp_mesh_replicates_over_dp() -> None:
    """Under shard_params over dp (stage 1: replicas, as DDP). A pipeline alone on Mesh(dp=2, pp=2) is refused now:
    each dp rank would train its own model on its own batch (session 41's probing)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8, tie_weights=False).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    loss = lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    step = sw.train_step(chain, loss, sw.optim.sgd(0.5, momentum=0.9))
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen))]
    piped = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", 1)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(dp=2, pp=2), batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize("schedule,dp", [("1f1b", 1), ("zb_h1", 1), ("1f1b", 2)])
def test_weights_tied_across_ranks_stay_tied_and_get_the_summed_gradient(schedule: str, dp: int) -> None:
    """A GPT whose output head shares the embedding: stage 0 and the last stage each hold a copy,
    exchange their gradient contributions and take the same update (alone and with ZeRO-3 over dp)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    loss = lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    step = sw.train_step(chain, loss, sw.optim.sgd(0.5, momentum=0.9), clip_norm=1.0)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen)) for _ in range(3)]
    piped = sw.pipeline(step, "pp", schedule, 2)
    mesh = sw.Mesh(pp=2)
    if dp > 1:
        piped, mesh = sw.shard_params(piped, "dp", 3), sw.Mesh(dp=dp, pp=2)
    assert piped.layout(mesh, params).placement.tied == (("tok_emb", "tok_emb.weight", (0, 1)),)
    sw.testing.assert_equivalent(piped, step, mesh, batches, params, rtol=F64_RTOL)

    def copies_agree() -> torch.Tensor:
        state = piped.init(params, sw.Mesh(pp=2))
        for b in batches:
            state, _ = piped(state, b)
        return state.params["tok_emb"]["tok_emb.weight"]

    if dp == 1:
        first, last = sw.launch(copies_agree, 2)
        assert torch.equal(first, last)


def test_trace_gives_a_measured_timeline() -> None:
    from shardwise.transforms.pipeline import Timeline

    step, params, batches = _mlp_problem(depth=2, seed=0, batch=4)
    piped = sw.pipeline(step, "pp", "1f1b", 4, trace=True)
    mesh = sw.Mesh(pp=2)

    def run() -> list:
        state = piped.init(params, mesh)
        _, metrics = piped(state, batches[0])
        return metrics["trace"]

    events = [e for rank_events in sw.launch(run, 2) for e in rank_events]
    assert len(events) == 2 * 2 * 4  # F and B of 4 micro-batches on 2 stages
    timeline = Timeline.from_measured(piped.layout(mesh, params).schedule, events)
    assert 0 <= timeline.bubble_fraction < 1


def test_bad_arguments_are_refused() -> None:
    step, params, batches = _mlp_problem(depth=2, seed=0, batch=6)
    with pytest.raises(ValueError, match="applied twice"):
        sw.pipeline(sw.pipeline(step, "pp"), "pp")
    with pytest.raises(ValueError, match="has no axis 'pp'"):
        sw.pipeline(step, "pp").plan(sw.Mesh(dp=2), params)
    with pytest.raises(ValueError, match="pass the params"):
        sw.pipeline(step, "pp").plan(sw.Mesh(pp=2))
    with pytest.raises(ValueError, match="covers 2 layers but the chain has 3"):
        sw.pipeline(step, "pp", partition=[1, 1]).plan(sw.Mesh(pp=2), params)

    def run() -> None:
        piped = sw.pipeline(step, "pp", "gpipe", 4)
        state = piped.init(params, sw.Mesh(pp=2))
        piped(state, batches[0])

    with pytest.raises(
        sw.collectives.RankFailed,
        match=r"pipeline\(microbatches=4\): batch size 6 .* does not divide into 4 equal parts",
    ):
        sw.launch(run, 2)


@pytest.mark.parametrize("schedule,stages", [("1f1b", None), ("interleaved_1f1b", 4), ("zb_v", None)])
def test_a_rank_failing_mid_step_ends_every_rank_with_its_error(schedule: str, stages: int | None) -> None:
    """The last stage's loss raises in the middle of the second step, while the other rank waits for
    its gradients: no hang, and the error raised is the failing rank's, long before the timeout."""
    step, params, batches = _mlp_problem(depth=5, seed=0, batch=8)
    calls = [0]  # only the rank holding the last stage computes the loss

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 6:  # step 2's second micro-batch
            raise ValueError("the loss broke on purpose")
        return torch.nn.functional.mse_loss(out, target)

    piped = sw.pipeline(sw.train_step(step.chain, loss, step.optimizer), "pp", schedule, 4, stages=stages)
    failing = piped.layout(sw.Mesh(pp=2), params).schedule.placement[-1]

    def run() -> None:
        state = piped.init(params, sw.Mesh(pp=2))
        for batch in batches:
            state, _ = piped(state, batch)

    start = time.monotonic()
    with pytest.raises(sw.collectives.RankFailed, match="the loss broke on purpose") as info:
        sw.launch(run, 2, timeout=30.0)
    assert time.monotonic() - start < 20.0
    assert info.value.rank == failing
    assert calls[0] == 6


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("order", ["pipeline(shard_params)", "shard_params(pipeline)"])
def test_composed_with_shard_params_on_a_dp_pp_mesh(stage: int, order: str) -> None:
    """dp=2 x pp=2: each stage's parameters ZeRO-sharded over dp; the order of the transforms does not matter."""
    step, params, batches = _mlp_problem(depth=3, seed=4, batch=8)
    if order == "pipeline(shard_params)":
        composed = sw.pipeline(sw.shard_params(step, "dp", stage), "pp", "1f1b", 2)
    else:
        composed = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", stage)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, pp=2), batches, params, rtol=F64_RTOL)


def test_composition_holds_only_this_ranks_shard() -> None:
    step, params, batches = _mlp_problem(depth=3, seed=4, batch=8)
    composed = sw.pipeline(sw.shard_params(step, "dp", 3), "pp", "gpipe", 2)
    mesh = sw.Mesh(dp=2, pp=2)

    def held() -> int:
        state = composed.init(params, mesh)
        state, _ = composed(state, batches[0])
        return sum(t.numel() for t in state.params.values())

    total = sum(t.numel() for layer in params.values() for t in layer.values())
    counts = sw.launch(held, 4)
    assert sum(counts) <= total + 4 * 2  # every element once, plus padding (< dp per unit)
    assert max(counts) < total / 2


def test_composition_refuses_what_cannot_work() -> None:
    step, _, _ = _mlp_problem(depth=2, seed=0, batch=4)
    with pytest.raises(ValueError, match="both use axis 'pp'"):
        sw.shard_params(sw.pipeline(step, "pp"), "pp")
    # In either order: the pipeline's micro-batches are the accumulation.
    with pytest.raises(ValueError, match="micro-batches are the accumulation; drop accumulation"):
        sw.shard_params(sw.pipeline(step, "pp"), "dp", accumulation=2)
    with pytest.raises(ValueError, match="micro-batches are the accumulation; drop accumulation"):
        sw.pipeline(sw.shard_params(step, "dp", accumulation=2), "pp")


def test_transfers_carry_only_the_tensors_when_layouts_are_predicted() -> None:
    """Boundary layouts are predicted on fake tensors, so a transfer is its tensors alone: no count
    message and (on torch.distributed) no header."""
    step, params, batches = _mlp_problem(depth=2, seed=0, batch=4)
    piped = sw.pipeline(step, "pp", "1f1b", 4)
    mesh = sw.Mesh(pp=2)

    def sends() -> list[tuple[str, tuple[int, ...]]]:
        state = piped.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            piped(state, batches[0])
        return [(r.dtype, r.shape) for r in ledger.records if r.op == "send"]

    first, last = sw.launch(sends, 2)
    assert len(first) == len(last) == 4 and all(dtype == "float64" for dtype, _ in first + last)


def test_a_stage_whose_output_shape_depends_on_data_falls_back_to_announced_transfers() -> None:
    """Fake tensors cannot say how many entries ``x[x > 0]`` keeps: every rank then announces."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64)
    chain = sw.Chain([
        sw.Layer("lin", lambda p, x: x @ p["w"], ("w",)),
        sw.Layer("keep_positive", lambda p, x: x[x > 0]),
        sw.Layer("sum", lambda p, x: (x * p["s"]).sum().reshape(1), ("s",)),
    ])
    params = {"lin": {"w": w}, "keep_positive": {}, "sum": {"s": torch.tensor(2.0, dtype=torch.float64)}}
    step = sw.train_step(chain, lambda out, t: ((out - t) ** 2).mean(), sw.optim.sgd(0.1, momentum=0.9))
    piped = sw.pipeline(step, "pp", "gpipe", 1, partition=[2, 1])
    batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randn(1, dtype=torch.float64)) for _ in range(2)]
    assert piped.boundaries(piped.layout(sw.Mesh(pp=2), params), batches[0][0]) is None
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params, rtol=F64_RTOL)


class _Kept(NamedTuple):
    values: torch.Tensor
    count: torch.Tensor


def _data_dependent_structured_problem() -> tuple[sw.Step, Any, list[Any]]:
    """A stage whose output has data-dependent shapes and a structure (a named tuple in a dict)."""
    torch.manual_seed(0)
    chain = sw.Chain([
        sw.Layer("lin", lambda p, x: x @ p["w"], ("w",)),
        sw.Layer("keep_positive", lambda p, x: {"kept": _Kept(x[x > 0], (x > 0).sum().to(x.dtype)), "x": x}),
        sw.Layer("sum", lambda p, d: ((d["kept"].values * p["s"]).sum() + d["kept"].count + d["x"].sum()).reshape(1),
                 ("s",)),
    ])
    params = {"lin": {"w": torch.randn(3, 3, dtype=torch.float64)}, "keep_positive": {},
              "sum": {"s": torch.tensor(2.0, dtype=torch.float64)}}
    step = sw.train_step(chain, lambda out, t: ((out - t) ** 2).mean(), sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    f64 = {"dtype": torch.float64, "generator": gen}
    batches = [(torch.randn(4, 3, **f64), torch.randn(1, **f64)) for _ in range(2)]
    return step, params, batches


def test_an_unpredicted_stage_output_with_a_structure_travels_with_it() -> None:
    """Where the Plan predicts no boundary, a structured output (a dict holding a named tuple) goes with
    its pytree structure ahead of its tensors; it was refused (only a tensor or a flat tuple was rebuilt)."""
    step, params, batches = _data_dependent_structured_problem()
    piped = sw.pipeline(step, "pp", "gpipe", 1, partition=[2, 1])
    assert piped.boundaries(piped.layout(sw.Mesh(pp=2), params), batches[0][0]) is None
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params, rtol=F64_RTOL)


def test_an_unpredicted_stage_output_holding_a_class_optree_does_not_flatten_is_refused_naming_it() -> None:
    """A dataclass optree leaves whole: refused by name (it reached the send as a leaf without detach)."""
    import dataclasses

    @dataclasses.dataclass
    class Kept:
        values: torch.Tensor

    step, params, batches = _data_dependent_structured_problem()
    chain = sw.Chain([step.chain[0], sw.Layer("keep_positive", lambda p, x: {"kept": Kept(x[x > 0]), "x": x}),
                      sw.Layer("sum", lambda p, d: ((d["kept"].values * p["s"]).sum() + d["x"].sum()).reshape(1),
                               ("s",))])
    step = sw.train_step(chain, step.loss_fn, step.optimizer)
    piped = sw.pipeline(step, "pp", "gpipe", 1, partition=[2, 1])
    with pytest.raises(sw.collectives.RankFailed, match=r"stage 0 passes a Kept to the next rank.*register the class"):
        sw.launch(lambda: piped(piped.init(params, sw.Mesh(pp=2)), batches[0]), 2)


def _frozen_front_gpt(frozen_blocks: int):  # type: ignore[no-untyped-def]
    """TinyGPT with its embeddings (and its first ``frozen_blocks`` blocks) frozen, the usual fine-tuning
    setup: the layers in front train nothing, and the batch they take needs no gradient."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=3, seq_len=8, tie_weights=False).double()
    model.tok_emb.requires_grad_(False)
    model.pos_emb.requires_grad_(False)
    for block in model.blocks[:frozen_blocks]:
        block.requires_grad_(False)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    tokens = torch.randint(32, (8, 9), generator=torch.Generator().manual_seed(1))
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    return step, params, [(tokens[:, :-1], tokens[:, 1:])] * 2


@pytest.mark.parametrize(
    ("schedule", "pp", "partition", "frozen_blocks", "trained_from"),
    [
        ("gpipe", 4, (1, 1, 2, 1), 0, 1),  # the frozen embedding alone on rank 0 (it failed in the backward)
        ("1f1b", 2, (2, 3), 1, 1),
        ("zb_h1", 3, (1, 2, 2), 2, 2),  # a frozen stage in front of a frozen stage
        ("zb_v", 2, (1, 1, 2, 1), 0, 1),  # rank 0 holds the frozen stage 0 and the last, trained, stage
        ("interleaved_1f1b", 2, (1, 1, 2, 1), 0, 1),
    ],
)
def test_stages_in_front_that_train_nothing_get_no_gradient_and_run_no_backward(
    schedule: str, pp: int, partition: tuple[int, ...], frozen_blocks: int, trained_from: int
) -> None:
    """Nothing flows back to a stage whose layers and those before it hold no trainable parameter: the
    Plan gives it no backward and no gradient transfer, the stage after it sends none down, the ledger
    is the Plan's, and the step equals the single-device step."""
    step, params, batches = _frozen_front_gpt(frozen_blocks)
    piped = sw.pipeline(step, "pp", schedule, 4, stages=len(partition), partition=partition)
    mesh = sw.Mesh(pp=pp)
    plan = piped.plan(mesh, params, batches[0])
    computes = [a for r in range(pp) for a in plan.for_rank(r)]
    assert {a.stage for a in computes if a.kind in ("backward", "backward_input", "backward_weight")} == set(
        range(trained_from, len(partition)))
    assert all(a.stage > trained_from for a in computes if a.kind == "send_grad")
    assert all(a.stage >= trained_from for a in computes if a.kind == "recv_grad")

    def ledger() -> list[tuple[str, str | None, str, int]]:
        state = piped.init(params, mesh)
        with sw.collectives.comm_ledger() as records:
            piped(state, batches[0])
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in records.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(ledger, pp)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
    sw.testing.assert_equivalent(piped, step, mesh, batches, params, rtol=F64_RTOL)
    sw.testing.assert_equivalent(sw.shard_params(piped, "dp", 3), step, sw.Mesh(dp=2, pp=pp), batches, params,
                                 rtol=F64_RTOL)


@pytest.mark.parametrize("clip_norm", [None, 0.05], ids=["update-first", "clip-waits-for-the-norm"])
def test_step_ends_with_grads_then_metrics_then_update_and_reports_the_global_metrics(clip_norm: float | None) -> None:
    torch.manual_seed(3)
    chain, params = sw.functionalize(mlp([4, 6, 5, 3], "tanh").double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=clip_norm)
    gen = torch.Generator().manual_seed(4)
    batch = (
        torch.randn(8, 4, generator=gen, dtype=torch.float64),
        torch.randn(8, 3, generator=gen, dtype=torch.float64),
    )
    piped = sw.pipeline(step, "pp", "1f1b", 4)
    mesh = sw.Mesh(pp=2)
    for actions in piped.plan(mesh, params).actions:
        kinds = [a.kind for a in actions]
        # The metrics' all-reduce starts once the gradients are final; the update waits for it only
        # when clipping needs the global norm, otherwise it runs while the all-reduce completes.
        tail = ["finish_grads", "reduce_metrics", "wait_metrics", "update"] if clip_norm else [
            "finish_grads", "reduce_metrics", "update", "wait_metrics"]
        assert kinds[-4:] == tail

    def run() -> tuple[dict, dict]:
        state, metrics = piped(piped.init(params, mesh), batch)
        return piped.full_params(state), metrics

    ref_state, ref_metrics = step(step.init(params), batch)
    for full, metrics in sw.launch(run, 2):
        assert torch.allclose(metrics["loss"], ref_metrics["loss"], rtol=F64_RTOL, atol=0)
        assert torch.allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=F64_RTOL, atol=0)
        for layer, tensors in ref_state.params.items():
            for name, t in tensors.items():
                assert torch.allclose(full[layer][name], t, rtol=F64_RTOL, atol=1e-15)
    if clip_norm is not None:  # the clip really acted, so the update used the global norm
        assert float(ref_metrics["grad_norm"]) > clip_norm
