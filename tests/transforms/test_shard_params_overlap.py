"""ZeRO-1/2 with ``overlap_gather=True`` (the default off a CPU): the all-gather of the updated
shards overlaps the next forward.

The step returns with its all-gathers in flight; the next step waits for each bucket before its
first forward. Nothing about the arithmetic changes (the same update, the same gathered bytes),
so every comparison with the step that waits at its end (``overlap_gather=False``) is exact:
``torch.equal``, float64, over several steps without a read between them (a read waits for the
gathers, so ``assert_equivalent``, which reads ``full_params`` after every step, never sees one in
flight). The single-device step is the reference at 1e-12 relative, as in test_shard_params.py.
Every read path must see the updated parameters: indexing, iterating, optree, pickling,
``full_params``, ``sw.checkpoint.save``; and an older state stays valid.
"""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.layout.in_flight import InFlightParams
from shardwise.testing.models import TinyGPT, mlp

F64_RTOL = 1e-12
KIB = 1 / 1024


def _problem(world: int = 2, optimizer: str = "sgd") -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 8, 8, 8, 5]).double())
    opt = sw.optim.sgd(lr=0.1, momentum=0.9) if optimizer == "sgd" else sw.optim.adamw(1e-2, weight_decay=0.1)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, opt, clip_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * world, 6, generator=gen, dtype=torch.float64),
                torch.randn(4 * world, 5, generator=gen, dtype=torch.float64)) for _ in range(4)]
    return step, params, batches


def _copy(params: Any) -> dict:
    return {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}


def _equal(a: Any, b: Any) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _run(step: sw.Step, params: dict, batches: list, world: int, mesh: sw.Mesh | None = None,
         read_between: bool = False) -> list:
    """Each rank's (losses, in-flight buckets when the last step returned, final params, opt_state).
    ``read_between``: the parameters read after every step (as a user may), so that every next step
    cuts its shards again out of them instead of starting from the shards the last one carried."""

    def program() -> tuple:
        state = step.init(params, mesh or sw.Mesh(dp=world))
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
            if read_between:
                _copy(state.params)
                assert not isinstance(state.params, InFlightParams) or state.params.exposed
        in_flight = state.params.in_flight if isinstance(state.params, InFlightParams) else None
        return losses, in_flight, _copy(state.params), state.opt_state

    return sw.launch(program, world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("options", [
    {"bucket_mb": 0.3 * KIB}, {"bucket_mb": 1.1 * KIB}, {"bucket_mb": 1.0},
    {"bucket_mb": 1.1 * KIB, "update_in_buckets": True}, {"accumulation": 2},
], ids=["each-unit", "pairs", "one-bucket", "update-in-buckets", "accumulation"])
def test_overlapped_steps_equal_the_waiting_ones_bitwise(world: int, stage: int, options: dict) -> None:
    """Against the step that waits at its end and whose state is read after every step (each next
    step cuts its shards again), and the waiting one that carries its shards as the overlap does."""
    base, params, batches = _problem(world, "adamw" if options.get("update_in_buckets") else "sgd")
    got = _run(sw.shard_params(base, "dp", stage, overlap_gather=True, **options), params, batches, world)
    waiting = sw.shard_params(base, "dp", stage, overlap_gather=False, **options)
    want = _run(waiting, params, batches, world, read_between=True)
    carried = _run(waiting, params, batches, world)
    reference = base.init(params)
    for batch in batches:
        reference, _ = base(reference, batch)
    for (losses, in_flight, final, opt), (w_losses, _, w_final, w_opt), c in zip(got, want, carried, strict=True):
        assert in_flight and in_flight > 0 and c[1] == 0  # the last step's gathers in flight; waited for
        for other_losses, other_final, other_opt in ((w_losses, w_final, w_opt), (c[0], c[2], c[3])):
            assert all(torch.equal(a, b) for a, b in zip(losses, other_losses, strict=True))
            assert _equal(final, other_final) and _equal(opt, other_opt)
        for layer, tensors in reference.params.items():
            for name, value in tensors.items():
                torch.testing.assert_close(final[layer][name], value, rtol=F64_RTOL, atol=0)


def test_the_plan_waits_before_each_buckets_first_forward_and_issues_at_the_end() -> None:
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)
    plan = step.plan(sw.Mesh(dp=2), params, batches[0])
    text = " ".join(map(str, plan.for_rank(0)))
    assert text.startswith("wait_params(2+0) F(0, mb=0) F(1, mb=0) F(2, mb=0) F(3, mb=0) wait_params(6+4) F(4, mb=0)")
    # Gathered in the order the next forward needs them (2+0 first: its wait comes first); clipping
    # waits for the metrics before the update.
    assert text.endswith("wait_metrics update gather_params(2+0) gather_params(6+4)")
    assert "wait_params before gather_params: the previous step's, in flight" in str(plan)
    waiting_plan = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=False).plan(sw.Mesh(dp=2), params)
    assert "previous step's" not in str(waiting_plan)
    waiting = " ".join(map(str, waiting_plan.for_rank(0)))
    assert waiting.startswith("F(0, mb=0)") and waiting.endswith(
        "gather_params(6+4) gather_params(2+0) wait_params(6+4) wait_params(2+0)")
    # The updated parameters the gathers bring, from their issue across the step's end: every
    # unit's padded float64 buffer (56, 72, 72 and 45 -> 46 elements at dp 2).
    assert plan.memory["params_in_flight"] == ((56 + 72 + 72 + 46) * 8,) * 2
    assert plan.memory["peak"][0] >= plan.memory["params"][0] + plan.memory["params_in_flight"][0]
    # The simulator waits for the previous step's gathers, on the link from time 0 in their order:
    # 2+0 over [0, 5], 6+4 over [5, 10]; a forward costs 1, so the first forward starts at 5, and
    # wait_params(6+4), after four, ends at 10.
    comm = sw.plan.CommModel(alpha={"all_gather": 5.0, "psum_scatter": 0.0, "psum": 0.0})
    timeline = sw.simulate(plan, sw.plan.PlanCosts(comm=comm))
    for rank in (0, 1):
        waits = [(s.position, s.end) for s in timeline.ranks[rank] if s.action.kind == "wait_params"]
        assert waits == [(0, 5.0), (5, 10.0)]


