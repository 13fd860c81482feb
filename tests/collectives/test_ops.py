"""Every collective against a reference loop over ranks, on the threads backend.

Each rank builds its input from a seed and its rank; the reference applies plain
torch ops to the list of all ranks' inputs. The threads backend sums in rank
order, and the references sum in the same order, so every comparison is exact
(``torch.equal``), in every dtype.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.collectives import (
    Mesh,
    RankFailed,
    all_gather,
    all_gather_async,
    all_to_all,
    all_to_all_async,
    axis_index,
    axis_size,
    broadcast,
    broadcast_async,
    comm_ledger,
    current_mesh,
    launch,
    pmean,
    ppermute,
    ppermute_async,
    psum,
    psum_async,
    psum_scatter,
    psum_scatter_async,
    pvary,
)
from shardwise.collectives.ops import all_gather_into_async, psum_scatter_rows_async
from shardwise.engine.torch_api import version_of

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
worlds = st.integers(1, 8)
dtypes = st.sampled_from(FLOATS)
seeds = st.integers(0, 2**16)


def make(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: a pure function of (seed, rank, shape, dtype)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def spmd(world: int, body: Callable[[int], Any], mesh: Mesh | None = None) -> list[Any]:
    """Run ``body(rank)`` on every rank inside ``with mesh:`` (default Mesh(dp=world))."""
    mesh = mesh or Mesh(dp=world)

    def main() -> Any:
        with mesh:
            return body(mesh.rank)

    return launch(main, world)


def sum_in_order(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total


def assert_all_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (rank, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(g, w), f"rank {rank}: {g} != {w}"


@st.composite
def shapes_with_dim(draw: st.DrawFn, min_ndim: int = 0, extra_positions: int = 0) -> tuple[tuple[int, ...], int]:
    """A shape and a dim (possibly negative) among its ndim + extra_positions positions."""
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=min_ndim, max_size=3)))
    positions = len(shape) + extra_positions
    dim = draw(st.integers(-positions, positions - 1))
    return shape, dim


# -- reductions ---------------------------------------------------------------------
@given(world=worlds, dtype=dtypes, seed=seeds, shape=st.lists(st.integers(1, 4), max_size=3))
def test_psum_and_pmean_match_the_sum_in_rank_order(world, dtype, seed, shape):
    shape = tuple(shape)
    xs = [make(seed, r, shape, dtype) for r in range(world)]
    results = spmd(world, lambda r: (psum(xs[r], "dp"), pmean(xs[r], "dp")))
    total = sum_in_order(xs)
    assert_all_equal([s for s, _ in results], [total] * world)
    assert_all_equal([m for _, m in results], [total / world] * world)


@given(world=worlds, dtype=dtypes, seed=seeds, shape_dim=shapes_with_dim(min_ndim=1), tiled=st.booleans())
def test_psum_scatter_matches_the_reference(world, dtype, seed, shape_dim, tiled):
    shape, dim = shape_dim
    shape = list(shape)
    shape[dim] = world * (shape[dim] if tiled else 1)
    xs = [make(seed, r, tuple(shape), dtype) for r in range(world)]
    results = spmd(world, lambda r: psum_scatter(xs[r], "dp", dim=dim, tiled=tiled))
    total = sum_in_order(xs)
    want = list(torch.tensor_split(total, world, dim=dim)) if tiled else [total.select(dim, i) for i in range(world)]
    assert_all_equal(results, [w.contiguous() for w in want])


# -- data movement ------------------------------------------------------------------
@given(world=worlds, dtype=dtypes, seed=seeds, tiled=st.booleans(), data=st.data())
def test_all_gather_matches_stack_or_cat(world, dtype, seed, tiled, data):
    shape, dim = data.draw(shapes_with_dim(min_ndim=1 if tiled else 0, extra_positions=0 if tiled else 1))
    xs = [make(seed, r, shape, dtype) for r in range(world)]
    results = spmd(world, lambda r: all_gather(xs[r], "dp", dim=dim, tiled=tiled))
    want = torch.cat(xs, dim=dim) if tiled else torch.stack(xs, dim=dim)
    assert_all_equal(results, [want] * world)


@given(world=worlds, dtype=dtypes, seed=seeds, tiled=st.booleans(), data=st.data())
def test_all_to_all_matches_the_reference(world, dtype, seed, tiled, data):
    shape = list(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    ndim = len(shape)
    split = data.draw(st.integers(-ndim, ndim - 1))
    concat = data.draw(st.integers(-ndim, ndim - 1))
    shape[split] = world * (shape[split] if tiled else 1)
    xs = [make(seed, r, tuple(shape), dtype) for r in range(world)]
    results = spmd(world, lambda r: all_to_all(xs[r], "dp", split, concat, tiled=tiled))
    if tiled:
        want = [torch.cat([x.tensor_split(world, split)[i] for x in xs], dim=concat) for i in range(world)]
    else:  # as jax.lax.all_to_all: split_dim removed, a new dim of size world at concat_dim
        want = [torch.stack([x.select(split, i) for x in xs], dim=concat % ndim) for i in range(world)]
    assert_all_equal(results, want)


@given(world=worlds, dtype=dtypes, seed=seeds, data=st.data())
def test_ppermute_matches_the_reference(world, dtype, seed, data):
    targets = data.draw(st.permutations(range(world)))
    keep = data.draw(st.lists(st.booleans(), min_size=world, max_size=world))
    perm = [(src, dst) for src, (dst, k) in enumerate(zip(targets, keep, strict=True)) if k]
    xs = [make(seed, r, (2, 3), dtype) for r in range(world)]
    results = spmd(world, lambda r: ppermute(xs[r], "dp", perm))
    want = [torch.zeros_like(x) for x in xs]
    for src, dst in perm:
        want[dst] = xs[src]
    assert_all_equal(results, want)


@given(world=worlds, dtype=dtypes, seed=seeds, data=st.data())
def test_broadcast_and_pvary_match_the_reference(world, dtype, seed, data):
    root = data.draw(st.integers(0, world - 1))
    xs = [make(seed, r, (3,), dtype) for r in range(world)]
    results = spmd(world, lambda r: (broadcast(xs[r], "dp", root=root), pvary(xs[r], "dp")))
    assert_all_equal([b for b, _ in results], [xs[root]] * world)
    assert_all_equal([v for _, v in results], xs)


@given(world=worlds, seed=seeds, dtype=st.sampled_from([torch.int64, torch.int32, torch.bool]))
def test_integer_and_bool_tensors_work_without_autograd(world, seed, dtype):
    xs = [make(seed, r, (world, 2), dtype) for r in range(world)]
    perm = [(i, (i + 1) % world) for i in range(world)]

    def body(r: int) -> list[torch.Tensor]:
        x = xs[r]
        return [
            all_gather(x, "dp"),
            all_to_all(x, "dp", 0, 1),
            ppermute(x, "dp", perm),
            broadcast(x, "dp", root=world - 1),
            pvary(x, "dp"),
            psum(x, "dp"),
        ]

    results = spmd(world, body)
    for r, got in enumerate(results):
        assert got[0].equal(torch.stack(xs))
        assert got[1].equal(torch.stack([x[r] for x in xs], dim=1))
        assert got[2].equal(xs[(r - 1) % world])
        assert got[3].equal(xs[world - 1])
        assert got[4].equal(xs[r])
        assert got[5].equal(sum_in_order(xs))
        assert all(t.dtype == dtype for t in got)


def test_axis_index_and_size():
    mesh = Mesh(dp=2, tp=3)
    got = spmd(6, lambda r: (axis_index("dp"), axis_index("tp"), axis_size("dp"), axis_size("tp")), mesh)
    assert got == [(r // 3, r % 3, 2, 3) for r in range(6)]
    assert axis_size("tp", mesh=mesh) == 3  # layout only: no rank needed


# -- async forms --------------------------------------------------------------------
def test_async_forms_equal_the_sync_forms():
    world = 4
    xs = [make(7, r, (4, 2), torch.float32) for r in range(world)]
    perm = [(0, 2), (2, 1), (1, 0)]

    def body(r: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = xs[r]
        # Start every async collective first, so they are all in flight at once.
        handles = [
            psum_async(x, "dp"),
            all_gather_async(x, "dp", dim=-1, tiled=True),
            psum_scatter_async(x, "dp", dim=0),
            ppermute_async(x, "dp", perm),
            all_to_all_async(x, "dp", 0, 1),
            broadcast_async(x, "dp", root=2),
        ]
        sync = [
            psum(x, "dp"),
            all_gather(x, "dp", dim=-1, tiled=True),
            psum_scatter(x, "dp", dim=0),
            ppermute(x, "dp", perm),
            all_to_all(x, "dp", 0, 1),
            broadcast(x, "dp", root=2),
        ]
        return [h.wait() for h in reversed(handles)][::-1], sync

    for got, want in spmd(world, body):
        assert_all_equal(got, want)


def test_all_gather_into_writes_each_rows_pieces_and_the_ledger_counts_an_all_gather():
    world = 3
    xs = [make(11, r, (2, 5), torch.float32) for r in range(world)]

    def body(r: int) -> tuple[bool, list[torch.Tensor], Any]:
        dest = torch.zeros(world * 10 + 4)
        # Row j: pieces of lengths 3 and 7 at an offset of its own, the last row split 10 = 4 + 6.
        rows = [[dest[11 * j: 11 * j + 3], dest[11 * j + 4: 11 * j + 11]] for j in range(world - 1)]
        rows.append([dest[22:26], dest[27:33]])
        with comm_ledger() as ledger:
            returned = all_gather_into_async(xs[r], rows, "dp").wait()
        with comm_ledger() as plain:
            all_gather_async(xs[r], "dp").wait()
        got = [torch.cat(pieces) for pieces in rows]
        return returned.data_ptr() == xs[r].data_ptr(), got, (ledger.summary(), plain.summary())

    for returns_input, got, (summary, plain) in spmd(world, body):
        assert returns_input
        for j in range(world):
            assert got[j].equal(xs[j].reshape(-1)), j
        assert summary == plain and list(summary) == [("dp", "all_gather")], (summary, plain)


@pytest.mark.parametrize("rows, message", [
    (lambda x, r: [[torch.empty(4)], [torch.empty(4)], [torch.empty(4)]], "rows has 3 entries; pass one per member"),
    (lambda x, r: [[torch.empty(4)], [torch.empty(3)]], "rows[1] holds 3 elements, the input 4"),
    (lambda x, r: [[torch.empty(4)], [torch.empty(2, 2)]], "rows[1][0] must be a 1-D contiguous tensor"),
    (lambda x, r: [[torch.empty(4)], [torch.empty(8)[::2]]], "rows[1][0] must be a 1-D contiguous tensor"),
    (lambda x, r: [[torch.empty(4)], [torch.empty(4, dtype=torch.float64)]], "rows[1][0] is torch.float64"),
    (lambda x, r: [[torch.empty(4)], [[1.0] * 4]], "rows[1][0] is a list, not a tensor"),
    # The other member's row in the input; this member's own row shifted by one element in it.
    (lambda x, r: [[x.view(-1)] if j != r else [torch.empty(4)] for j in range(2)], "overlaps the input"),
    (lambda x, r: [[x.view(-1)[1:], torch.empty(1)] if j == r else [torch.empty(4)] for j in range(2)],
     "overlaps the input"),
    (lambda x, r: (lambda d: [[d[:4]], [d[2:6]]])(torch.empty(6)), "rows[0][0] and rows[1][0] overlap"),
    (lambda x, r: [[torch.empty(4)], [torch.empty(4)]], None),  # with a non-contiguous input: below
])
def test_all_gather_into_refuses_rows_it_cannot_write(rows: Callable[[torch.Tensor, int], Any],
                                                      message: str | None) -> None:
    def body(r: int) -> None:
        x = torch.ones(2, 2) if message is not None else torch.ones(2, 4)[:, ::2]
        with pytest.raises((ValueError, TypeError), match=re.escape(message or "the input must be contiguous")):
            all_gather_into_async(x, rows(x, r), "dp")

    spmd(2, body)


def test_all_gather_into_leaves_this_members_row_where_it_is_the_input() -> None:
    """A member's own row may be its input's values where they lie (a shard that is a view of the
    parameters it is gathered into): the other rows arrive, its own is not written (its version
    counter does not move)."""
    def body(r: int) -> tuple[torch.Tensor, bool]:
        mine, other = torch.full((3,), float(r)), torch.zeros(3)
        rows = [[mine] if j == r else [other] for j in range(2)]
        before = version_of(mine)
        all_gather_into_async(mine, rows, "dp").wait()
        return torch.stack([mine, other] if r == 0 else [other, mine]), version_of(mine) == before

    for flat, untouched in spmd(2, body):
        assert flat.equal(torch.tensor([[0.0] * 3, [1.0] * 3])) and untouched


@given(world=st.integers(1, 5), seed=seeds, data=st.data())
def test_all_gather_into_of_pieces_is_the_all_gather_of_their_values(world: int, seed: int, data: Any) -> None:
    """The input as pieces cut anywhere (empty ones too), into rows cut elsewhere, this member's own
    row partly its input where it lies (ZeRO's shards in the parameters) and partly elsewhere:
    every row holds its member's values end to end, the in-place part is not written (its version
    does not move), the input is left as it was, and the ledger records the all-gather of the
    joined input."""
    m = 12
    xs = [make(seed, r, (m,), torch.float32) for r in range(world)]
    cuts = st.lists(st.integers(0, m), max_size=4).map(lambda c: sorted(c))
    input_cuts = data.draw(cuts, label="input cuts")
    row_cuts = data.draw(cuts, label="row cuts")
    in_place = data.draw(st.integers(0, m), label="elements of the own row in place")

    def split(t: torch.Tensor, at: list[int]) -> list[torch.Tensor]:
        edges = [0, *at, t.numel()]
        return [t[a:b] for a, b in itertools.pairwise(edges)]

    def body(r: int) -> tuple[list[torch.Tensor], bool, Any]:
        mine = xs[r].clone()
        pieces = split(mine, input_cuts)
        dest = torch.full((world, m), float("nan"))
        rows = [split(dest[j], row_cuts) for j in range(world)]
        rows[r] = [mine[:in_place], *split(dest[r, in_place:], [])]  # the first elements where they lie
        versions = [p._version for p in pieces]
        with comm_ledger() as ledger:
            returned = all_gather_into_async(pieces, rows, "dp").wait()
        with comm_ledger() as plain:
            all_gather_async(xs[r], "dp").wait()
        untouched = [p._version for p in pieces] == versions and torch.equal(mine, xs[r])
        assert returned.numel() == 0
        return [torch.cat(row) for row in rows], untouched, (ledger.summary(), plain.summary())

    for got, untouched, (summary, plain) in spmd(world, body):
        assert untouched
        for j in range(world):
            assert torch.equal(got[j], xs[j]), j
        assert summary == plain and list(summary) == [("dp", "all_gather")], (summary, plain)


def _fresh_rows(x: torch.Tensor, r: int) -> list[list[torch.Tensor]]:
    """Rows the input's checks come before: two of their own."""
    return [[torch.empty(4)], [torch.empty(4)]]


