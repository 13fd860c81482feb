"""Functional SGD and AdamW against torch.optim, plus purity, sharding and state round trips.

Tolerances. Our optimizers issue the same ATen elementwise ops as torch's implementations,
in the same order, with the same scalars computed the same way in Python doubles (lr,
``1 - lr * wd``, bias corrections, ``-lr / bc1``). On CPU a foreach kernel is a loop over
those same ops, so every intermediate rounds identically and the results are *bitwise*
equal to both ``foreach=False`` and ``foreach=True`` torch, in float32 and float64: the
derived bound is 0, and the tests assert exact equality (reporting the max relative
difference if it ever fails). The brief's float32 budget of 1e-6 relative would be the
fallback only if an accelerator's fused kernels rounded differently.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.engine.optim.optimizers import (
    STATE_TYPES,
    AdamWState,
    Optimizer,
    SgdState,
    adamw,
    global_norm,
    sgd,
)
from shardwise.engine.optim.schedules import cosine_decay, join, linear_warmup, warmup_cosine

Tree = Any
STEPS = 20
SHAPES: Tree = {
    "embed": {"w": (5, 3)},
    "block": {"w": (3, 4), "b": (4,)},
    "head": (2, 3, 2),
    "scale": (),
}

SGD_CONFIGS: list[dict[str, Any]] = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.3},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.1, "weight_decay": 0.05},
    {"lr": 0.02, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
]
ADAMW_CONFIGS: list[dict[str, Any]] = [
    {"lr": 1e-2},
    {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 1e-2, "weight_decay": 0.0},
    {"lr": 0.1, "betas": (0.0, 0.5), "eps": 0.0, "weight_decay": 0.5},
]
CASES = [("sgd", c) for c in SGD_CONFIGS] + [("adamw", c) for c in ADAMW_CONFIGS]


def _ours(kind: str, config: dict[str, Any]) -> Optimizer:
    return {"sgd": sgd, "adamw": adamw}[kind](**config)


def _theirs(kind: str, config: dict[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[kind]
    return lambda params, **extra: cls(params, **{**config, **extra})


def _random_tree(shapes: Tree, seed: int, dtype: torch.dtype) -> Tree:
    gen = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda shape: torch.randn(shape, generator=gen, dtype=dtype),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _problem(shapes: Tree, dtype: torch.dtype, steps: int = STEPS) -> tuple[Tree, list[Tree]]:
    return _random_tree(shapes, 0, dtype), [
        _random_tree(shapes, 1 + i, dtype) for i in range(steps)
    ]


def _run_ours(opt: Optimizer, params: Tree, grads: list[Tree]) -> tuple[Tree, Any]:
    state = opt.init(params)
    for g in grads:
        params, state = opt.update(g, state, params)
    return params, state


def _run_torch(
    make: Callable[..., torch.optim.Optimizer],
    params: Tree,
    grads: list[Tree],
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    **extra: Any,
) -> list[torch.Tensor]:
    tensors = [torch.nn.Parameter(p.clone()) for p in optree.tree_leaves(params)]
    opt = make(tensors, **extra)
    sched = scheduler(opt) if scheduler else None
    for g in grads:
        for t, leaf in zip(tensors, optree.tree_leaves(g), strict=True):
            t.grad = leaf.clone()
        opt.step()
        if sched is not None:
            sched.step()
    return [t.detach() for t in tensors]


def _max_rel_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        diff = (a.double() - b.double()).abs() / b.double().abs().clamp_min(
            torch.finfo(b.dtype).tiny
        )
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    return worst


def _assert_bitwise(ours: Tree, theirs: list[torch.Tensor]) -> None:
    leaves = optree.tree_leaves(ours)
    same = all(torch.equal(a, b) for a, b in zip(leaves, theirs, strict=True))
    assert same, (
        f"differs from torch.optim: max relative difference {_max_rel_diff(leaves, theirs):.3g}"
    )


@pytest.mark.parametrize("torch_foreach", [False, True], ids=["torch-single", "torch-foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("kind", "config"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_matches_torch_optim_bitwise(
    kind: str, config: dict[str, Any], dtype: torch.dtype, torch_foreach: bool
) -> None:
    params, grads = _problem(SHAPES, dtype)
    ours, _ = _run_ours(_ours(kind, config), params, grads)
    _assert_bitwise(ours, _run_torch(_theirs(kind, config), params, grads, foreach=torch_foreach))


SCHEDULES = [
    warmup_cosine(0.1, 5, STEPS, end=1e-3),
    join([linear_warmup(0.1, 3), cosine_decay(0.1, 10, alpha=0.1)], [3]),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_schedule_matches_lambda_lr(kind: str, schedule: Callable[[int], float]) -> None:
    """lr = schedule(t) for update t (from 0), as torch with LambdaLR stepped once per
    update; with base lr 1.0, LambdaLR's lr is exactly schedule(t), so this is bitwise."""
    params, grads = _problem(SHAPES, torch.float32)
    config: dict[str, Any] = (
        {"momentum": 0.9, "weight_decay": 0.01} if kind == "sgd" else {"weight_decay": 0.1}
    )
    ours, _ = _run_ours(_ours(kind, {"lr": schedule, **config}), params, grads)
    theirs = _run_torch(
        _theirs(kind, {"lr": 1.0, **config}),
        params,
        grads,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
    )
    _assert_bitwise(ours, theirs)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_schedule_sees_update_counts_from_zero(kind: str) -> None:
    seen: list[int] = []

    def schedule(step: int) -> float:
        seen.append(step)
        return 0.1

    params, grads = _problem(SHAPES, torch.float32, steps=3)
    _, state = _run_ours(_ours(kind, {"lr": schedule}), params, grads)
    assert seen == [0, 1, 2]
    assert state.step.dtype == torch.int64 and state.step.shape == () and state.step.item() == 3


