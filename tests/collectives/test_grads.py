"""Gradients of the collectives: the transpose rules, torch.func, and a tensor-parallel MLP.

Cotangent convention (see ``shardwise/collectives/ops.py``): a per-rank value is
*varying* (each rank holds its own; per-rank losses are summed) or *invariant*
(one value replicated on every rank; its cotangent is already the total).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise.collectives import (
    Mesh,
    all_gather,
    all_to_all,
    broadcast,
    launch,
    pmean,
    ppermute,
    psum,
    psum_scatter,
    pvary,
)

VARYING, INVARIANT = "varying", "invariant"


class GlobalSPMD(torch.autograd.Function):
    """One collective on N ranks seen as ONE global function, so gradcheck can test its backward.

    The global function is what the cotangent convention says the ranks compute together:

    * varying input: the global input stacks the N per-rank inputs (rank r gets slice r),
      and the global gradient stacks the per-rank gradients.
    * invariant input (pvary's): one value, fed to every rank; each rank's backward
      yields the gradient of that one value, so the ranks must agree, and the
      global gradient is that common value.
    * varying output: the global output stacks the N per-rank outputs; the total loss
      is the sum of per-rank losses, so rank r receives its own slice g[r] of the
      cotangent.
    * invariant output (psum's, pmean's): the global output is the one value (rank 0's
      copy; all copies must be equal) and EVERY rank receives the same cotangent g,
      since it is already the total.

    broadcast is the subtle one: every rank ends up holding the same value, but its
    documented backward sums every rank's cotangent onto the root, which is the
    transpose of ``x_root -> (x_root, ..., x_root)`` with N separate outputs. So its
    output is varying here. Were it treated as invariant, the correct gradient for the
    root would be g, not N g, and gradcheck would fail.

    Forward runs the ranks as threads and keeps each rank's autograd graph; backward
    runs each rank's ``torch.autograd.grad`` of its output with its cotangent, on N
    threads again (the backward collectives reuse the forward's world).
    """

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, body: Callable[..., torch.Tensor], world: int, kinds: tuple[str, str]
    ) -> torch.Tensor:
        in_kind, out_kind = kinds
        mesh = Mesh(dp=world)

        def main() -> tuple[torch.Tensor, torch.Tensor]:
            r = mesh.rank
            x = (inp[r] if in_kind == VARYING else inp).detach().clone().requires_grad_(True)
            with torch.enable_grad():
                return x, body(x, r, mesh)

        ctx.graphs, ctx.world, ctx.kinds = launch(main, world, timeout=30.0), world, kinds
        ys = [y.detach() for _, y in ctx.graphs]
        if out_kind == INVARIANT:
            assert all(torch.equal(y, ys[0]) for y in ys), "an invariant output differs across ranks"
            return ys[0].clone()
        return torch.stack(ys)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        in_kind, out_kind = ctx.kinds

        def main(r: int) -> torch.Tensor:
            x, y = ctx.graphs[r]
            gy = g if out_kind == INVARIANT else g[r]
            (gx,) = torch.autograd.grad(y, x, gy, retain_graph=True)
            return gx

        grads = launch(lambda: main(Mesh(dp=ctx.world).rank), ctx.world, timeout=30.0)
        if in_kind == VARYING:
            return torch.stack(grads), None, None, None
        assert all(torch.equal(gx, grads[0]) for gx in grads), "ranks disagree on an invariant input's gradient"
        return grads[0], None, None, None


def _stacked(world: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(world * 100 + len(shape))
    return torch.randn((world, *shape), generator=gen, dtype=torch.float64, requires_grad=True)


def _shift(world: int) -> list[tuple[int, int]]:
    # A partial permutation: the last rank sends nothing, rank 0 receives nothing.
    return [(i, i + 1) for i in range(world - 1)]


# (name, body(x, rank, mesh), per-rank input shape given world, kinds)
CASES: list[tuple[str, Callable[..., torch.Tensor], Callable[[int], tuple[int, ...]], tuple[str, str]]] = [
    ("psum", lambda x, r, m: psum(x, "dp", mesh=m), lambda n: (2, 3), (VARYING, INVARIANT)),
    ("pmean", lambda x, r, m: pmean(x, "dp", mesh=m), lambda n: (3,), (VARYING, INVARIANT)),
    ("pvary", lambda x, r, m: pvary(x, "dp", mesh=m) * (r + 1), lambda n: (2, 2), (INVARIANT, VARYING)),
    ("all_gather", lambda x, r, m: all_gather(x, "dp", dim=1, mesh=m), lambda n: (2, 2), (VARYING, VARYING)),
    (
        "all_gather_tiled",
        lambda x, r, m: all_gather(x, "dp", dim=-1, tiled=True, mesh=m),
        lambda n: (2, 2),
        (VARYING, VARYING),
    ),
    ("psum_scatter", lambda x, r, m: psum_scatter(x, "dp", dim=-1, mesh=m), lambda n: (2, n), (VARYING, VARYING)),
    (
        "psum_scatter_tiled",
        lambda x, r, m: psum_scatter(x, "dp", dim=0, tiled=True, mesh=m),
        lambda n: (2 * n, 1),
        (VARYING, VARYING),
    ),
    ("ppermute", lambda x, r, m: ppermute(x, "dp", _shift(m.size), mesh=m), lambda n: (3,), (VARYING, VARYING)),
    ("all_to_all", lambda x, r, m: all_to_all(x, "dp", 0, 1, mesh=m), lambda n: (n, 2), (VARYING, VARYING)),
    (
        "all_to_all_tiled",
        lambda x, r, m: all_to_all(x, "dp", 1, 0, tiled=True, mesh=m),
        lambda n: (2, 2 * n),
        (VARYING, VARYING),
    ),
    ("broadcast", lambda x, r, m: broadcast(x, "dp", root=m.size - 1, mesh=m), lambda n: (3,), (VARYING, VARYING)),
]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("name", "body", "shape", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_gradcheck_of_the_global_spmd_function(name, body, shape, kinds, world):
    in_shape = shape(world)
    inp = _stacked(world, in_shape)
    if kinds[0] == INVARIANT:
        inp = inp[0].detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: GlobalSPMD.apply(t, body, world, kinds), (inp,))


# -- (b) torch.func.grad and vjp, against loss.backward() and a hand-derived formula ---------
def _hand_grad(name: str, ws: list[torch.Tensor], r: int, n: int) -> torch.Tensor:
    """d(sum_j <w_j, y_j>)/dx_r under the documented transpose rules, written per op."""
    if name == "psum":
        return ws[r]
    if name == "pmean":
        return ws[r] / n
    if name == "pvary":
        return sum(ws[1:], ws[0])
    if name == "all_gather":  # y_j[:, i] = x_i
        return sum((w[:, r] for w in ws[1:]), ws[0][:, r])
    if name == "psum_scatter":  # y_j = sum_i x_i[:, j]
        return torch.stack(ws, dim=1)
    if name == "ppermute":  # x_r goes to r + 1
        return ws[r + 1] if r + 1 < n else torch.zeros_like(ws[r])
    if name == "all_to_all":  # y_j[:, i] = x_i[j]
        return torch.stack([w[:, r] for w in ws])
    if name == "broadcast":  # root n - 1
        return sum(ws[1:], ws[0]) if r == n - 1 else torch.zeros_like(ws[r])
    raise AssertionError(name)


FUNC_CASES = [c for c in CASES if not c[0].endswith("_tiled")]


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize(("name", "body", "shape", "kinds"), FUNC_CASES, ids=[c[0] for c in FUNC_CASES])
def test_torch_func_grad_and_vjp_equal_backward_and_the_formula(name, body, shape, kinds, world):
    in_shape = shape(world)
    if name == "pvary":
        body = lambda x, r, m: pvary(x, "dp", mesh=m)  # noqa: E731 - the plain op, for the formula
    xs = [t.detach() for t in _stacked(world, in_shape)]
    mesh = Mesh(dp=world)

    def weights(r: int, like: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + r)
        return torch.randn(like.shape, generator=gen, dtype=like.dtype)

    def main() -> tuple[torch.Tensor, ...]:
        r = mesh.rank
        op = lambda x: body(x, r, mesh)  # noqa: E731
        w = weights(r, op(xs[r]))
        x = xs[r].clone().requires_grad_(True)
        (op(x) * w).sum().backward()
        by_grad = torch.func.grad(lambda t: (op(t) * w).sum())(xs[r])
        _, pullback = torch.func.vjp(op, xs[r])
        (by_vjp,) = pullback(w)
        return x.grad, by_grad, by_vjp, w

    results = launch(main, world)
    ws = [w for *_, w in results]
    for r, (by_backward, by_grad, by_vjp, _) in enumerate(results):
        want = _hand_grad(name, ws, r, world)
        torch.testing.assert_close(by_backward, want, rtol=0, atol=1e-12)
        assert torch.equal(by_grad, by_backward), (name, r)
        assert torch.equal(by_vjp, by_backward), (name, r)


def test_torch_func_grad_through_a_chain_of_collectives():
    world = 3
    mesh = Mesh(dp=world)

    def f(x: torch.Tensor) -> torch.Tensor:
        gathered = all_gather(x, "dp", mesh=mesh)  # (n, 2)
        scattered = psum_scatter(gathered * gathered, "dp", mesh=mesh)  # (2,): n * x_r^2 ... summed
        return psum(scattered.sum(), "dp", mesh=mesh)

    def main() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([1.0, 2.0], dtype=torch.float64) * (mesh.rank + 1)
        return torch.func.grad(f)(x), x

    for g, x in launch(main, world):
        # every rank's all_gather output feeds its own psum_scatter; the scatter over ranks of
        # sum_i y_i[j]^2 gives n * x_j^2 on rank j, and the psum is the invariant total:
        # d/dx_r of sum_j n * |x_j|^2 = 2 n x_r.
        torch.testing.assert_close(g, 2 * world * x, rtol=0, atol=1e-12)


# -- (c) a tensor-parallel MLP equals the single-device MLP -------------------------
def _mlp_params(d_in: int = 3, hidden: int = 8, d_out: int = 2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, d_in, generator=gen, dtype=torch.float64)
    w1 = torch.randn(d_in, hidden, generator=gen, dtype=torch.float64)
    w2 = torch.randn(hidden, d_out, generator=gen, dtype=torch.float64)
    return x, w1, w2


def _mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w1) @ w2).pow(2).sum()


def _tp_mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Megatron: f = pvary, column-parallel w1 shard, row-parallel w2 shard, g = psum."""
    h = torch.tanh(pvary(x, "tp", mesh=mesh) @ w1)
    return psum(h @ w2, "tp", mesh=mesh).pow(2).sum()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_mlp_gradients_equal_the_single_device_mlp(world):
    """Gradients agree to 1e-12 relative in float64: the TP sum over hidden shards only
    reassociates the single-device matmul's reduction, so only rounding differs."""
    x, w1, w2 = _mlp_params()
    reference = torch.func.grad(_mlp_loss, argnums=(0, 1, 2))(x, w1, w2)
    mesh = Mesh(tp=world)

    def main() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        r = mesh.rank
        shard = slice(r * 8 // world, (r + 1) * 8 // world)
        local = [x.clone(), w1[:, shard].clone(), w2[shard].clone()]
        by_func = torch.func.grad(_tp_mlp_loss, argnums=(0, 1, 2))(*local, mesh)
        params = [t.requires_grad_(True) for t in local]
        _tp_mlp_loss(*params, mesh).backward()
        return tuple(p.grad for p in params), by_func

    results = launch(main, world)
    for r, (by_backward, by_func) in enumerate(results):
        shard = slice(r * 8 // world, (r + 1) * 8 // world)
        want = (reference[0], reference[1][:, shard], reference[2][shard])
        for got_b, got_f, w in zip(by_backward, by_func, want, strict=True):
            torch.testing.assert_close(got_b, w, rtol=1e-12, atol=1e-12)
            assert torch.equal(got_f, got_b)
