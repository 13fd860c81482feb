"""TorchDistributedBackend on gloo against a plain local reference.

Every rank builds the same random tensors from a seed and uses the one of its
group index; the parent recomputes each primitive with a loop over group
indices (the conventions of ``backend.py``) and compares.

Equality is exact everywhere: data movement copies bits, and the inputs of the
reducing primitives are small dyadic rationals (multiples of 1/8 below 8), whose
sums of up to four terms are exact in every float dtype down to bfloat16, so
the result cannot depend on the order in which gloo adds.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from shardwise.collectives.backends.base import Group
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.errors import CollectiveError
from shardwise.collectives.mesh import Mesh

pytestmark = pytest.mark.gloo

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPE = (3, 2)  # multi-dim per-rank shape; row-wise ops get (group size, *SHAPE)
SEED = 1234


# -- inputs and reference (run in the parent and on every rank) ------------------------
def _inputs(n: int, dtype: torch.dtype, seed: int = SEED) -> dict[str, list[torch.Tensor]]:
    """Per group index: values to move (full mantissa) and values to sum (exactly summable)."""
    gen = torch.Generator().manual_seed(seed)

    def moved(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    def summed(*shape: int) -> torch.Tensor:
        return (torch.randint(-63, 64, shape, generator=gen) / 8).to(dtype)

    return {
        "move": [moved(*SHAPE) for _ in range(n)],
        "move_rows": [moved(n, *SHAPE) for _ in range(n)],
        "sum": [summed(*SHAPE) for _ in range(n)],
        "sum_rows": [summed(n, *SHAPE) for _ in range(n)],
    }


def _perms(n: int) -> dict[str, list[tuple[int, int]]]:
    return {
        "shift": [(j, j + 1) for j in range(n - 1)],  # index 0 receives nothing: zeros
        "self": [(n - 1, 0)] + [(j, j) for j in range(1, n)],  # self pairs are local copies
    }


def _reference(n: int, i: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What group index ``i`` of a group of ``n`` must receive from each primitive."""
    x = _inputs(n, dtype)
    result = {
        "all_reduce": _sum(x["sum"]),
        "all_gather": torch.stack(x["move"]),
        "reduce_scatter": _sum([rows[i] for rows in x["sum_rows"]]),
        "all_to_all": torch.stack([rows[i] for rows in x["move_rows"]]),
        "broadcast": x["move"][n - 1],
    }
    for name, pairs in _perms(n).items():
        sources = [s for s, d in pairs if d == i]
        result[f"permute_{name}"] = x["move"][sources[0]] if sources else torch.zeros(SHAPE, dtype=dtype)
    return result


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


# -- SPMD functions (module level: they travel to the worker processes by reference) ---
def _group(kind: str) -> Group:
    backend = current_backend()
    if kind in ("dp", "pp"):
        return Mesh(dp=2, pp=2).group(kind)
    if kind == "reversed":  # listed out of sorted order: results must follow this order
        return Group(kind, tuple(reversed(range(backend.world_size))))
    return Group(kind, tuple(range(backend.world_size)))


def _run_every_primitive(kinds: list[str], dtype: torch.dtype) -> dict[str, Any]:
    backend = current_backend()
    out: dict[str, Any] = {}
    for kind in kinds:
        group = _group(kind)
        i = group.index(backend.rank)
        x = {name: values[i] for name, values in _inputs(group.size, dtype).items()}
        before = {name: t.clone() for name, t in x.items()}
        got = {
            "all_reduce": backend.all_reduce(x["sum"], group).wait(),
            "all_gather": backend.all_gather(x["move"], group).wait(),
            "reduce_scatter": backend.reduce_scatter(x["sum_rows"], group).wait(),
            "all_to_all": backend.all_to_all(x["move_rows"], group).wait(),
            "broadcast": backend.broadcast(x["move"], group.size - 1, group).wait(),
        }
        for name, pairs in _perms(group.size).items():
            got[f"permute_{name}"] = backend.permute(x["move"], pairs, group).wait()
        untouched = all(torch.equal(before[name], x[name]) for name in x)
        out[kind] = {"ranks": group.ranks, "index": i, "got": got, "inputs_untouched": untouched}
    return out


def _permute_staged(dtype: torch.dtype) -> dict[str, Any]:
    """ppermute as it runs for a tensor gloo cannot carry (off the CPU): on a host copy, its result moved
    back. Forced here for CPU tensors, the one device this machine has (the GPU run: benchmarks/gpu.py)."""
    backend = current_backend()
    group = _group("reversed")
    i = group.index(backend.rank)
    x = _inputs(group.size, dtype)["move"][i]
    before = x.clone()
    stages = type(backend)._stages_permute
    type(backend)._stages_permute = lambda self, t: True  # type: ignore[method-assign]
    try:
        got = {f"permute_{name}": backend.permute(x, pairs, group).wait() for name, pairs in _perms(group.size).items()}
    finally:
        type(backend)._stages_permute = stages  # type: ignore[method-assign]
    return {"ranks": group.ranks, "index": i, "got": got, "inputs_untouched": torch.equal(before, x)}