def _snapshot(tree: Tree) -> list[torch.Tensor]:
    return [t.clone() for t in optree.tree_leaves(tree)]


def _storages(tree: Tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in optree.tree_leaves(tree)}


@pytest.mark.parametrize(("kind", "config"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_update_is_pure(kind: str, config: dict[str, Any]) -> None:
    """Inputs stay bitwise unchanged and outputs share no memory with them, on the first
    update (momentum buffers start from the gradient) and on a later one."""
    opt = _ours(kind, config)
    params, grads = _problem(SHAPES, torch.float32, steps=2)
    state = opt.init(params)
    for g in grads:
        inputs = (g, state, params)
        before = [_snapshot(x) for x in inputs]
        new_params, new_state = opt.update(g, state, params)
        for x, saved in zip(inputs, before, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(x), saved, strict=True))
        assert not (_storages(new_params) | _storages(new_state)) & _storages(inputs)
        params, state = new_params, new_state


def _shard(tree: Tree, i: int) -> Tree:
    """Piece i of 3 uneven pieces of each leaf's flat view (views, not copies; some empty)."""

    def piece(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        cuts = [0, flat.numel() // 4, flat.numel() // 4 + (flat.numel() + 1) // 2, flat.numel()]
        return flat[cuts[i] : cuts[i + 1]]

    return optree.tree_map(piece, tree)


def _assert_shards_match(opt: Optimizer, params: Tree, grads: list[Tree]) -> None:
    full, _ = _run_ours(opt, params, grads)
    pieces = [_run_ours(opt, _shard(params, i), [_shard(g, i) for g in grads])[0] for i in range(3)]
    for path_full, *path_pieces in zip(
        optree.tree_leaves(full), *map(optree.tree_leaves, pieces), strict=True
    ):
        assert torch.equal(torch.cat(path_pieces), path_full.reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("kind", "config"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_update_on_flat_shards_is_bitwise_the_full_update(
    kind: str, config: dict[str, Any], dtype: torch.dtype
) -> None:
    params, grads = _problem({**SHAPES, "big": (67, 5)}, dtype, steps=5)
    _assert_shards_match(_ours(kind, config), params, grads)


@pytest.mark.parametrize(("kind", "config"), [CASES[2], CASES[-3]], ids=["sgd", "adamw"])
def test_state_round_trips_through_optree_and_torch_save(kind: str, config: dict[str, Any]) -> None:
    opt = _ours(kind, config)
    params, grads = _problem(SHAPES, torch.float32, steps=5)
    mid_params, state = _run_ours(opt, params, grads[:3])
    assert isinstance(state, STATE_TYPES)

    leaves, spec = optree.tree_flatten(state)
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    rebuilt = optree.tree_unflatten(spec, leaves)
    assert type(rebuilt) is type(state) and optree.tree_structure(rebuilt) == spec

    buffer = io.BytesIO()
    torch.save(leaves, buffer)  # flat leaves load under the default weights_only=True
    buffer.seek(0)
    from_leaves = optree.tree_unflatten(spec, torch.load(buffer))

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(list(STATE_TYPES)):
        from_object = torch.load(buffer)
    assert from_object.step.dtype == torch.int64 and from_object.step.item() == 3

    def finish(s: Any) -> list[torch.Tensor]:
        p = mid_params
        for g in grads[3:]:
            p, s = opt.update(g, s, p)
        return [*optree.tree_leaves(p), *optree.tree_leaves(s)]

    expected = finish(state)
    for restored in (rebuilt, from_leaves, from_object):
        assert all(torch.equal(a, b) for a, b in zip(finish(restored), expected, strict=True))


def test_plain_sgd_state_has_only_the_step() -> None:
    state = sgd(0.1).init({"w": torch.ones(3)})
    assert state == SgdState(step=torch.tensor(0), momentum=None)
    assert optree.tree_leaves(state) == [state.step]
    assert state.step.device.type == "cpu"


@st.composite
def _optimizer_cases(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["sgd", "adamw"]))
    lr = draw(st.floats(0.0, 1.0))
    weight_decay = draw(st.sampled_from([0.0, draw(st.floats(0.0, 0.5))]))
    if kind == "adamw":
        betas = (draw(st.floats(0.0, 0.999)), draw(st.floats(0.0, 0.9999)))
        return kind, {
            "lr": lr,
            "betas": betas,
            "eps": draw(st.floats(1e-12, 1e-2)),
            "weight_decay": weight_decay,
        }
    momentum = draw(st.sampled_from([0.0, draw(st.floats(0.0, 0.99))]))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, draw(st.floats(0.0, 1.0))]))
    return kind, {
        "lr": lr,
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": weight_decay,
        "nesterov": nesterov,
    }


_shape = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)


