"""Guards on torch's private ``torch._foreach_*`` kernels, as wrapped in
``shardwise.engine.optim.foreach``: if a torch upgrade removes, renames or changes one of them,
these tests fail here, by name, rather than the optimizers drifting silently.

Every wrapper is checked against its per-tensor fallback loop with exact equality: on CPU
the foreach kernels are themselves loops over the same ATen ops, so any difference at all
means the kernel changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from shardwise.engine.optim import foreach as fe

SHAPES = [(3, 5), (7,), (), (2, 3, 4), (0,)]


def _tensors(
    seed: int, dtype: torch.dtype = torch.float32, positive: bool = False
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen, dtype=dtype) for shape in SHAPES]
    # Bounded away from 0 where the op takes a square root or divides.
    return [x.abs() + 0.5 for x in xs] if positive else xs


# wrapper -> (private op it uses, how to call it on fresh inputs)
CASES: dict[
    str, tuple[str, Callable[[torch.dtype], tuple[list[list[torch.Tensor]], dict[str, float]]]]
] = {
    "add": ("_foreach_add", lambda dt: ([_tensors(0, dt), _tensors(1, dt)], {"alpha": -0.37})),
    "add_scalar": ("_foreach_add", lambda dt: ([_tensors(0, dt)], {"scalar": 1e-8})),
    "mul_scalar": ("_foreach_mul", lambda dt: ([_tensors(0, dt)], {"scalar": 0.999})),
    "mul_tensor": ("_foreach_mul", lambda dt: ([_tensors(0, dt)], {"factor": torch.tensor(0.37)})),
    "div_scalar": ("_foreach_div", lambda dt: ([_tensors(0, dt)], {"scalar": 0.031622})),
    "lerp_scalar": (
        "_foreach_lerp",
        lambda dt: ([_tensors(0, dt), _tensors(1, dt)], {"weight": 0.1}),
    ),
    "addcmul_scalar": (
        "_foreach_addcmul",
        lambda dt: ([_tensors(0, dt), _tensors(1, dt), _tensors(2, dt)], {"value": 0.001}),
    ),
    "addcdiv_scalar": (
        "_foreach_addcdiv",
        lambda dt: (
            [_tensors(0, dt), _tensors(1, dt), _tensors(2, dt, positive=True)],
            {"value": -0.3},
        ),
    ),
    "sqrt": ("_foreach_sqrt", lambda dt: ([_tensors(0, dt, positive=True)], {})),
    "norm": ("_foreach_norm", lambda dt: ([_tensors(0, dt)], {"ord": 2.0})),
}


def test_every_wrapped_op_is_covered_here() -> None:
    assert {op for op, _ in CASES.values()} == set(fe.FALLBACKS)
    assert set(CASES) == set(fe.__all__) - {"foreach_op", "bounded_groups", "kind_groups"}


@pytest.mark.parametrize("name", sorted(fe.FALLBACKS))
def test_private_op_exists(name: str) -> None:
    assert fe.foreach_op(name) is not None, (
        f"torch {torch.__version__} has no torch.{name}: shardwise falls back to a per-tensor "
        "loop (correct, slower); update shardwise/engine/optim/foreach.py for the new API"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wrapper", sorted(CASES))
def test_foreach_matches_the_loop_and_is_out_of_place(
    wrapper: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, make = CASES[wrapper]
    lists, scalars = make(dtype)
    before = [[t.clone() for t in tensors] for tensors in lists]
    input_ptrs = {t.data_ptr() for tensors in lists for t in tensors if t.numel()}

    got = getattr(fe, wrapper)(*lists, **scalars)

    # Out-of-place: inputs unchanged bitwise, outputs in fresh memory.
    for tensors, saved in zip(lists, before, strict=True):
        for t, s in zip(tensors, saved, strict=True):
            assert torch.equal(t, s), f"{wrapper} wrote to its input"
    assert not {t.data_ptr() for t in got if t.numel()} & input_ptrs, f"{wrapper} returned an input"

    monkeypatch.setattr(fe, "foreach_op", lambda name: None)
    expected = getattr(fe, wrapper)(*lists, **scalars)
    assert len(got) == len(expected) == len(SHAPES)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.dtype == e.dtype and g.shape == e.shape, (
            f"{wrapper}[{i}]: {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"
        )
        assert torch.equal(g, e), (
            f"{wrapper}[{i}]: foreach kernel differs from the per-tensor op: {g} vs {e}"
        )


def test_mixed_dtypes_are_grouped_and_keep_their_order() -> None:
    xs = [
        torch.randn(3),
        torch.randn(2, dtype=torch.float64),
        torch.randn(4),
        torch.randn((), dtype=torch.float64),
    ]
    ys = [torch.randn_like(x) for x in xs]
    got = fe.add(xs, ys, alpha=0.5)
    for x, y, g in zip(xs, ys, got, strict=True):
        assert g.dtype == x.dtype
        assert torch.equal(g, torch.add(x, y, alpha=0.5))


def test_kernel_calls_are_grouped_by_device_and_dtype_only_when_the_list_mixes_them() -> None:
    # CPU kernels would take a mixed list anyway; accelerators' fused kernels need one
    # (device, dtype) per call, so the groups are checked here, not through the values.
    mixed = [torch.randn(3), torch.randn(2, dtype=torch.float64), torch.randn(4), torch.zeros(2, device="meta")]
    assert fe._kernel_groups(mixed) == [[0, 2], [1], [3]]
    # one dtype, the CPU beside meta (neither has a device index): two calls
    assert fe._kernel_groups([torch.randn(3), torch.zeros(2, device="meta"), torch.randn(1)]) == [[0, 2], [1]]
    assert fe._kernel_groups([torch.randn(3), torch.randn(5)]) is None  # one call, no groups built
    assert fe._kernel_groups([torch.randn(3)]) is None


def test_inplace_writes_every_tensor_of_a_mixed_list_bitwise_as_out_of_place() -> None:
    xs = [torch.randn(3), torch.randn(2, dtype=torch.float64), torch.randn(4)]
    ys = [torch.randn_like(x) for x in xs]
    expected = fe.add(xs, ys, alpha=0.5)
    targets = [x.clone() for x in xs]
    got = fe.add(targets, ys, alpha=0.5, inplace=True)
    assert all(g is t for g, t in zip(got, targets, strict=True))  # written in place, returned
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_mul_tensor_casts_the_factor_per_dtype_first_and_writes_in_place_as_out_of_place() -> None:
    # As ``g * factor.to(g.dtype)``: the factor rounded to bfloat16 first, then one product.
    xs = [torch.randn(5), torch.randn(3, dtype=torch.float64), torch.randn(4).to(torch.bfloat16)]
    factor = torch.tensor(0.3712345, dtype=torch.float32)
    expected = [x * factor.to(x.dtype) for x in xs]
    got = fe.mul_tensor(xs, factor)
    targets = [x.clone() for x in xs]
    written = fe.mul_tensor(targets, factor, inplace=True)
    assert all(w is t for w, t in zip(written, targets, strict=True))
    for g, w, e in zip(got, written, expected, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e) and torch.equal(w, e)
    assert fe.mul_tensor([], factor) == []


def test_empty_lists_and_length_mismatch() -> None:
    assert fe.add([], [], alpha=1.0) == []
    with pytest.raises(ValueError, match="differ in length"):
        fe.add([torch.ones(1)], [], alpha=1.0)


def test_bounded_groups_cover_every_index_once_in_order_within_the_largest_tensor() -> None:
    unit = fe.MIN_GROUP_BYTES // 4 // 50  # float32 elements: 50 units fill the floor
    sizes = [n * unit for n in (4, 100, 30, 30, 30, 10, 100, 1, 1)]
    xs = [torch.zeros(n) for n in sizes]
    groups = fe.bounded_groups(xs)
    assert [i for group in groups for i in group] == list(range(len(xs)))
    budget = max(sizes) * 4
    assert len(groups) == 5  # [4] [100] [30 30 30] [10] [100 1 1]
    for group in groups:
        assert len(group) == 1 or sum(sizes[i] for i in group) * 4 <= budget
    # Greedy: a group closes only when the next tensor would not fit.
    for group, following in itertools.pairwise(groups):
        assert (sum(sizes[i] for i in group) + sizes[following[0]]) * 4 > budget
    assert fe.bounded_groups([]) == []


def test_small_tensors_share_one_group_up_to_the_floor() -> None:
    xs = [torch.zeros(16, 16), torch.zeros(16), torch.zeros(16, 16), torch.zeros(16)]
    assert fe.bounded_groups(xs) == [range(4)]
    big = torch.zeros(fe.MIN_GROUP_BYTES // 4)
    assert fe.bounded_groups([big, torch.zeros(1)]) == [range(1), range(1, 2)]


def test_bounded_groups_is_one_group_off_the_cpu() -> None:
    xs = [torch.zeros(4, device="meta"), torch.zeros(100, device="meta")]
    assert fe.bounded_groups(xs) == [range(2)]


def test_bounded_groups_of_a_mixed_list_are_each_of_one_device_and_dtype() -> None:
    """So an update may tell each op of a group that its list is uniform (``uniform=True``)."""
    unit = fe.MIN_GROUP_BYTES // 4 // 50
    xs = [
        torch.zeros(60 * unit), torch.zeros(4, dtype=torch.float64), torch.zeros(59 * unit),
        torch.zeros(3, device="meta"), torch.zeros(2, dtype=torch.float64), torch.zeros(unit),
    ]
    groups = fe.bounded_groups(xs)
    assert sorted(i for group in groups for i in group) == list(range(len(xs)))  # each index once
    for group in groups:
        assert len({(xs[i].device, xs[i].dtype) for i in group}) == 1, group
        assert list(group) == sorted(group)
    # the float32 CPU tensors are bounded as a list of their own (60, 59 and 1 units; the largest
    # is the budget), the float64 ones as another
    assert [list(g) for g in groups] == [[0], [2, 5], [1, 4], [3]]


def test_uniform_skips_the_grouping_and_computes_the_same() -> None:
    """``uniform=True`` is the caller's word that the first list is of one device and dtype: no
    groups are read (a list that is not uniform still computes right on the CPU: per tensor)."""
    xs = [torch.randn(3), torch.randn(5)]
    ys = [torch.randn_like(x) for x in xs]
    calls = []
    real = fe._kernel_groups
    fe._kernel_groups = lambda first: calls.append(len(first)) or real(first)  # type: ignore[assignment]
    try:
        told = fe.lerp_scalar(xs, ys, 0.25, uniform=True)
        assert calls == []
        checked = fe.lerp_scalar(xs, ys, 0.25)
        assert calls == [2]
    finally:
        fe._kernel_groups = real  # type: ignore[assignment]
    for a, b in zip(told, checked, strict=True):
        assert torch.equal(a, b)
    mixed = [torch.randn(3), torch.randn(2, dtype=torch.float64)]
    for got, x in zip(fe.mul_scalar(mixed, 3.0, uniform=True), mixed, strict=True):
        assert got.dtype == x.dtype and torch.equal(got, x * 3.0)


def test_kind_groups_are_one_range_for_one_kind_else_each_kinds_indices() -> None:
    assert fe.kind_groups([torch.randn(3), torch.randn(5)]) == [range(2)]
    mixed = [torch.randn(3), torch.randn(2, dtype=torch.float64), torch.randn(4)]
    assert [list(g) for g in fe.kind_groups(mixed)] == [[0, 2], [1]]
    assert fe.kind_groups([]) == [range(0)]