@pytest.mark.parametrize("given_input, rows, message", [
    (lambda x: [], _fresh_rows, "a non-empty sequence of 1-D tensors"),
    (lambda x: [x[:2], [1.0, 2.0]], _fresh_rows, "x[1] is a list, not a tensor"),
    (lambda x: [x.view(2, 2)], _fresh_rows, "x[0] must be a 1-D contiguous tensor"),
    (lambda x: [x[:2], x[2:].double()], _fresh_rows, "x[1] is torch.float64 on cpu"),
    (lambda x: [x[:3], x[1:]], _fresh_rows, "x[0] and x[1] overlap"),
    (lambda x: [x[:2], x[2:].clone().requires_grad_()], _fresh_rows, "is not differentiable"),
    # This member's own row at the input's place for one piece, shifted for the other.
    (lambda x: [x[:2], x[2:]], lambda x, r: [[x[:2], x[3:], torch.empty(1)] if j == r else [torch.empty(4)]
                                             for j in range(2)], "rows[{r}][1] overlaps the input"),
    # The other member's row in the input's second piece.
    (lambda x: [x[:2], x[2:]], lambda x, r: [[torch.empty(4)] if j == r else [torch.empty(2), x[2:]]
                                             for j in range(2)], "rows[{o}][1] overlaps the input"),
])
def test_all_gather_into_refuses_an_input_of_pieces_it_cannot_read(
        given_input: Callable[[torch.Tensor], Any], rows: Callable[[torch.Tensor, int], Any], message: str) -> None:
    def body(r: int) -> None:
        x = torch.zeros(4)
        with pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(message.format(r=r, o=1 - r))):
            all_gather_into_async(given_input(x), rows(x, r), "dp")

    spmd(2, body)


