"""Results never alias the caller's input, nor another rank's result, on both backends.

The sync collectives let the backend read the caller's tensor without a
snapshot (``snapshot=False``: they wait at once), and the threads backend hands
freshly computed results to ranks without copying them again. Neither may
break the contract of ``backend.py``: the input is never written, results are
new tensors (mutating a result leaves the input alone and vice versa), and
every rank may mutate its result without another rank seeing it. The async
forms keep their snapshot: the caller may change its tensor before ``wait()``.

Each rank program runs on threads (worlds 2 and 3) and on gloo processes; on
gloo it also checks that torch leaves the input of a reduce-scatter unchanged,
which the distributed backend relies on when it skips the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
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
    launch,
    pmean,
    ppermute,
    ppermute_async,
    psum,
    psum_async,
    psum_scatter,
    psum_scatter_async,
)
from shardwise.collectives.backends.base import Group

Op = Callable[[torch.Tensor], torch.Tensor]


def _input(rank: int, world: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A (world, 2 * world, 3) tensor, distinct per rank, exactly summable in every dtype."""
    gen = torch.Generator().manual_seed(7 + rank)
    return (torch.randint(-40, 40, (world, 2 * world, 3), generator=gen) / 4).to(dtype)


def _sync_ops(world: int) -> dict[str, Op]:
    ring = [(i, (i + 1) % world) for i in range(world)]
    return {
        "psum": lambda x: psum(x, "dp"),
        "pmean": lambda x: pmean(x, "dp"),
        "all_gather": lambda x: all_gather(x, "dp"),
        "all_gather_dim1_tiled": lambda x: all_gather(x, "dp", dim=1, tiled=True),
        "psum_scatter": lambda x: psum_scatter(x, "dp"),
        "psum_scatter_tiled_dim1": lambda x: psum_scatter(x, "dp", dim=1, tiled=True),  # layout copies
        "all_to_all": lambda x: all_to_all(x, "dp", 0, 0),
        "all_to_all_tiled": lambda x: all_to_all(x, "dp", 1, 2, tiled=True),
        "broadcast_root0": lambda x: broadcast(x, "dp", root=0),
        "broadcast_last": lambda x: broadcast(x, "dp", root=world - 1),
        "ppermute_ring": lambda x: ppermute(x, "dp", ring),
        "ppermute_partial": lambda x: ppermute(x, "dp", ring[:-1]),  # index 0 gets zeros
        "ppermute_self": lambda x: ppermute(x, "dp", [(i, i) for i in range(world)]),
    }


def _async_ops(world: int) -> dict[str, Callable[[torch.Tensor], Any]]:
    ring = [(i, (i + 1) % world) for i in range(world)]
    return {
        "psum": lambda x: psum_async(x, "dp"),
        "all_gather": lambda x: all_gather_async(x, "dp"),
        "psum_scatter": lambda x: psum_scatter_async(x, "dp"),
        "psum_scatter_tiled_dim1": lambda x: psum_scatter_async(x, "dp", dim=1, tiled=True),
        "all_to_all": lambda x: all_to_all_async(x, "dp", 0, 0),
        "broadcast_root0": lambda x: broadcast_async(x, "dp", root=0),
        "broadcast_last": lambda x: broadcast_async(x, "dp", root=world - 1),
        "ppermute_ring": lambda x: ppermute_async(x, "dp", ring),
        "ppermute_self": lambda x: ppermute_async(x, "dp", [(i, i) for i in range(world)]),
    }


def _backend_ops(world: int) -> dict[str, Callable[[Any, torch.Tensor, Group, bool], torch.Tensor]]:
    """The raw primitives, on a group in axis order and on one listed in reverse order."""
    ring = [(i, (i + 1) % world) for i in range(world)]
    return {
        "all_reduce": lambda b, x, g, s: b.all_reduce(x, g, snapshot=s).wait(),
        "all_gather": lambda b, x, g, s: b.all_gather(x, g, snapshot=s).wait(),
        "reduce_scatter": lambda b, x, g, s: b.reduce_scatter(x, g, snapshot=s).wait(),
        "all_to_all": lambda b, x, g, s: b.all_to_all(x, g, snapshot=s).wait(),
        "broadcast_root0": lambda b, x, g, s: b.broadcast(x, 0, g, snapshot=s).wait(),
        "broadcast_root1": lambda b, x, g, s: b.broadcast(x, 1, g, snapshot=s).wait(),
        "permute_ring": lambda b, x, g, s: b.permute(x, ring, g, snapshot=s).wait(),
        "permute_partial": lambda b, x, g, s: b.permute(x, ring[:-1], g, snapshot=s).wait(),
        # index 0 keeps a copy and also sends it (one source, two destinations)
        "permute_self_and_send": lambda b, x, g, s: b.permute(x, [(0, 0), (0, world - 1)], g, snapshot=s).wait(),
    }


def _check_result(name: str, x: torch.Tensor, x_ref: torch.Tensor, y: torch.Tensor) -> None:
    """``x`` was not written, and ``y`` shares nothing with it (mutate one, the other stays)."""
    assert torch.equal(x, x_ref), f"{name}: the collective wrote into its input"
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), f"{name}: result is a view of x"
    y_ref = y.clone()
    y.add_(1000)
    assert torch.equal(x, x_ref), f"{name}: mutating the result changed the input"
    x.sub_(77)
    assert torch.equal(y, y_ref + 1000), f"{name}: mutating the input changed the result"
    x.copy_(x_ref)
    y.copy_(y_ref)


