"""mixed_precision: policies, loss scales, exactness against eager torch, distribution, overflow skips."""

from __future__ import annotations

import io

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.layout.precision import DynamicLossScale, NoLossScale, Policy, StaticLossScale
from shardwise.testing.models import mlp

# -- policies and loss scales ------------------------------------------------------------------

def test_policy_grammar_long_and_short_keys() -> None:
    p = Policy.parse("params=f32,compute=bf16,output=f32")
    assert (p.params, p.compute, p.output, p.reduce) == (torch.float32, torch.bfloat16, torch.float32, torch.float32)
    assert Policy.parse("p=f32, c=f16, o=f16, r=bf16") == Policy(torch.float32, torch.float16, torch.float16,
                                                                   torch.bfloat16)
    assert Policy.parse(str(p)) == p
    assert Policy.parse("compute=f32", base=p) == Policy()
    with pytest.raises(ValueError, match="unknown dtype 'f8'"):
        Policy.parse("compute=f8")
    with pytest.raises(ValueError, match="cannot read 'weights=f32'"):
        Policy.parse("weights=f32")


def test_keys_not_given_follow_jmp_and_reduce_follows_the_master_dtype() -> None:
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    assert Policy.parse("params=f64,compute=f64,output=f64") == Policy(f64, f64, f64, f64)
    assert Policy.parse("params=f64") == Policy(f64, f64, f64, f64)
    assert Policy.parse("compute=bf16") == Policy(f32, bf16, bf16, f32)
    assert Policy.parse("params=f32,compute=bf16,output=f32") == Policy(f32, bf16, f32, f32)
    assert Policy.parse("") == Policy()
    with pytest.raises(ValueError, match="compute is given twice"):
        Policy.parse("compute=bf16,c=f32")


def test_an_all_f64_policy_keeps_zero3_exact() -> None:
    """The policy the issue saw reduce in f32 (3e-8 off): every dtype f64 now, so ZeRO-3 matches
    the single-device step to float64 rounding."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 7, 3]).double())
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    policy = "params=f64,compute=f64,output=f64"
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 5, generator=gen, dtype=torch.float64), torch.randn(4, 3, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    sharded = sw.shard_params(sw.mixed_precision(base, policy), "dp", 3)
    reduce_dtypes = {w.dtype for a in sharded.plan(sw.Mesh(dp=2), params).for_rank(0) if a.kind == "reduce_scatter"
                     for w in a.wire}
    assert reduce_dtypes == {"float64"}
    sw.testing.assert_equivalent(sharded, base, sw.Mesh(dp=2), batches, params, rtol=1e-13)


def test_dynamic_loss_scale_follows_grad_scaler() -> None:
    s = DynamicLossScale(scale=8.0, growth_interval=3, min_scale=2.0)
    s = s.adjust(True).adjust(True)
    assert s.scale == 8.0 and s.good_steps == 2
    s = s.adjust(True)
    assert s.scale == 16.0 and s.good_steps == 0
    s = s.adjust(False).adjust(False).adjust(False)
    assert s.scale == 2.0 and s.good_steps == 0  # backed off, never below the minimum
    assert StaticLossScale(4.0).adjust(False) == StaticLossScale(4.0)
    assert NoLossScale().scale_value() == 1.0


@given(scale=st.floats(1, 2**20), good=st.integers(0, 100), interval=st.integers(1, 3000),
       min_scale=st.floats(2**-14, 1))
def test_loss_scales_round_trip_through_pytrees_and_files(scale: float, good: int, interval: int,
                                                          min_scale: float) -> None:
    """jmp's DynamicLossScale lost min_loss_scale when flattened; ours must keep every field."""
    value = DynamicLossScale(scale, 3.0, 0.25, interval, min_scale, good)
    state = sw.TrainState({"a": {"w": torch.ones(2)}}, (), 5, value)
    leaves, spec = optree.tree_flatten(state)
    assert optree.tree_unflatten(spec, leaves) == state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.loss_scale == value and type(loaded.loss_scale) is DynamicLossScale