@given(world=st.integers(1, 5), seed=seeds, dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_a_reduce_scatter_of_pieces_equals_the_one_of_their_buffer_and_the_ledger_counts_it(
        world: int, seed: int, dtype: torch.dtype) -> None:
    """Rows given as float32 pieces (cut at other places per row) and summed in ``dtype`` reduce to
    what their concatenated buffer, converted, reduces to, bitwise; the ledger records the same
    reduce-scatter of that buffer, and the pieces are left as they were."""
    m = 7
    xs = [make(seed, r, (world, m), torch.float32) for r in range(world)]

    def body(r: int) -> tuple[torch.Tensor, torch.Tensor, Any, bool]:
        rows = [[t.clone() for t in torch.split(xs[r][j], [j % m + 1, m - j % m - 1])] for j in range(world)]
        kept = [[t.clone() for t in row] for row in rows]
        with comm_ledger() as ledger:
            got = psum_scatter_rows_async(rows, dtype, "dp").wait()
        with comm_ledger() as plain:
            whole = psum_scatter_async(xs[r].reshape(-1).to(dtype), "dp", tiled=True).wait()
        same = all(torch.equal(a, b) for row, k in zip(rows, kept, strict=True) for a, b in zip(row, k, strict=True))
        return got, whole, (ledger.summary(), plain.summary()), same

    for got, whole, (summary, plain), untouched in spmd(world, body):
        assert got.dtype == dtype and torch.equal(got, whole)
        assert summary == plain and list(summary) == [("dp", "psum_scatter")], (summary, plain)
        assert untouched


@pytest.mark.parametrize("rows, dtype, message", [
    (lambda: [[torch.empty(4)]] * 3, torch.float32, "rows has 3 entries; pass one per member"),
    (lambda: [[torch.empty(4)], [torch.empty(3)]], torch.float32, "the rows hold [4, 3] elements"),
    (lambda: [[torch.empty(4)], [torch.empty(2, 2)]], torch.float32, "rows[1][0] must be a 1-D contiguous tensor"),
    (lambda: [[torch.empty(4)], [torch.empty(8)[::2]]], torch.float32, "rows[1][0] must be a 1-D contiguous"),
    (lambda: [[torch.empty(4)], [[1.0] * 4]], torch.float32, "rows[1][0] is a list, not a tensor"),
    (lambda: [[torch.empty(4)], [torch.empty(4, requires_grad=True)]], torch.float32, "rows[1][0] requires grad"),
    (lambda: [[torch.empty(4)], [torch.empty(4, device="meta")]], torch.float32, "rows[1][0] is on meta"),
    (lambda: [[], []], torch.float32, "the rows hold no tensor"),
    (lambda: [[torch.empty(4)], [torch.empty(4)]], torch.int64, "dtype must be a floating-point torch.dtype"),
])
def test_a_reduce_scatter_of_pieces_refuses_rows_it_cannot_read(rows: Callable[[], Any], dtype: torch.dtype,
                                                                 message: str) -> None:
    def body(r: int) -> None:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(message)):
            psum_scatter_rows_async(rows(), dtype, "dp")

    spmd(2, body)