@given(
    case=_optimizer_cases(),
    shapes=st.dictionaries(st.sampled_from("abcde"), _shape, min_size=1, max_size=4),
)
def test_drawn_hyperparameters_and_shapes(
    case: tuple[str, dict[str, Any]], shapes: dict[str, tuple[int, ...]]
) -> None:
    kind, config = case
    params, grads = _problem(shapes, torch.float64, steps=4)
    ours, _ = _run_ours(_ours(kind, config), params, grads)
    _assert_bitwise(ours, _run_torch(_theirs(kind, config), params, grads))
    _assert_shards_match(_ours(kind, config), params, grads)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: sgd(-0.1), "lr: must be finite and >= 0"),
        (lambda: sgd("fast"), "lr: expected a float or a schedule"),
        (lambda: sgd(0.1, momentum=-0.9), "momentum: must be finite and >= 0"),
        (lambda: sgd(0.1, weight_decay=-1e-4), "weight_decay: must be finite and >= 0"),
        (lambda: sgd(0.1, nesterov=True), "nesterov: .* momentum > 0 and dampening == 0"),
        (
            lambda: sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
            "nesterov: .*pass nesterov=False",
        ),
        (lambda: adamw(-1e-3), "lr: must be finite and >= 0"),
        (lambda: adamw(1e-3, betas=(1.0, 0.999)), r"betas\[0\]: must be in \[0, 1\)"),
        (lambda: adamw(1e-3, betas=(0.9, -0.1)), r"betas\[1\]: must be in \[0, 1\)"),
        (lambda: adamw(1e-3, betas=(0.9,)), "betas: expected a pair"),
        (lambda: adamw(1e-3, eps=-1e-8), "eps: must be finite and >= 0"),
        (lambda: adamw(1e-3, weight_decay=-0.01), "weight_decay: must be finite and >= 0"),
    ],
)
def test_bad_hyperparameters_name_the_argument(make: Callable[[], Optimizer], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bad_update_inputs_are_refused_clearly() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    opt = sgd(0.1, momentum=0.9)
    state = opt.init(params)
    with pytest.raises(ValueError, match="grads: its tree structure"):
        opt.update({"a": torch.ones(2)}, state, params)
    with pytest.raises(TypeError, match=r"state: sgd\.update expects the SgdState"):
        opt.update(params, adamw(0.1).init(params), params)
    with pytest.raises(ValueError, match=r"lr: the schedule .* returned -1\.0 at step 0"):
        adamw(lambda step: -1.0).update(params, adamw(0.1).init(params), params)
    assert isinstance(adamw(0.1).init(params), AdamWState)


def test_global_norm_is_torch_total_norm() -> None:
    grads = _random_tree(SHAPES, 3, torch.float32)
    # In insertion order, as module.parameters() lists them (optree's leaves sort dict keys).
    leaves = [t.clone() for v in grads.values() for t in (v.values() if isinstance(v, dict) else [v])]
    expected = torch.nn.utils.get_total_norm(leaves)
    assert torch.equal(global_norm(grads), expected)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in leaves]
    for p, g in zip(params, leaves, strict=True):
        p.grad = g.clone()
    assert torch.equal(global_norm(grads), torch.nn.utils.clip_grad_norm_(params, max_norm=1.0))
    assert torch.equal(global_norm({}), torch.tensor(0.0))