def test_the_ledger_of_every_step_is_the_plans() -> None:
    """Several steps in a row, each issuing what the Plan lists (its gathers at its end, in flight
    into the next), and the waits issue nothing."""
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)
    mesh = sw.Mesh(dp=2)
    plan = step.plan(mesh, params, batches[0])

    def program() -> list:
        state = step.init(params, mesh)
        per_step = []
        for batch in batches:
            with sw.collectives.comm_ledger() as ledger:
                state, _ = step(state, batch)
            per_step.append([(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank])
        return per_step

    for rank, per_step in enumerate(sw.launch(program, 2)):
        expected = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert per_step == [expected] * len(batches)


def test_every_read_between_steps_sees_the_updated_params() -> None:
    """Indexing, iterating, len, in, repr, optree, pickle, torch.save, deepcopy, full_params: each
    waits for the gathers in flight first, and sees what the waiting step returns."""
    base, params, batches = _problem()
    mesh = sw.Mesh(dp=2)
    overlapped = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)
    waiting = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=False)

    def reads() -> list[tuple[str, Any]]:
        def stepped() -> Any:
            state = overlapped.init(params, mesh)
            for batch in batches[:2]:
                state, _ = overlapped(state, batch)
            assert isinstance(state.params, InFlightParams) and state.params.in_flight == 2
            return state

        buffer = io.BytesIO()
        torch.save(stepped(), buffer)
        buffer.seek(0)
        out = [
            ("index", {k: stepped().params[k] for k in ("0", "2", "4", "6")}),
            ("items", dict(stepped().params.items())),
            ("optree", optree.tree_map(lambda t: t, stepped().params)),
            ("state optree", optree.tree_map(lambda t: t, stepped()).params),
            ("pickle", pickle.loads(pickle.dumps(stepped().params))),
            ("torch.save", torch.load(buffer, weights_only=False).params),
            ("deepcopy", copy.deepcopy(stepped().params)),
            ("full_params", overlapped.full_params(stepped())),
            ("copy", stepped().params.copy()),
        ]
        s = stepped()
        out.append(("iter", {k: s.params[k] for k in s.params}))
        s = stepped()
        assert len(s.params) == 7 and "0" in s.params and s.params.in_flight == 0 and s.params.exposed
        assert "tensor(" in repr(stepped().params)
        state = waiting.init(params, mesh)
        for batch in batches[:2]:
            state, _ = waiting(state, batch)
        return [(name, (got, _copy(state.params))) for name, got in out]

    for per_rank in sw.launch(reads, 2):
        for name, (got, want) in per_rank:
            want = {k: want[k] for k in got} if name == "index" else want
            assert type(got) is dict and _equal(got, want), name