def test_async_forms_refuse_inputs_that_require_grad():
    def body(r: int) -> torch.Tensor:
        x = torch.ones(2, requires_grad=True)
        with torch.no_grad():
            ok = psum_async(x, "dp").wait()
        psum_async(x, "dp")
        return ok

    with pytest.raises(RankFailed) as info:
        spmd(2, body)
    message = str(info.value.__cause__)
    assert "psum_async" in message and "psum(" in message and "torch.no_grad()" in message


# -- determinism and meshes ---------------------------------------------------------
def test_results_are_bitwise_identical_run_to_run():
    world = 8
    xs = [make(3, r, (64,), torch.float16) for r in range(world)]

    def body(r: int) -> list[torch.Tensor]:
        return [psum(xs[r], "dp"), psum_scatter(xs[r], "dp", tiled=True), pmean(xs[r], "dp")]

    first, second = spmd(world, body), spmd(world, body)
    for a, b in zip(first, second, strict=True):
        assert_all_equal(a, b)


def test_collectives_over_one_axis_of_two_only_touch_that_axis():
    mesh = Mesh(dp=2, tp=3)
    xs = [make(11, r, (3, 2), torch.float64) for r in range(mesh.size)]
    results = spmd(mesh.size, lambda r: (psum(xs[r], "tp"), all_gather(xs[r], "dp")), mesh)
    for axis, position in (("tp", 0), ("dp", 1)):
        for group in mesh.all_groups(axis):
            members = [xs[r] for r in group]
            want = sum_in_order(members) if axis == "tp" else torch.stack(members)
            for r in group:
                assert torch.equal(results[r][position], want), (axis, group, r)


