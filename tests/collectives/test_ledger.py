"""The communication ledger: records, exact bytes sent per rank, backward phases, summaries.

Expected send volumes are computed here by simulating each algorithm step by
step (which chunk a rank sends at which step), independently of the closed
formulas in ``shardwise/collectives/ledger.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.collectives import (
    CommRecord,
    Mesh,
    all_gather,
    all_to_all,
    broadcast,
    broadcast_async,
    comm_ledger,
    launch,
    pmean,
    ppermute,
    psum,
    psum_scatter,
    pvary,
)

worlds = st.integers(1, 8)


def spmd(world: int, body: Callable[[int], Any], mesh: Mesh | None = None) -> list[Any]:
    mesh = mesh or Mesh(dp=world)

    def main() -> Any:
        with mesh:
            return body(mesh.rank)

    return launch(main, world)


def ring_all_reduce_sent_elements(numel: int, n: int, i: int) -> int:
    """Simulate a ring all-reduce over torch.tensor_split chunks: elements rank i sends."""
    if n == 1:
        return 0
    sizes = [len(c) for c in torch.tensor_split(torch.arange(numel), n)]
    reduce_scatter = sum(sizes[(i - step) % n] for step in range(n - 1))
    all_gather_phase = sum(sizes[(i + 1 - step) % n] for step in range(n - 1))
    return reduce_scatter + all_gather_phase


def chain_senders(root: int, n: int) -> set[int]:
    """Ranks that forward the message in the pipelined chain root, root+1, ... (mod n)."""
    order = [(root + k) % n for k in range(n)]
    return set(order[:-1])


def by_rank(records: tuple[CommRecord, ...], op: str) -> dict[int, CommRecord]:
    found = [r for r in records if r.op == op]
    assert len({r.rank for r in found}) == len(found), f"several {op} records per rank: {found}"
    return {r.rank: r for r in found}


@given(world=worlds, numel=st.integers(1, 23), dtype=st.sampled_from([torch.float16, torch.float64, torch.int32]))
def test_psum_sends_the_ring_chunks_even_when_they_are_uneven(world, numel, dtype):
    with comm_ledger() as ledger:
        spmd(world, lambda r: psum(torch.ones(numel, dtype=dtype), "dp"))
    records = by_rank(ledger.records, "psum")
    assert sorted(records) == list(range(world))
    itemsize = torch.ones(1, dtype=dtype).element_size()
    for rank, rec in records.items():
        assert rec.sent_bytes == itemsize * ring_all_reduce_sent_elements(numel, world, rank)
        assert (rec.axis, rec.group_size, rec.shape, rec.phase) == ("dp", world, (numel,), "forward")
        assert rec.nbytes == numel * itemsize and rec.dtype == str(dtype).removeprefix("torch.")
    if numel % world == 0:
        assert all(rec.sent_bytes == 2 * rec.nbytes * (world - 1) // world for rec in records.values())


@given(world=worlds, rows=st.integers(1, 3))
def test_gather_scatter_and_all_to_all_volumes(world, rows):
    x_bytes = world * rows * 2 * 4  # float32 (world * rows, 2)

    def body(r: int) -> None:
        x = torch.ones(world * rows, 2)
        all_gather(x, "dp", dim=1)
        psum_scatter(x, "dp", tiled=True)
        all_to_all(x, "dp", 0, 1, tiled=True)
        pmean(x, "dp")

    with comm_ledger() as ledger:
        spmd(world, body)
    for rank in range(world):
        assert by_rank(ledger.records, "all_gather")[rank].sent_bytes == (world - 1) * x_bytes
        # reduce-scatter ring: n - 1 steps, one chunk of B / n each
        assert by_rank(ledger.records, "psum_scatter")[rank].sent_bytes == (world - 1) * (x_bytes // world)
        # pairwise exchange: every chunk but its own
        assert by_rank(ledger.records, "all_to_all")[rank].sent_bytes == (world - 1) * (x_bytes // world)
        assert by_rank(ledger.records, "pmean")[rank].sent_bytes == 4 * ring_all_reduce_sent_elements(
            world * rows * 2, world, rank
        )


@given(world=worlds, data=st.data())
def test_broadcast_and_ppermute_volumes(world, data):
    root = data.draw(st.integers(0, world - 1))
    targets = data.draw(st.permutations(range(world)))
    keep = data.draw(st.lists(st.booleans(), min_size=world, max_size=world))
    perm = [(s, d) for s, (d, k) in enumerate(zip(targets, keep, strict=True)) if k]

    def body(r: int) -> None:
        broadcast(torch.ones(3, dtype=torch.float64), "dp", root=root)
        ppermute(torch.ones(3, dtype=torch.float64), "dp", perm)

    with comm_ledger() as ledger:
        spmd(world, body)
    senders = chain_senders(root, world)
    moving_sources = {s for s, d in perm if s != d}
    for rank in range(world):
        assert by_rank(ledger.records, "broadcast")[rank].sent_bytes == (24 if rank in senders else 0)
        assert by_rank(ledger.records, "ppermute")[rank].sent_bytes == (24 if rank in moving_sources else 0)


def test_a_world_of_one_sends_nothing():
    def body(r: int) -> None:
        x = torch.ones(4)
        psum(x, "dp"), all_gather(x, "dp"), psum_scatter(x, "dp", tiled=True)
        all_to_all(x, "dp", 0, 0, tiled=True), broadcast(x, "dp"), ppermute(x, "dp", [(0, 0)])

    with comm_ledger() as ledger:
        spmd(1, body)
    assert len(ledger.records) == 6 and ledger.sent_bytes() == 0


def test_backward_collectives_are_recorded_with_phase_backward():
    world = 4

    def body(r: int) -> None:
        x = torch.ones(2, 3, requires_grad=True)
        y = all_gather(x, "dp", dim=0, tiled=True)  # backward: psum_scatter of (8, 3)
        z = broadcast(pvary(y.sum(0), "dp"), "dp", root=1)  # backward: psum (broadcast), psum (pvary)
        psum(z, "dp").sum().backward()  # psum's backward is the identity: nothing recorded

    with comm_ledger() as ledger:
        spmd(world, body)
    phases = {(r.op, r.phase): 0 for r in ledger.records}
    for r in ledger.records:
        phases[(r.op, r.phase)] += 1
    assert phases == {
        ("all_gather", "forward"): world,
        ("broadcast", "forward"): world,
        ("psum", "forward"): world,
        ("psum_scatter", "backward"): world,
        ("psum", "backward"): 2 * world,
    }
    scatter = by_rank(ledger.records, "psum_scatter")[0]
    assert scatter.shape == (8, 3) and scatter.sent_bytes == 8 * 3 * 4 * 3 // 4


def test_torch_func_grad_backward_is_recorded_too():
    def body(r: int) -> torch.Tensor:
        return torch.func.grad(lambda x: all_gather(x, "dp").pow(2).sum())(torch.ones(3))

    with comm_ledger() as ledger:
        spmd(2, body)
    assert sorted((r.op, r.phase, r.rank) for r in ledger.records) == [
        ("all_gather", "forward", 0),
        ("all_gather", "forward", 1),
        ("psum_scatter", "backward", 0),
        ("psum_scatter", "backward", 1),
    ]


def test_summary_groups_per_axis_and_op():
    mesh = Mesh(dp=2, tp=3)

    def body(r: int) -> None:
        psum(torch.ones(6), "tp")  # 24 B, n = 3: 2 * 24 * 2/3 = 32 B per rank
        psum(torch.ones(6), "tp")
        all_gather(torch.ones(5), "dp")  # 20 B, n = 2: 20 B per rank

    with comm_ledger() as ledger:
        spmd(mesh.size, body, mesh)
    summary = ledger.summary()
    assert list(summary) == [("dp", "all_gather"), ("tp", "psum")]
    tp = summary[("tp", "psum")]
    assert (tp.count, tp.nbytes, tp.sent_bytes) == (12, 12 * 24, 12 * 32)
    assert tp.sent_bytes_per_rank == {r: 64 for r in range(6)}
    dp = summary[("dp", "all_gather")]
    assert (dp.count, dp.nbytes, dp.sent_bytes) == (6, 6 * 20, 6 * 20)
    assert ledger.sent_bytes(axis="tp") == 12 * 32
    assert ledger.sent_bytes(rank=4) == 64 + 20
    assert ledger.sent_bytes(rank=4, op="all_gather", axis="dp") == 20
    table = str(ledger)
    assert "psum" in table and "all_gather" in table and "0:20" in table


def test_a_ledger_opened_around_launch_sees_every_rank_and_async_ops():
    world = 8
    with comm_ledger() as ledger:
        spmd(world, lambda r: broadcast_async(torch.ones(2), "dp", root=3).wait())
    assert {r.rank for r in ledger.records} == set(range(world))
    assert ledger.sent_bytes() == (world - 1) * 8


def test_ledgers_nest_and_a_rank_can_open_its_own():
    def body(r: int) -> int:
        psum(torch.ones(2), "dp")
        with comm_ledger() as own:
            psum(torch.ones(2), "dp")
        return len(own.records)

    with comm_ledger() as outer, comm_ledger() as inner:
        own_counts = spmd(3, body)
    assert own_counts == [1, 1, 1]
    assert len(outer.records) == len(inner.records) == 6


def test_no_ledger_means_no_records_and_jsonl_round_trips():
    spmd(2, lambda r: psum(torch.ones(2), "dp"))  # nothing open: must simply work
    with comm_ledger() as ledger:
        spmd(2, lambda r: psum(torch.ones(2, dtype=torch.bfloat16), "dp"))
    rows = [json.loads(line) for line in ledger.to_jsonl().splitlines()]
    assert sorted(row["rank"] for row in rows) == [0, 1]
    rec = CommRecord(**{**rows[0], "shape": tuple(rows[0]["shape"])})
    assert rec in ledger.records and rec.dtype == "bfloat16"


@pytest.mark.parametrize("world", [8])
def test_appends_from_many_ranks_are_not_lost(world):
    with comm_ledger() as ledger:
        spmd(world, lambda r: [psum(torch.ones(1), "dp") for _ in range(50)])
    assert len(ledger.records) == world * 50