def test_paths_flatten_as_a_dicts() -> None:
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 1, overlap_gather=True)

    def paths() -> tuple:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
        plain = dict(state.params)
        return (optree.tree_flatten_with_path(state.params)[0], optree.tree_flatten_with_path(plain)[0])

    for got, want in sw.launch(paths, 2):
        assert got == want


def test_an_older_state_stays_valid_and_steps_again_alike() -> None:
    """Step k waits (in its forward) for the gathers state k-1 carried: state k-1 then reads as the
    waiting step's state k-1, and stepping it again gives step k's result again, bitwise."""
    base, params, batches = _problem(optimizer="adamw")
    mesh = sw.Mesh(dp=2)
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)
    waiting = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=False)

    def program() -> tuple:
        s0 = step.init(params, mesh)
        s1, _ = step(s0, batches[0])
        s2, m2 = step(s1, batches[1])
        again, m_again = step(s1, batches[1])  # the older state, stepped a second time
        s3, _ = step(again, batches[2])
        w1, _ = waiting(waiting.init(params, mesh), batches[0])
        w2, _ = waiting(w1, batches[1])
        w3, _ = waiting(w2, batches[2])
        return (_equal(_copy(s1.params), _copy(w1.params)), _equal(_copy(s2.params), _copy(again.params)),
                torch.equal(m2["loss"], m_again["loss"]), _equal(_copy(s3.params), _copy(w3.params)),
                _equal(s3.opt_state, w3.opt_state))

    for checks in sw.launch(program, 2):
        assert all(checks), checks


def test_a_read_state_is_cut_again_from_what_was_read() -> None:
    """Once the parameters were read, the next step cuts its shards out of them again (as from any
    state), so a change made to the parameters read is not lost behind the carried shards."""
    base, params, batches = _problem()
    mesh = sw.Mesh(dp=2)
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)

    def program() -> bool:
        state, _ = step(step.init(params, mesh), batches[0])
        with torch.no_grad():
            state.params["0"]["weight"].zero_()  # a user's edit, in place
        state, _ = step(state, batches[1])
        # the reference: the same edit made to the first step's result, held as a plain dict
        first, _ = step(step.init(params, mesh), batches[0])
        fixed = {k: dict(v) for k, v in first.params.items()}
        fixed["0"]["weight"] = torch.zeros_like(fixed["0"]["weight"])
        return _equal(_copy(state.params), _copy(step(first._replace(params=fixed), batches[1])[0].params))

    assert all(sw.launch(program, 2))