def test_dynamic_loss_scale_backs_off_below_one_and_raises_at_its_floor() -> None:
    """GradScaler backs off without a floor (a run whose gradients overflow float16 unscaled trains
    at a scale below 1); the scale used to stop at 1.0 and then skip every step for ever. Now it
    goes down to 2**-14, and a step still not finite there raises instead of skipping again."""
    s = DynamicLossScale(scale=4.0)
    for _ in range(6):
        s = s.adjust(False)
    assert s.scale == 2.0**-4  # below 1, as GradScaler
    s = DynamicLossScale(scale=2.0**-13)
    s = s.adjust(False)
    assert s.scale == DynamicLossScale().min_scale == 2.0**-14
    with pytest.raises(FloatingPointError, match=r"not finite even at the loss scale's floor.*min_scale="):
        s.adjust(False)
    clamped = DynamicLossScale(scale=3.0 * 2.0**-16, min_scale=2.0**-15).adjust(False)
    assert clamped.scale == 2.0**-15  # clamped to a floor below the default; one more there raises
    with pytest.raises(FloatingPointError):
        clamped.adjust(False)


def test_at_a_floor_above_the_default_an_overflow_is_skipped_as_before() -> None:
    """min_scale=1.0 was the default until the floor came down (a resumed checkpoint carries it), and a
    user may choose a higher floor: there an occasional overflow passes, so the step is skipped (and
    says so in its metrics), where raising would end a run that trained before."""
    at_floor = DynamicLossScale(scale=1.0, min_scale=1.0)
    assert at_floor.adjust(False) == at_floor._replace(good_steps=0)
    assert at_floor.adjust(False).adjust(True).good_steps == 1


def test_fp16_gradients_that_overflow_unscaled_train_after_backing_off_below_one() -> None:
    """The found case: targets so large that the f16 gradient overflows at scale 1. GradScaler
    trains once the scale is 2**-5; so does the step now, where it skipped every step at 1.0."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 3]))
    x, y = torch.randn(8, 6), torch.full((8, 3), 3.0e6)
    step = sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(1e-9)),
                              "compute=f16,output=f32", loss_scale=DynamicLossScale(scale=1.0))
    state, skipped = step.init(params), []
    for _ in range(8):
        state, metrics = step(state, (x, y))
        skipped.append(bool(metrics["skipped"]))
    assert skipped[0] and not skipped[-1], skipped
    assert state.loss_scale.scale < 1.0


def test_a_step_not_finite_at_any_scale_raises_at_the_floor() -> None:
    """A NaN in the data makes every gradient NaN whatever the scale: the step backs off to the
    floor, skipping, then refuses rather than skip for ever."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 3]))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    y[0, 0] = float("nan")
    step = sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)),
                              "compute=f16,output=f32", loss_scale=DynamicLossScale(scale=2.0**-12))
    state = step.init(params)
    for _ in range(2):  # 2**-12 -> 2**-13 -> 2**-14, skipped
        state, metrics = step(state, (x, y))
        assert bool(metrics["skipped"])
    assert state.loss_scale.scale == 2.0**-14
    with pytest.raises(FloatingPointError, match=r"min_scale=6\.103515625e-05"):
        step(state, (x, y))


