"""Every collective on gloo processes (world 2 and 4), forward and backward, against the threads backend.

The rank programs are module-level functions (spawned processes import them).
Each runs the same program on both backends; the threads backend is checked
against plain reference loops in ``test_ops.py``. Data movement must agree
exactly; reductions to 1e-12 relative in float64, because gloo's reduction
order is its own, not rank order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.collectives import (
    Mesh,
    all_gather,
    all_gather_async,
    all_to_all,
    all_to_all_async,
    broadcast,
    broadcast_async,
    comm_ledger,
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

pytestmark = pytest.mark.gloo


def _input(rank: int, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _forward(x: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    ring = [(i, (i + 1) % world) for i in range(world)]
    return {
        "psum": psum(x, "dp"),
        "pmean": pmean(x, "dp"),
        "pvary": pvary(x, "dp"),
        "all_gather": all_gather(x, "dp", dim=1),
        "all_gather_tiled": all_gather(x, "dp", dim=-1, tiled=True),
        "psum_scatter": psum_scatter(x, "dp", dim=0),
        "psum_scatter_tiled": psum_scatter(x, "dp", dim=-2, tiled=True),
        "ppermute": ppermute(x, "dp", ring[:-1]),  # rank 0 receives nothing
        "all_to_all": all_to_all(x, "dp", 0, 1),
        "all_to_all_tiled": all_to_all(x, "dp", 0, 1, tiled=True),
        "broadcast": broadcast(x, "dp", root=world - 1),
    }


def every_collective(world: int) -> dict[str, Any]:
    """Rank program: each collective forward, one backward through all of them, async forms, ints."""
    mesh = Mesh(dp=world)
    rank = mesh.rank
    x = _input(rank, (world, 3)).requires_grad_(True)
    with mesh, comm_ledger() as ledger:
        outs = _forward(x, world)
        loss = sum((y * _input(rank, y.shape, salt=k + 1)).sum() for k, y in enumerate(outs.values()))
        loss.backward()
        plain = x.detach()
        handles = {
            "psum": psum_async(plain, "dp"),
            "all_gather": all_gather_async(plain, "dp", dim=1),
            "psum_scatter": psum_scatter_async(plain, "dp"),
            "ppermute": ppermute_async(plain, "dp", [(0, world - 1)]),
            "all_to_all": all_to_all_async(plain, "dp", 0, 1),
            "broadcast": broadcast_async(plain, "dp", root=1),
        }
        ints = torch.arange(world * 2).reshape(world, 2) + 10 * rank
        int_outs = [psum(ints, "dp"), all_gather(ints, "dp"), all_to_all(ints, "dp", 0, 0)]
    return {
        "outs": {k: v.detach() for k, v in outs.items()},
        "grad": x.grad,
        "async": {k: h.wait() for k, h in handles.items()},
        "ints": int_outs,
        "sent": sorted((r.op, r.phase, r.sent_bytes) for r in ledger.records),
    }


def func_grad(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank program: torch.func.grad and vjp through gathers, scatters and a psum."""
    mesh = Mesh(dp=world)
    x = _input(mesh.rank, (world, 2))

    def f(t: torch.Tensor) -> torch.Tensor:
        g = all_gather(t, "dp", mesh=mesh)
        s = psum_scatter(g * g, "dp", dim=1, mesh=mesh)
        return psum(s.sum(), "dp", mesh=mesh)

    _, pullback = torch.func.vjp(lambda t: all_to_all(t, "dp", 0, 1, mesh=mesh), x)  # -> (2, world)
    (by_vjp,) = pullback(torch.arange(2.0 * world, dtype=torch.float64).view(2, world))
    return torch.func.grad(f)(x), by_vjp


def _compare(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _compare(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple) and want and isinstance(want[0], torch.Tensor):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _compare(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{path}: {m}")
    else:
        assert got == want, path


@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_every_collective_forward_and_backward_matches_threads(pool_name, request):
    pool = request.getfixturevalue(pool_name)
    world = pool.world
    on_gloo = pool.run(every_collective, world)
    on_threads = launch(every_collective, world, args=(world,))
    for rank in range(world):
        _compare(on_gloo[rank], on_threads[rank], f"rank {rank}")


@pytest.mark.parametrize("pool_name", ["gloo2", "gloo4"])
def test_torch_func_grad_and_vjp_on_gloo(pool_name, request):
    pool = request.getfixturevalue(pool_name)
    world = pool.world
    on_gloo = pool.run(func_grad, world)
    on_threads = launch(func_grad, world, args=(world,))
    for rank in range(world):
        _compare(list(on_gloo[rank]), list(on_threads[rank]), f"rank {rank}")
        x = _input(rank, (world, 2))
        # d/dx_r of sum_j n * |x_j|^2 (see test_grads.py): 2 n x_r
        torch.testing.assert_close(on_gloo[rank][0], 2 * world * x, rtol=1e-12, atol=1e-12)