def test_a_checkpoint_saved_between_steps_is_the_waiting_steps(tmp_path: Path) -> None:
    base, params, batches = _problem(optimizer="adamw")
    mesh = sw.Mesh(dp=2)
    steps = {"overlap": sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True),
             "waiting": sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=False)}

    def program(name: str) -> tuple:
        step = steps[name]
        state = step.init(params, mesh)
        for batch in batches[:2]:
            state, _ = step(state, batch)
        sw.checkpoint.save(tmp_path / name, state, step)  # the gathers in flight: it waits for them
        state, _ = step(state, batches[2])
        loaded = sw.checkpoint.load(tmp_path / name, steps["overlap"], mesh)
        loaded, _ = steps["overlap"](loaded, batches[2])
        return _copy(state.params), _copy(loaded.params), loaded.opt_state

    got = sw.launch(lambda: program("overlap"), 2)
    want = sw.launch(lambda: program("waiting"), 2)
    for (g_params, g_loaded, g_opt), (w_params, w_loaded, w_opt) in zip(got, want, strict=True):
        assert _equal(g_params, w_params) and _equal(g_loaded, w_loaded) and _equal(g_opt, w_opt)
        assert _equal(g_params, g_loaded)  # resumed from the checkpoint: the same third step
    files = sorted(p.relative_to(tmp_path / "overlap") for p in (tmp_path / "overlap").rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".distcp"]) == 2
    for f in files:
        if f.suffix == ".distcp":  # the tensors (the metadata names the stack, overlap_gather=False too)
            assert (tmp_path / "overlap" / f).read_bytes() == (tmp_path / "waiting" / f).read_bytes(), f


def test_composed_with_precision_hsdp_and_a_pipeline() -> None:
    """The overlap under a precision policy (each bucket cast to compute copies at its wait), HSDP
    (gathered over the shard axis), and a pipeline (each rank's own units): the waiting step's results.
    (A policy that widens: one that narrows holds shards at rest, and gathers no updated parameters.)"""
    base, params, batches = _problem(4)
    policy = sw.mixed_precision(base, "params=f32,compute=f64,output=f64")
    cases = [
        (lambda b, **o: sw.shard_params(policy, "dp", 2, bucket_mb=1.1 * KIB, **o), sw.Mesh(dp=2), 2),
        (lambda b, **o: sw.shard_params(b, "dp", 1, replicate="node", **o), sw.Mesh(node=2, dp=2), 4),
        (lambda b, **o: sw.shard_params(sw.pipeline(b, "pp", "1f1b", 2), "dp", 2, **o), sw.Mesh(dp=2, pp=2), 4),
    ]
    for make, mesh, world in cases:
        got = _run(make(base, overlap_gather=True), params, batches, world, mesh)
        want = _run(make(base, overlap_gather=False), params, batches, world, mesh)
        for g, w in zip(got, want, strict=True):
            assert g[1] and g[1] > 0
            assert all(torch.equal(a, b) for a, b in zip(g[0], w[0], strict=True))
            assert _equal(g[2], w[2]) and _equal(g[3], w[3])


def test_bad_overlap_options_are_refused() -> None:
    base, _, _ = _problem()
    with pytest.raises(TypeError, match=r"overlap_gather='yes'.*True, False or None"):
        sw.shard_params(base, "dp", 2, overlap_gather="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlap of that gather with the next forward is for stages 1 and 2"):
        sw.shard_params(base, "dp", 3, overlap_gather=True)
    assert "overlap_gather=False" in str(sw.shard_params(base, "dp", 2, overlap_gather=False).transforms[-1])


def test_the_default_overlaps_off_a_cpu_only() -> None:
    """On a CPU the step waits at its end (gloo measured no gain); elsewhere it overlaps."""
    base, _, _ = _problem()
    spec = sw.shard_params(base, "dp", 2).transforms[-1]
    assert (spec.overlaps_gather("cpu"), spec.overlaps_gather("meta"), spec.overlaps_gather("cuda")) == (
        False, False, True)
    assert sw.shard_params(base, "dp", 1, overlap_gather=True).transforms[-1].overlaps_gather("cpu") is True
    assert sw.shard_params(base, "dp", 1, overlap_gather=False).transforms[-1].overlaps_gather("cuda") is False
    assert sw.shard_params(base, "dp", 3).transforms[-1].overlaps_gather("cuda") is False