@pytest.mark.parametrize(("value", "message"), [
    (StaticLossScale(0.0), r"StaticLossScale\(scale=0.0\): scale must be a finite number > 0"),
    (StaticLossScale(float("nan")), r"StaticLossScale\(scale=nan\): scale must be a finite number > 0"),
    (StaticLossScale(float("inf")), r"scale=inf\): scale must be a finite number > 0"),
    (DynamicLossScale(scale=0.0), r"DynamicLossScale\(scale=0.0\): scale must be a finite"),
    (DynamicLossScale(growth_factor=1.0), r"growth_factor=1.0\): growth_factor must be a finite number > 1"),
    (DynamicLossScale(backoff_factor=4.0), r"backoff_factor=4.0\): backoff_factor must be a number between 0"),
    (DynamicLossScale(backoff_factor=0.0), r"backoff_factor=0.0\)"),
    (DynamicLossScale(growth_interval=0), r"growth_interval=0\): growth_interval must be an integer >= 1"),
    (DynamicLossScale(growth_interval=2.5), r"growth_interval=2.5\): growth_interval must be an integer"),  # type: ignore[arg-type]
    (DynamicLossScale(min_scale=0.0), r"min_scale=0.0\): min_scale must be a finite number > 0"),
    (DynamicLossScale(scale=0.5, min_scale=1.0), r"scale=0.5, min_scale=1.0\): the scale starts below"),
    (DynamicLossScale(good_steps=-1), r"good_steps=-1\): good_steps must be an integer >= 0"),
    (DynamicLossScale()._replace(scale=float("nan")), r"scale=nan\)"),
])
def test_loss_scales_refuse_values_that_would_skip_or_mis_scale_every_step(value: object, message: str) -> None:
    """A zero, infinite or NaN scale skipped every step (params never moved, no error); a backoff
    factor above 1 grew the scale on overflow; growth_interval=0 grew it every step. Checked where
    a value is used: mixed_precision(loss_scale=), a checkpoint's load, and every step."""
    with pytest.raises(ValueError, match=message):
        value.checked()  # type: ignore[attr-defined]
    chain, _ = sw.functionalize(mlp([6, 16, 3]))
    with pytest.raises(ValueError, match=message):
        sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "compute=f16",
                           loss_scale=value)


def test_a_loss_scale_replaced_in_a_state_is_checked_at_the_next_step() -> None:
    chain, params = sw.functionalize(mlp([6, 16, 3]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"backoff_factor=4.0\)"):
        sw.mixed_precision(base, "compute=f16", loss_scale=DynamicLossScale(backoff_factor=4.0))
    step = sw.mixed_precision(base, "compute=f16", loss_scale=DynamicLossScale())
    state = step.init(params)
    bad = state._replace(loss_scale=state.loss_scale._replace(scale=float("nan")))
    with pytest.raises(ValueError, match=r"scale=nan\): scale must be a finite number > 0"):
        step(bad, (torch.randn(8, 6), torch.randn(8, 3)))


def test_mixed_precision_refuses_an_infinite_number_as_loss_scale() -> None:
    chain, _ = sw.functionalize(mlp([6, 16, 3]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    for bad in (float("inf"), float("nan"), 0.0, -2.0):
        with pytest.raises(ValueError, match=r"loss_scale=.*a finite positive number"):
            sw.mixed_precision(base, "compute=bf16", loss_scale=bad)


def test_a_pytree_map_over_a_state_may_put_anything_in_the_loss_scale() -> None:
    """Only numbers are checked: a map that rebuilds the state with other leaves is not refused."""
    state = sw.TrainState({"a": {"w": torch.ones(2)}}, (), 0, DynamicLossScale())
    assert optree.tree_map(lambda _: None, state, none_is_leaf=True).loss_scale.scale is None
    assert optree.tree_map(lambda leaf: isinstance(leaf, torch.Tensor), state).loss_scale.scale is False
    # Sizing a state by mapping every leaf to a number (0 for the scale's fields).
    sizes = optree.tree_map(lambda x: x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0, state)
    assert sum(optree.tree_leaves(sizes)) == 8


# -- exactness against eager torch ---------------------------------------------------------------

def _problem(seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = mlp([6, 16, 12, 3], "gelu")
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(3)]
    return model, chain, params, batches


def test_bf16_step_is_bitwise_the_eager_bf16_computation() -> None:
    """Eager reference: a bf16 copy of the module computes, the output is cast to f32 for the loss,
    bf16 gradients are cast to f32 and SGD updates f32 master weights. Same kernels, same order."""
    model, chain, params, batches = _problem()
    step = sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)),
                              "params=f32,compute=bf16,output=f32")
    state = step.init(params)
    master = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(master, lr=0.1, momentum=0.9)
    for inputs, targets in batches:
        state, metrics = step(state, (inputs, targets))
        copy = [m.detach().to(torch.bfloat16).requires_grad_(True) for m in master]
        out = torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], copy, strict=True)),
                                         (inputs.to(torch.bfloat16),))
        loss = torch.nn.functional.mse_loss(out.float(), targets)
        loss.backward()
        for m, c in zip(master, copy, strict=True):
            m.grad = c.grad.float()
        opt.step()
        assert torch.equal(metrics["loss"], loss.detach())
    ours = [t for layer in state.params.values() for t in layer.values()]
    names = [f"{layer}.{k}" for layer, tensors in state.params.items() for k in tensors]
    eager = dict(zip([n for n, _ in model.named_parameters()], master, strict=True))
    for name, t in zip(names, ours, strict=True):
        assert t.dtype == torch.float32 and torch.equal(t, eager[name]), name