# -- errors -------------------------------------------------------------------------
def _failure(world: int, body: Callable[[int], Any]) -> BaseException:
    with pytest.raises(RankFailed) as info:
        spmd(world, body)
    assert info.value.__cause__ is not None
    return info.value.__cause__


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda x: psum_scatter(x, "dp", dim=1, tiled=True), ["psum_scatter", "(3, 5)", "dim 1", "size 4"]),
        (lambda x: psum_scatter(x, "dp", dim=-2), ["psum_scatter", "(3, 5)", "dim 0", "size 4"]),
        (lambda x: all_to_all(x, "dp", 1, 0, tiled=True), ["all_to_all", "(3, 5)", "dim 1", "size 4"]),
        (lambda x: all_to_all(x, "dp", 0, 1), ["all_to_all", "(3, 5)", "dim 0", "size 4"]),
        (lambda x: psum_scatter_async(x, "dp", dim=0, tiled=True), ["psum_scatter", "(3, 5)", "dim 0", "size 4"]),
    ],
)
def test_shapes_that_do_not_divide_are_refused_naming_shape_dim_and_axis_size(call, words):
    error = _failure(4, lambda r: call(torch.zeros(3, 5)))
    assert isinstance(error, ValueError)
    for word in words:
        assert word in str(error), (word, str(error))