def no_alias(world: int) -> dict[str, torch.Tensor]:
    """Rank program: every sync and async collective and raw primitive, checked for aliasing.

    Returns each result (taken before any mutation) so the parent can compare
    the backends, and checks across ranks that no two results share storage:
    after a barrier every rank adds its own marker to its result, and after
    another barrier each result must hold exactly its own marker.
    """
    mesh = Mesh(dp=world)
    rank = mesh.rank
    backend = mesh.backend
    results: dict[str, torch.Tensor] = {}
    held: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, result, its value)

    def barrier() -> None:
        psum(torch.zeros(1), "dp")

    with mesh:
        for name, op in _sync_ops(world).items():
            x = _input(rank, world)
            x_ref = x.clone()
            y = op(x)
            _check_result(f"sync {name}", x, x_ref, y)
            results[f"sync_{name}"] = y.clone()
            held.append((f"sync {name}", y, y.clone()))

        for name, op in _async_ops(world).items():
            x = _input(rank, world)
            x_ref = x.clone()
            handle = op(x)
            x.mul_(-3)  # the async contract: x may change at once
            y = handle.wait()
            x.copy_(x_ref)
            _check_result(f"async {name}", x, x_ref, y)
            results[f"async_{name}"] = y.clone()
            held.append((f"async {name}", y, y.clone()))

        # A donated input may be reduced in (gloo): its result is checked against the sync one, and
        # shares nothing with it.
        for name, dim in (("psum_scatter", 0), ("psum_scatter_tiled_dim1", 1)):
            x = _input(rank, world)
            y = psum_scatter_async(x, "dp", dim=dim, tiled=dim == 1, donate=True).wait()
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), f"donated {name}: a view of x"
            results[f"donated_{name}"] = y.clone()
            held.append((f"donated {name}", y, y.clone()))

        ints = torch.arange(world * 4).reshape(world, 4) + 10 * rank
        ints_ref = ints.clone()
        y = psum(ints, "dp")
        _check_result("sync psum int64", ints, ints_ref, y)
        held.append(("sync psum int64", y, y.clone()))

        group = mesh.group("dp")
        groups = {"axis_order": group, "reversed": Group("dp", tuple(reversed(group.ranks)))}
        for group_name, group in groups.items():
            for name, call in _backend_ops(world).items():
                for snapshot in (False, True):
                    x = _input(rank, world)[:, :world]  # (world, world, 3)
                    x_ref = x.clone()
                    y = call(backend, x, group, snapshot)
                    label = f"backend {name} {group_name} snapshot={snapshot}"
                    _check_result(label, x, x_ref, y)
                    results[label] = y.clone()
                    held.append((label, y, y.clone()))

        barrier()
        for _, y, _ in held:
            y.add_(1 + rank)
        barrier()
        for label, y, value in held:
            assert torch.equal(y, value + (1 + rank)), f"{label}: another rank's result shares storage with ours"
    return results


def _async_matches_sync(results: dict[str, torch.Tensor]) -> None:
    for key, value in results.items():
        for kind in ("async_", "donated_"):
            if key.startswith(kind):
                sync = results["sync_" + key.removeprefix(kind)]
                assert torch.equal(value, sync), f"{key}: result differs from sync (snapshot taken too late?)"


@pytest.mark.parametrize("world", [2, 3])
def test_no_alias_on_threads(world):
    per_rank = launch(no_alias, world, args=(world,))
    for results in per_rank:
        _async_matches_sync(results)
    # snapshot=True and snapshot=False give identical results
    for results in per_rank:
        for key, value in results.items():
            if "snapshot=False" in key:
                assert torch.equal(value, results[key.replace("snapshot=False", "snapshot=True")]), key


@pytest.mark.gloo
def test_no_alias_on_gloo_matches_threads(gloo2):
    world = gloo2.world
    on_gloo = gloo2.run(no_alias, world)
    on_threads = launch(no_alias, world, args=(world,))
    for rank, (got, want) in enumerate(zip(on_gloo, on_threads, strict=True)):
        _async_matches_sync(got)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"rank {rank} {key}: gloo differs from threads"


def gloo_reduce_scatter_reads_only(world: int) -> bool:
    """Rank program: torch's reduce-scatter on gloo leaves its input unchanged (several sizes and dtypes)."""
    import torch.distributed as dist

    flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for numel in (world, 1000 * world, (1 << 18) * world):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            x = (torch.arange(numel) % 97 + 3 * dist.get_rank() + 1).to(dtype)
            x_ref = x.clone()
            out = torch.empty(numel // world, dtype=dtype)
            flat(out, x, async_op=True).wait()
            if not torch.equal(x, x_ref):
                return False
    return True


@pytest.mark.gloo
def test_gloo_reduce_scatter_leaves_its_input_unchanged(gloo2):
    # TorchDistributedBackend.reduce_scatter(snapshot=False) hands torch the caller's tensor.
    assert all(gloo2.run(gloo_reduce_scatter_reads_only, gloo2.world))


def gloo_donated_reduce_scatter_runs_in_place(world: int) -> bool:
    """Rank program: a donated reduce-scatter on gloo all-reduces its input in place (no copy of it is
    made: ZeRO's flat gradients are donated), and its result is this rank's row of that sum."""
    mesh = Mesh(dp=world)
    x = _input(mesh.rank, world)
    want = psum(x, "dp", mesh=mesh)
    got = psum_scatter_async(x, "dp", mesh=mesh, donate=True).wait()
    return torch.equal(x, want) and torch.equal(got, want[mesh.rank])


@pytest.mark.gloo
def test_gloo_donated_reduce_scatter_runs_in_place(gloo2):
    assert all(gloo2.run(gloo_donated_reduce_scatter_runs_in_place, gloo2.world))