def test_bf16_stays_close_to_f32() -> None:
    """Against the f32 step: bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per op); after
    three SGD steps with lr 0.1 the parameters agree to 1e-2 relative (norm-wise). A bug (a missing
    cast back, an unscaled gradient) shows as an error of order 1."""
    _, chain, params, batches = _problem()
    f32 = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    bf16 = sw.mixed_precision(f32, "compute=bf16", loss_scale=1024.0)
    sw.testing.assert_equivalent(bf16, f32, sw.Mesh(dp=1), batches, params, rtol=1e-2)


def test_overrides_keep_a_layer_in_f32() -> None:
    _, chain, params, batches = _problem()
    step = sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)),
                              "compute=bf16", overrides={"4": "compute=f32"})
    assert step.precision is not None and step.precision.for_layer("4").compute == torch.float32
    seen = []
    original = step.chain["4"].fn.fn

    def spy(tensors, x):  # type: ignore[no-untyped-def]
        seen.append(x.dtype)
        return original(tensors, x)

    step.chain["4"].fn.fn = spy
    step(step.init(params), batches[0])
    assert seen == [torch.float32]
    with pytest.raises(ValueError, match="matches no layer"):
        sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)),
                           overrides={"head*": "compute=f32"})
    with pytest.raises(ValueError, match="applied twice"):
        sw.mixed_precision(step)


# -- distributed ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("order", ["mp(shard)", "shard(mp)"])
def test_sharded_bf16_matches_single_device_bf16(stage: int, order: str) -> None:
    """Same policy on one device and on dp=2. Each rank's gradient is rounded to bf16 over half the
    batch and the halves are summed in f32, where one device rounds the whole-batch gradient once:
    each rounding is at most 2^-9 relative, so gradients (and the gradient norm) may differ by up to
    2 x 2^-9 = 2^-8 relative; parameters, moved by lr x gradient, differ less. A scaling bug (a
    missing 1/N, an unscaled gradient) is an error of order 1."""
    _, chain, params, batches = _problem()
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    reference = sw.mixed_precision(base, "compute=bf16")
    if order == "mp(shard)":
        sharded = sw.mixed_precision(sw.shard_params(base, "dp", stage), "compute=bf16")
    else:
        sharded = sw.shard_params(reference, "dp", stage)
    report = sw.testing.assert_equivalent(sharded, reference, sw.Mesh(dp=2), batches, params, rtol=2**-8)
    assert max(report.max_rel_err) > 0  # bf16 rounding really differs: the comparison is not vacuous