def _gloo_rank(world: int, overlap: bool, read_between: bool) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    base = sw.train_step(chain, lm_loss, sw.optim.sgd(0.5, momentum=0.9))
    step = sw.shard_params(base, "dp", 2, bucket_mb=0.01, overlap_gather=overlap)
    gen = torch.Generator().manual_seed(1)
    state = step.init(params, sw.Mesh(dp=world))
    losses, reads = [], []
    for _ in range(4):
        batch = (torch.randint(32, (2 * world, 8), generator=gen), torch.randint(32, (2 * world, 8), generator=gen))
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if read_between:
            reads.append(_copy(state.params))
    return losses, reads, state  # the state pickles back (its gathers waited for in this process)


@pytest.mark.gloo
@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_on_gloo_processes_the_overlap_changes_no_bit(pool_name: str, request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(pool_name)
    world = int(pool_name[-1])
    got = pool.run(_gloo_rank, world, True, False)
    read = pool.run(_gloo_rank, world, True, True)
    want = pool.run(_gloo_rank, world, False, True)
    for (g_losses, _, g_state), (r_losses, r_reads, _), (w_losses, w_reads, w_state) in zip(
            got, read, want, strict=True):
        assert type(g_state.params) is dict  # pickled as the plain dict it stands for
        assert all(torch.equal(a, b) for a, b in zip(g_losses, w_losses, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(r_losses, w_losses, strict=True))
        assert all(_equal(a, b) for a, b in zip(r_reads, w_reads, strict=True))
        assert _equal(g_state.params, w_state.params) and _equal(g_state.opt_state, w_state.opt_state)


def test_assert_equivalent_checks_the_carried_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker reads the full parameters after every step. Read as a user's read, that made each
    next step cut its shards again from them, so the checker certified that path and never the
    carried shards (state.params.shards) a run without reads starts from: a wrong carried shard
    passed it. Corrupt the carried shards: the checker must see it."""
    from shardwise.engine.step import run_inputs

    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=True)
    report = sw.testing.assert_equivalent(step, base, sw.Mesh(dp=2), batches, params)
    assert report.steps == len(batches)
    made = run_inputs._in_flight

    def corrupted(executor: Any) -> InFlightParams:
        carried = made(executor)
        carried.shards = {u: t + 1e-3 for u, t in carried.shards.items()}
        return carried

    monkeypatch.setattr(run_inputs, "_in_flight", corrupted)
    with pytest.raises(sw.testing.NotEquivalentError):
        sw.testing.assert_equivalent(step, base, sw.Mesh(dp=2), batches, params)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_that_raises_midway_leaves_the_state_usable(stage: int) -> None:
    """A step that raises after it waited for some of the carried buckets (a bad batch shape in the
    first layer, a loss that raises after the forward): the state it was given still holds every
    bucket, waited for or not, and the next steps are the waiting run's, bitwise."""
    base, params, batches = _problem()
    mesh = sw.Mesh(dp=2)
    got_step = sw.shard_params(base, "dp", stage, bucket_mb=1.1 * KIB, overlap_gather=True)
    want_step = sw.shard_params(base, "dp", stage, bucket_mb=1.1 * KIB, overlap_gather=False)
    raising = sw.train_step(base.chain, lambda out, y: (_ for _ in ()).throw(RuntimeError("loss")), base.optimizer)
    raising = sw.shard_params(raising, "dp", stage, bucket_mb=1.1 * KIB, overlap_gather=True)

    def program() -> tuple:
        state, _ = got_step(got_step.init(params, mesh), batches[0])
        carried = state.params
        assert isinstance(carried, InFlightParams) and carried.in_flight == 2
        with pytest.raises(RuntimeError):
            got_step(state, (batches[1][0][:, :5], batches[1][1]))  # the first layer refuses the shape
        assert carried.in_flight == 1  # its bucket waited for, the other still in flight
        with pytest.raises(RuntimeError, match="loss"):
            raising(state, batches[1])  # every bucket waited for, then the loss raises
        assert carried.in_flight == 0 and not carried.exposed
        for batch in batches[1:]:
            state, _ = got_step(state, batch)
        want = want_step.init(params, mesh)
        for batch in batches:
            want, _ = want_step(want, batch)
        return _equal(_copy(state.params), _copy(want.params)) and _equal(state.opt_state, want.opt_state)

    assert all(sw.launch(program, 2))


def test_frozen_groups_a_skipped_step_and_a_read_from_another_thread() -> None:
    """A frozen parameter group, a step the loss scale skips, and the parameters read from a thread
    that is no rank after the launch: the waiting run's results, bitwise."""
    import threading

    _, params, batches = _problem()
    frozen = sw.optim.sgd(lr=0.1, momentum=0.9, groups=[sw.optim.group("0.*", frozen=True)])
    torch.manual_seed(0)
    chain, _ = sw.functionalize(mlp([6, 8, 8, 8, 5]).double())
    base = sw.train_step(chain, torch.nn.functional.mse_loss, frozen)
    # (f16 stored too: a policy that narrows holds shards at rest, and gathers no updated parameters)
    scaled = sw.mixed_precision(base, "params=f16,compute=f16,output=f64", loss_scale="dynamic")
    overflow = [batches[0], (batches[1][0] * 1e6, batches[1][1]), *batches[2:]]
    for make in (lambda **o: sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, **o),
                 lambda **o: sw.shard_params(scaled, "dp", 1, bucket_mb=1.1 * KIB, **o)):
        got = sw.launch(lambda make=make: _states(make(overlap_gather=True), params, overflow), 2)
        want = sw.launch(lambda make=make: _states(make(overlap_gather=False), params, overflow), 2)
        for (g_state, g_skipped), (w_state, w_skipped) in zip(got, want, strict=True):
            assert g_skipped == w_skipped
            assert isinstance(g_state.params, InFlightParams) and g_state.params.in_flight > 0
            read: dict = {}
            thread = threading.Thread(target=lambda s=g_state, out=read: out.update(_copy(s.params)))
            thread.start()
            thread.join(timeout=30)
            assert _equal(read, _copy(w_state.params)) and _equal(g_state.opt_state, w_state.opt_state)
            frozen_weight = read["0"]["weight"]  # never updated: the given one, in the stored dtype
            assert torch.equal(frozen_weight, params["0"]["weight"].to(frozen_weight.dtype))


def _states(step: sw.Step, params: dict, batches: list) -> tuple[Any, list[float]]:
    state = step.init(params, sw.Mesh(dp=2))
    skipped = []
    for batch in batches:
        state, metrics = step(state, batch)
        skipped.append(float(metrics.get("skipped", 0.0)))
    return state, skipped


@pytest.mark.parametrize("overlap", [True, False])
def test_shards_are_cut_from_the_full_parameters_only_after_a_read(
        overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step hands its shards on beside the full parameters (waited for or in flight): the next
    update starts from them, so only the first step (from init's full parameters) and a step after a
    read cut shards out of full parameters (a copy of 1/world of the model each time)."""
    from shardwise.engine.layout.sharding import FlatSharding

    cuts: list[int] = []
    cut = FlatSharding.shards_of

    def counted(self: FlatSharding, params: Any, index: int) -> dict[str, torch.Tensor]:
        cuts.append(index)
        return cut(self, params, index)

    monkeypatch.setattr(FlatSharding, "shards_of", counted)
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 2, bucket_mb=1.1 * KIB, overlap_gather=overlap)

    def program() -> bool:
        state = step.init(params, sw.Mesh(dp=2))
        for batch in batches[:3]:
            state, _ = step(state, batch)
        carried = isinstance(state.params, InFlightParams) and not state.params.exposed
        _copy(state.params)  # a read
        state, _ = step(state, batches[3])
        return carried

    assert all(sw.launch(program, 2))
    assert sorted(cuts) == [0, 0, 1, 1]  # each rank: the first step, and the step after the read