def test_sum_of_squares_is_the_squared_global_norm() -> None:
    from shardwise.engine.optim.optimizers import sum_of_squares

    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(7, generator=gen, dtype=torch.float64),
    ]
    expected = sum(float((t * t).sum()) for t in tensors)
    got = sum_of_squares(tensors, torch.float64)
    assert got.dtype == torch.float64 and got.shape == ()
    assert abs(float(got) - expected) <= 1e-12 * expected
    assert float(sum_of_squares([], torch.float32)) == 0.0


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize(("kind", "config"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_a_model_of_mixed_dtypes_matches_torch_optim_bitwise(kind: str, config: dict[str, Any], inplace: bool) -> None:
    """float32 and float64 leaves interleaved: the update runs each (device, dtype) group on its
    own (its ops told the group is uniform), every leaf as torch updates it."""
    params32, grads32 = _problem(SHAPES, torch.float32)
    params64, grads64 = _problem(SHAPES, torch.float64)

    def mixed(t32: Tree, t64: Tree) -> Tree:  # block and scale in float64, the rest in float32
        return {k: (t64 if k in ("block", "scale") else t32)[k] for k in t32}

    params = mixed(params32, params64)
    grads = [mixed(a, b) for a, b in zip(grads32, grads64, strict=True)]
    assert {t.dtype for t in optree.tree_leaves(params)} == {torch.float32, torch.float64}
    theirs = _run_torch(_theirs(kind, config), params, grads)
    ours, _ = _run_ours(_ours(kind, {**config, "inplace": inplace}),
                        optree.tree_map(torch.clone, params), grads)
    _assert_bitwise(ours, theirs)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("torch_foreach", [False, True], ids=["torch-single", "torch-foreach"])
@pytest.mark.parametrize(("kind", "config"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_complex_parameters_match_torch_optim_bitwise(
    kind: str, config: dict[str, Any], torch_foreach: bool, inplace: bool
) -> None:
    """torch's Adam updates a complex parameter as its real view (the second moment per part); ours squared the
    complex gradient (the review: 0.89 of an FNO-style spectral weight's update)."""
    shapes = {"spectral": {"w": (3, 4)}, "real": {"b": (4,)}}
    real, real_grads = _problem(shapes, torch.float64, steps=6)
    imag, imag_grads = _problem(shapes, torch.float64, steps=6)

    def complex_spectral(re: Tree, im: Tree) -> Tree:
        return {"spectral": {"w": torch.complex(re["spectral"]["w"], im["spectral"]["w"])}, "real": re["real"]}

    params = complex_spectral(real, imag)
    grads = [complex_spectral(r, i) for r, i in zip(real_grads, imag_grads, strict=True)]
    ours, _ = _run_ours(_ours(kind, {**config, "inplace": inplace}), optree.tree_map(torch.clone, params), grads)
    assert ours["spectral"]["w"].is_complex()
    _assert_bitwise(ours, _run_torch(_theirs(kind, config), params, grads, foreach=torch_foreach))