def test_stage3_gathers_bf16_and_reduces_in_the_reduction_dtype() -> None:
    _, chain, params, batches = _problem()
    base = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)

    def traffic(step: sw.Step) -> dict[str, tuple[str, int]]:
        def run() -> dict[str, tuple[str, int]]:
            state = step.init(params, sw.Mesh(dp=2))
            with sw.collectives.comm_ledger() as ledger:
                step(state, batches[0])
            out: dict[str, tuple[str, int]] = {}
            for r in ledger.records:
                if r.op in ("all_gather", "psum_scatter"):
                    _dtype, total = out.get(r.op, (r.dtype, 0))
                    out[r.op] = (r.dtype, total + r.sent_bytes)
            return out

        return sw.launch(run, 2)[0]

    f32 = traffic(base)
    bf16 = traffic(sw.mixed_precision(base, "compute=bf16,reduce=bf16"))
    assert bf16["all_gather"] == ("bfloat16", f32["all_gather"][1] // 2)
    assert bf16["psum_scatter"] == ("bfloat16", f32["psum_scatter"][1] // 2)
    assert traffic(sw.mixed_precision(base, "compute=bf16"))["psum_scatter"] == f32["psum_scatter"]


# -- overflow ------------------------------------------------------------------------------------

def _overflow_case(kind: str):  # type: ignore[no-untyped-def]
    _, chain, params, _ = _problem()
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2))
    if kind in ("dp", "dp_stage2"):  # (under f16 compute ZeRO-2 holds shards at rest too)
        step, mesh = sw.shard_params(base, "dp", 3 if kind == "dp" else 2), sw.Mesh(dp=2)
    else:
        step, mesh = sw.pipeline(base, "pp", "1f1b", 2), sw.Mesh(pp=2)
    step = sw.mixed_precision(step, "compute=f16", loss_scale=DynamicLossScale(scale=256.0))
    inputs, targets = torch.randn(8, 6), torch.randn(8, 3)
    # Rows 4..7 go to dp rank 1 (or micro-batch 1): huge targets overflow f16 in backward there only.
    targets[6] = 6e4
    return step, mesh, params, (inputs, targets)


@pytest.mark.parametrize("kind", ["dp", "dp_stage2", "pp"])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere(kind: str) -> None:
    step, mesh, params, batch = _overflow_case(kind)

    def run() -> tuple[bool, float, float, bool, bool]:
        state = step.init(params, mesh)
        after, metrics = step(state, batch)
        same_params = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state.params),
                                                            optree.tree_leaves(after.params), strict=True))
        same_opt = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state.opt_state),
                                                         optree.tree_leaves(after.opt_state), strict=True))
        finite = all(bool(torch.isfinite(t).all()) for t in optree.tree_leaves(after.params))
        return bool(metrics["skipped"]), float(metrics["loss_scale"]), after.loss_scale.scale, same_params and \
            same_opt, finite

    for skipped, used, next_scale, unchanged, finite in sw.launch(run, 2):
        assert skipped and used == 256.0 and next_scale == 128.0 and unchanged and finite


def _split_axis_overflow_case(kind: str):  # type: ignore[no-untyped-def]
    """fp16 with a scale too large for the first step (the usual start of a dynamic scale) under a
    transform whose ranks hold replicated parameters and compare their gradients' checksums."""
    from shardwise.testing.models import MoEBlock, TinyGPT

    scale = DynamicLossScale(scale=2.0**30)
    if kind == "ep":
        torch.manual_seed(0)
        chain, params = sw.functionalize(torch.nn.Sequential(
            torch.nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), torch.nn.Linear(8, 3)))
        base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(8, 4, 6, generator=g), torch.randn(8, 4, 3, generator=g))
        step = sw.expert_parallel(sw.mixed_precision(base, "compute=f16,output=f32", loss_scale=scale), "ep")
        return step, sw.Mesh(ep=2), params, batch
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8),
                                     units=["tok_emb", "blocks", "head"])
    base = sw.train_step(chain, lambda logits, y: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten()), sw.optim.adamw(1e-2))
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(2))
    mp = sw.mixed_precision(base, "compute=f16,output=f32", loss_scale=scale)
    if kind == "tp":
        return sw.tensor_parallel(mp, "tp", sw.tp.tiny_gpt_plan(vocab_parallel=False)), sw.Mesh(tp=2), params, \
            (ids[:, :-1], ids[:, 1:])
    return sw.context_parallel(mp, "cp", attention="ring"), sw.Mesh(cp=2), params, (ids[:, :-1], ids[:, 1:])


@pytest.mark.parametrize("kind", ["tp", "cp", "ep"])
def test_an_overflow_under_a_split_axis_skips_the_step(kind: str) -> None:
    """The replicated parameters' checksums are NaN alike on every rank when the gradients overflow: the
    replica check must not read NaN != NaN as ranks that differ; the step is skipped and the scale halved."""
    step, mesh, params, batch = _split_axis_overflow_case(kind)

    def run() -> tuple[bool, float, bool]:
        state = step.init(params, mesh)
        after, metrics = step(state, batch)
        unchanged = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state.params),
                                                          optree.tree_leaves(after.params), strict=True))
        return bool(metrics["skipped"]), after.loss_scale.scale, unchanged

    for skipped, next_scale, unchanged in sw.launch(run, 2):
        assert skipped and next_scale == 2.0**29 and unchanged