@pytest.mark.parametrize(
    ("call", "error_type", "words"),
    [
        (lambda x: all_gather(x, "dp", dim=3), ValueError, ["dim=3", "(3, 5)"]),
        (lambda x: all_gather(x, "dp", dim=2, tiled=True), ValueError, ["dim=2", "(3, 5)"]),
        (lambda x: psum(x, "tp"), ValueError, ["unknown mesh axis 'tp'"]),
        (lambda x: psum(x, ("dp",)), TypeError, ["psum(axis=('dp',))", "one mesh axis", "once per axis"]),
        (lambda x: ppermute(x, "dp", [(0, 1), (2, 1)]), ValueError, ["destination", "[1]"]),
        (lambda x: ppermute(x, "dp", [(0, 1), (0, 2)]), ValueError, ["source", "[0]"]),
        (lambda x: ppermute(x, "dp", [(0, 4)]), ValueError, ["(0, 4)", "size 4"]),
        (lambda x: ppermute(x, "dp", [(0, 1, 2)]), ValueError, ["pairs (src, dst)"]),
        (lambda x: broadcast(x, "dp", root=4), ValueError, ["root=4", "size 4"]),
        (lambda x: pmean(x.long(), "dp"), TypeError, ["pmean", "int64"]),
    ],
)
def test_bad_arguments_are_refused_with_a_clear_error(call, error_type, words):
    error = _failure(4, lambda r: call(torch.zeros(3, 5)))
    assert isinstance(error, error_type)
    for word in words:
        assert word in str(error), (word, str(error))


def test_a_collective_without_a_mesh_says_how_to_give_one():
    with pytest.raises(
        RuntimeError, match=r"psum\(axis='dp'\) needs a mesh: call it inside `with mesh:` or pass mesh="
    ):
        psum(torch.ones(1), "dp")


def test_no_collective_runs_inside_no_mesh_even_one_that_names_its_mesh():
    """The loss probe evaluates loss_fn again on one rank, inside no_mesh(): a collective there, even
    with mesh=, raises at once instead of waiting for ranks that never join it (a hang before)."""
    from shardwise.collectives.mesh_context import no_mesh

    def main() -> tuple[int, int, str]:
        mesh = current_mesh()
        assert mesh is not None
        refused = ""
        if axis_index("dp") == 0:  # rank 1 never issues it
            with no_mesh():
                try:
                    psum(torch.ones(1), "dp", mesh=mesh)
                except RuntimeError as err:
                    refused = str(err)
                index = axis_index("dp", mesh=mesh)  # the layout is still read
        else:
            index = 1
        return index, axis_size("dp", mesh=mesh), refused

    with Mesh(dp=2):
        got = launch(main, 2, timeout=30)
    assert [g[:2] for g in got] == [(0, 2), (1, 2)]
    assert re.match(r"psum\(axis='dp'\) inside no_mesh\(\): no collective runs in this block", got[0][2])


def test_with_mesh_sets_the_current_mesh_and_nests():
    outer, inner = Mesh(dp=1), Mesh(tp=1)
    assert current_mesh() is None
    with outer as entered:
        assert entered is outer and current_mesh() is outer
        with inner:
            assert current_mesh() is inner
            assert psum(torch.ones(2), "tp").equal(torch.ones(2))  # a world of one
        assert current_mesh() is outer
    assert current_mesh() is None