def _overlap() -> dict[str, Any]:
    """Issue collectives without waiting, on two axes, while a peer arrives late."""
    mesh = Mesh(dp=2, pp=2)
    backend = mesh.backend
    x = torch.full((4,), float(mesh.rank + 1))
    for axis in ("dp", "pp"):  # creating a group's process group is synchronous: do it first
        backend.barrier(mesh.group(axis))
    if mesh.rank == 3:
        time.sleep(1.0)  # ranks 1 (pp peer) and 2 (dp peer) must not block while issuing
    start = time.monotonic()
    dp_sum = backend.all_reduce(x, mesh.group("dp"))
    pp_gather = backend.all_gather(x, mesh.group("pp"))
    dp_sum_again = backend.all_reduce(2 * x, mesh.group("dp"))
    issue_s = time.monotonic() - start
    completed_early = dp_sum.is_completed() and pp_gather.is_completed()
    # Waited in the reverse order of issue.
    results = [dp_sum_again.wait(), pp_gather.wait(), dp_sum.wait()]
    return {"issue_s": issue_s, "completed_early": completed_early, "results": results}


def _errors_are_clear() -> list[str]:
    """Call errors every rank makes alike (so no collective is left half-issued)."""
    mesh = Mesh(dp=2)
    backend, group = mesh.backend, mesh.group("dp")
    messages = []
    calls = [
        lambda: backend.reduce_scatter(torch.ones(3), group),
        lambda: backend.all_to_all(torch.ones(()), group),
        lambda: backend.broadcast(torch.ones(2), 5, group),
        lambda: backend.permute(torch.ones(2), [(0, 1), (1, 1)], group),
        lambda: backend.all_reduce(torch.ones(2), Group("other", (1 - mesh.rank,))),
        lambda: backend.all_reduce(torch.ones(2, dtype=torch.float8_e4m3fn), group),
    ]
    for call in calls:
        try:
            call().wait()
            messages.append("no error")
        except (ValueError, CollectiveError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    # The group still works after refused calls.
    messages.append(str(backend.all_reduce(torch.ones(2), group).wait().tolist()))
    return messages


def _backend_facts() -> dict[str, Any]:
    backend = current_backend()
    return {"name": backend.name, "device": backend.device, "timeout": backend.timeout, "rank": backend.rank}


# -- tests -----------------------------------------------------------------------------
def _check(results: list[dict[str, Any]], dtype: torch.dtype) -> None:
    for rank, per_kind in enumerate(results):
        for kind, r in per_kind.items():
            assert r["inputs_untouched"], f"rank {rank} {kind}: a primitive wrote into its input"
            expected = _reference(len(r["ranks"]), r["index"], dtype)
            for op, want in expected.items():
                got = r["got"][op]
                assert got.dtype == dtype and got.shape == want.shape, (rank, kind, op, got.shape, got.dtype)
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=0,
                    atol=0,
                    msg=lambda m, rank=rank, kind=kind, op=op: f"rank {rank} {kind} {op}: {m}",
                )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_primitive_world_2(gloo2: Any, dtype: torch.dtype) -> None:
    _check(gloo2.run(_run_every_primitive, ["world", "reversed"], dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_primitive_world_4_and_mesh_axes(gloo4: Any, dtype: torch.dtype) -> None:
    results = gloo4.run(_run_every_primitive, ["world", "reversed", "dp", "pp"], dtype)
    assert [r["dp"]["ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["pp"]["ranks"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    _check(results, dtype)


def test_a_permute_staged_through_the_host_is_the_permute(gloo2: Any) -> None:
    for rank, r in enumerate(gloo2.run(_permute_staged, torch.float32)):
        assert r["inputs_untouched"], rank
        want = _reference(len(r["ranks"]), r["index"], torch.float32)
        for op, got in r["got"].items():
            torch.testing.assert_close(got, want[op], rtol=0, atol=0,
                                       msg=lambda m, rank=rank, op=op: f"rank {rank} {op}: {m}")


def test_async_collectives_overlap(gloo4: Any) -> None:
    results = gloo4.run(_overlap)
    for rank in (0, 1, 2):
        # Issuing returned at once although rank 3 was still asleep.
        assert results[rank]["issue_s"] < 0.5, results[rank]
    # Ranks 1 (dp with 3) and 2 (pp with 3) cannot have completed before rank 3 woke up.
    assert not results[1]["completed_early"] and not results[2]["completed_early"]
    values = [torch.full((4,), float(r + 1)) for r in range(4)]
    for rank, r in enumerate(results):
        dp_peers = Mesh(dp=2, pp=2).group_ranks("dp", rank)
        pp_peers = Mesh(dp=2, pp=2).group_ranks("pp", rank)
        dp_sum = sum(values[p] for p in dp_peers)
        torch.testing.assert_close(r["results"][0], 2 * dp_sum, rtol=0, atol=0)
        torch.testing.assert_close(r["results"][1], torch.stack([values[p] for p in pp_peers]), rtol=0, atol=0)
        torch.testing.assert_close(r["results"][2], dp_sum, rtol=0, atol=0)


def test_call_errors_name_the_problem(gloo2: Any) -> None:
    messages = gloo2.run(_errors_are_clear)[0]
    shape, leading, root, pairs, member, dtype, after = messages
    assert "shape (group size 2, ...)" in shape and "(3,)" in shape
    assert "shape (group size 2, ...)" in leading
    assert "root 5 is outside" in root
    assert "same destination" in pairs
    assert "rank 0 is not in the group of axis 'other'" in member
    assert "refused dtype torch.float8_e4m3fn" in dtype and "axis 'dp'" in dtype
    assert after == "[2.0, 2.0]"


def test_from_initialized_describes_the_world(gloo2: Any) -> None:
    facts = gloo2.run(_backend_facts)
    assert [f["rank"] for f in facts] == [0, 1]
    assert all(f["name"] == "gloo" and f["device"] == torch.device("cpu") for f in facts)
    assert all(f["timeout"] == 60.0 for f in facts)