def test_the_state_a_step_raised_on_at_the_floor_is_still_usable_with_an_in_place_optimizer() -> None:
    """The floor's error advises resuming with a lower min_scale; the raising step skipped its update, so
    an in-place optimizer's state was not written and must not be refused as consumed."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 8, 3]))
    nan, good = (torch.full((4, 6), float("nan")), torch.randn(4, 3)), (torch.randn(4, 6), torch.randn(4, 3))
    step = sw.mixed_precision(
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9, inplace=True)),
        "compute=f16,output=f32", loss_scale=DynamicLossScale(scale=2.0**-14))
    state, _ = step(step.init(params), good)
    before = [t.clone() for t in optree.tree_leaves((state.params, state.opt_state))]
    with pytest.raises(FloatingPointError):
        step(state, nan)
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves((state.params, state.opt_state)),
                                                 strict=True))
    lower = state._replace(loss_scale=state.loss_scale._replace(min_scale=2.0**-20))
    after, metrics = step(lower, good)
    assert not bool(metrics["skipped"]) and after.step == 2


def test_a_skipped_step_counts_in_state_step_but_not_in_the_schedule() -> None:
    """The schedule reads the optimizer's count of updates applied: a skipped step leaves the run
    where the same run without that batch would be (all-f64 policy: power-of-two scaling is exact),
    while ``state.step`` counts the call."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss,
                         sw.optim.adamw(sw.optim.warmup_cosine(0.1, 3, 10), weight_decay=0.1))
    scaled = sw.mixed_precision(step, "params=f64,compute=f64,output=f64", loss_scale="dynamic")
    gen = torch.Generator().manual_seed(1)
    good = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
             torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    bad = (good[0][0].clone(), good[0][1])
    bad[0][2, 1] = float("inf")
    state, skipped = scaled.init(params), []
    for batch in [good[0], bad, good[1], good[2]]:
        state, metrics = scaled(state, batch)
        skipped.append(bool(metrics["skipped"]))
    plain = step.init(params)
    for batch in good:
        plain, _ = step(plain, batch)
    assert skipped == [False, True, False, False]
    assert (state.step, int(state.opt_state.step)) == (4, 3)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(scaled.full_params(state)),
                                                  optree.tree_leaves(step.full_params(plain)), strict=True))


def test_the_dynamic_loss_scale_never_grows_past_float32_and_a_larger_scale_is_refused() -> None:

    near = DynamicLossScale(scale=2.0**127, growth_interval=1)
    assert near.adjust(True).scale == 2.0**127 and near.adjust(True).good_steps == 0  # as GradScaler: kept
    assert near.adjust(False).scale == 2.0**126
    chain, params = sw.functionalize(mlp([4, 8, 2]))
    step = sw.train_step(chain, lambda o, t: 1e-6 * torch.nn.functional.mse_loss(o, t), sw.optim.sgd(1e-3))
    grown = sw.mixed_precision(step, "params=f32,compute=bf16,output=f32",
                               loss_scale=DynamicLossScale(scale=2.0**126, growth_interval=1))
    state, batch = grown.init(params), (torch.randn(8, 4), torch.randn(8, 2))
    scales = []
    for _ in range(4):  # 2**126, 2**127, then kept there: trains on (it crashed at 2**128)
        state, metrics = grown(state, batch)
        scales.append(float(metrics["loss_scale"]))
    assert scales == [2.0**126, 2.0**127, 2.0**127, 2.0**127] and not bool(metrics["skipped"])
    for made in (lambda: DynamicLossScale(scale=1e39).checked(), lambda: StaticLossScale(1e39).checked(),
                 lambda: sw.mixed_precision(step, "params=f32,compute=bf16,output=f32", loss_scale=1e39)):
        with pytest.raises(ValueError, match=r"scale=1e\+39\): scale must be at most float32's largest finite value "
                           r"\(3.40282e\+38\)"):
            made()
