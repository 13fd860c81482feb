"""gloo's reduce-scatter and all-gather by direct exchange (collectives/backends/gloo_exchange.py),
over loopback TCP and through shared memory (shared_memory_exchange.py, the default on one host).

Layer-sized messages take the exchange; these tests make them big enough to run through several
receive chunks (or slots) with a remainder, on groups listed in and out of rank order and on mesh
axes, with several exchanges in flight at once, and check every result exactly (the summed values
are small dyadic rationals, exact in any order down to bfloat16), the inputs left alone unless
donated, and a peer that never arrives ending in a timeout that names the collective.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.collectives import RankFailed
from shardwise.collectives.backends import gloo_exchange, shared_memory_exchange
from shardwise.collectives.backends.base import Group
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.collectives.mesh import Mesh

pytestmark = pytest.mark.gloo

# Per member: 2.3 chunks of float32 (three chunks, the last one short; the group's thread streams
# them, through chunks made small here to keep the test quick), or a row whose receives fit the two
# receive buffers of the default chunk (the caller posts it whole), both over loopback TCP; or 2.3
# shared-memory slots of float32 (a reduce-scatter's chunk is a slot's n-th: more chunks still).
SMALL_CHUNK = gloo_exchange.MIN_EXCHANGE_BYTES
ROW = (SMALL_CHUNK // 4) * 23 // 10 + 7
SMALL_ROW = gloo_exchange.MIN_EXCHANGE_BYTES // 4 * 2 + 3
SHARED_ROW = (shared_memory_exchange.SLOT_BYTES // 4) * 23 // 10 + 7
CASES = {"streamed": (ROW, SMALL_CHUNK, "tcp"), "posted": (SMALL_ROW, gloo_exchange.CHUNK_BYTES, "tcp"),
         "shared": (SHARED_ROW, gloo_exchange.CHUNK_BYTES, "shared")}
IN_FLIGHT = 3


@functools.lru_cache(maxsize=8)
def _summed(n: int, dtype: torch.dtype, seed: int, row: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(-63, 64, (n, row), generator=gen) / 8).to(dtype) for _ in range(n)]


def _moved(n: int, dtype: torch.dtype, seed: int, row: int) -> list[torch.Tensor]:
    return [_moved_by(j, dtype, seed, row) for j in range(n)]


def _moved_by(member: int, dtype: torch.dtype, seed: int, row: int) -> torch.Tensor:
    """Member ``member``'s input, drawn from a stream of its own: a rank draws its row alone, not
    every member's (at 600,000 elements a row, the draws were most of a rank's time). A copy: the
    collectives under test may not write into it, and a cached one must stay as drawn if they do."""
    return _drawn(member, dtype, seed, row).clone()


@functools.lru_cache(maxsize=64)
def _drawn(member: int, dtype: torch.dtype, seed: int, row: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + member)
    return torch.randn(row // 2, 2, generator=gen, dtype=torch.float64).to(dtype)


def _group(kind: str) -> Group:
    backend = current_backend()
    if kind in ("dp", "pp"):
        return Mesh(dp=2, pp=2).group(kind)
    if kind == "reversed":
        return Group(kind, tuple(reversed(range(backend.world_size))))
    return Group(kind, tuple(range(backend.world_size)))


def _groups(kinds: list[str], transport: str) -> Iterator[tuple[str, Group, int]]:
    """Each kind's group and this rank's index in it, with the exchanges over ``transport``."""
    rank = current_backend().rank
    with shared_memory_exchange.loopback_exchanges() if transport == "tcp" else contextlib.nullcontext():
        for kind in kinds:
            group = _group(kind)
            yield kind, group, group.index(rank)


def _exchange_all(kinds: list[str], dtype: torch.dtype, row: int, chunk_bytes: int, transport: str) -> dict[str, Any]:
    """Per group kind: IN_FLIGHT reduce-scatters (donated and not) and all-gathers issued before
    any is waited, waited in reverse order."""
    default, gloo_exchange.CHUNK_BYTES = gloo_exchange.CHUNK_BYTES, chunk_bytes
    try:
        with shared_memory_exchange.loopback_exchanges() if transport == "tcp" else contextlib.nullcontext():
            out = _exchange_each(kinds, dtype, row)
    finally:
        gloo_exchange.CHUNK_BYTES = default
    for r in out.values():
        r["transport"] = "shared" if transport == "shared" and r["shared"] else "tcp"
    return out


def _exchange_each(kinds: list[str], dtype: torch.dtype, row: int) -> dict[str, Any]:
    backend = current_backend()
    out: dict[str, Any] = {}
    for kind in kinds:
        group = _group(kind)
        i = group.index(backend.rank)
        sums = [_summed(group.size, dtype, seed, row)[i] for seed in range(IN_FLIGHT)]
        moves = [_moved_by(i, dtype, 100 + seed, row) for seed in range(IN_FLIGHT)]
        kept = [t.clone() for t in sums + moves]
        works = []
        for s in range(IN_FLIGHT):
            donated = s % 2 == 1
            works.append(backend.reduce_scatter(sums[s].clone() if donated else sums[s], group, donate=donated))
            works.append(backend.all_gather(moves[s], group))
        got = [w.wait() for w in reversed(works)][::-1]
        out[kind] = {
            "index": i, "size": group.size, "got": got,
            "untouched": all(torch.equal(a, b) for a, b in zip(kept, sums + moves, strict=True)),
            # ZeRO-3 frees a gathered unit by resizing its storage to nothing
            "resizable": all(t.untyped_storage().resizable() for t in got),
            "exchanged": tuple(sorted(group.ranks)) in backend._exchange_groups,
            "shared": backend._exchange_groups[tuple(sorted(group.ranks))].shared is not None,
        }
    return out


def _check(results: list[dict[str, Any]], dtype: torch.dtype, row: int, transport: str) -> None:
    for rank, per_kind in enumerate(results):
        for kind, r in per_kind.items():
            assert r["exchanged"], f"rank {rank} {kind}: the collectives did not take the exchange"
            assert r["transport"] == transport, f"rank {rank} {kind}: over {r['transport']}, not {transport}"
            assert r["untouched"], f"rank {rank} {kind}: a collective wrote into an input it was not given"
            assert r["resizable"], f"rank {rank} {kind}: a result's storage cannot be freed by resizing it"
            n, i = r["size"], r["index"]
            for s in range(IN_FLIGHT):
                mine = [x[i] for x in _summed(n, dtype, s, row)]
                want_sum = mine[0].clone()
                for part in mine[1:]:
                    want_sum += part
                want_gather = torch.stack(_moved(n, dtype, 100 + s, row))
                got_sum, got_gather = r["got"][2 * s], r["got"][2 * s + 1]
                torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0, msg=f"rank {rank} {kind} rs {s}")
                torch.testing.assert_close(got_gather, want_gather, rtol=0, atol=0, msg=f"rank {rank} {kind} ag {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_exchanges_world_2(gloo2: Any, dtype: torch.dtype, case: str) -> None:
    row, chunk, transport = CASES[case]
    _check(gloo2.run(_exchange_all, ["world", "reversed"], dtype, row, chunk, transport), dtype, row, transport)


@pytest.mark.parametrize("case", list(CASES))
def test_exchanges_world_4_and_mesh_axes(gloo4: Any, case: str) -> None:
    row, chunk, transport = CASES[case]
    if transport == "shared":  # a reduce-scatter's chunk is a slot's quarter here: 2.3 of them still
        row //= 4
    _check(gloo4.run(_exchange_all, ["world", "reversed", "dp", "pp"], torch.float32, row, chunk, transport),
           torch.float32, row, transport)


def test_small_or_odd_messages_keep_gloos_own_collectives() -> None:
    group = Group("dp", (0, 1))
    assert gloo_exchange.exchanges(torch.empty(2, gloo_exchange.MIN_EXCHANGE_BYTES // 4), group)
    assert not gloo_exchange.exchanges(torch.empty(2, gloo_exchange.MIN_EXCHANGE_BYTES // 8), group)
    assert not gloo_exchange.exchanges(torch.empty(2, 1 << 20, dtype=torch.float8_e4m3fn), group)
    assert not gloo_exchange.exchanges(torch.empty(1, 1 << 20), Group("dp", (0,)))
    # An all-gather's input is one member's part: the same bytes per member as the Plan asks of the
    # gathered whole (sized_for_exchange), not a member's part over the members again.
    part = torch.empty(gloo_exchange.MIN_EXCHANGE_BYTES // 4)
    four = Group("dp", (0, 1, 2, 3))
    assert gloo_exchange.exchanges(part, four, one_member=True) and not gloo_exchange.exchanges(part, four)
    assert gloo_exchange.sized_for_exchange(part.nbytes * 4, part.dtype, 4)
    assert not gloo_exchange.exchanges(part[1:], four, one_member=True)


# -- a reduce-scatter of pieces (ZeRO's bucket of gradient slices) --------------------------
def _reduced_from_pieces(kinds: list[str], row: int, dtype: torch.dtype, transport: str) -> dict[str, Any]:
    """Per group kind: IN_FLIGHT reduce-scatters of float32 rows given as pieces (cut at other
    places per member row, each piece a tensor of its own), summed in ``dtype``, beside the same
    buffer concatenated and reduce-scattered whole; the path taken, and the pieces left alone."""
    backend = current_backend()
    out: dict[str, Any] = {}
    for kind, group, i in _groups(kinds, transport):
        axis = {"dp": "dp", "pp": "pp"}.get(kind)
        mesh = Mesh(dp=2, pp=2) if axis else None
        inputs = [_summed(group.size, torch.float32, 300 + s, row)[i] for s in range(IN_FLIGHT)]
        rows = [[[piece.clone() for piece in torch.split(x[j], list(_cut(row, j + s)))]
                 for j in range(group.size)] for s, x in enumerate(inputs)]
        kept = [[torch.cat(r) for r in rs] for rs in rows]  # each row's values, compared whole
        works = [_issue_rows(backend, r, dtype, group, axis, mesh) for r in rows]
        got = [w.wait() for w in reversed(works)][::-1]
        whole = [backend.reduce_scatter(x.to(dtype), group).wait() for x in inputs]
        out[kind] = {
            "got": got, "whole": whole, "index": i, "size": group.size,
            "untouched": all(torch.equal(torch.cat(r), k) for rs, ks in zip(rows, kept, strict=True)
                             for r, k in zip(rs, ks, strict=True)),
            "path": _path(inputs[0][0], group),
        }
    return out


def _issue_rows(backend: Any, rows: list[list[torch.Tensor]], dtype: torch.dtype, group: Group, axis: str | None,
                mesh: Mesh | None) -> Any:
    """Through the op on a mesh axis, else the backend's call on the group (listed in and out of order)."""
    if axis is not None:
        return sw.collectives.ops.psum_scatter_rows_async(rows, dtype, axis, mesh=mesh)
    return backend.reduce_scatter_rows(rows, dtype, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transport", ["shared", "tcp"])
def test_a_reduce_scatter_of_pieces_is_the_reduce_scatter_of_their_buffer_bit_for_bit(
        gloo2: Any, gloo4: Any, dtype: torch.dtype, transport: str) -> None:
    """Rows given as pieces (ZeRO's bucket of gradient slices, not concatenated) reduce to what the
    concatenated buffer reduces to, bitwise, summed in the dtype asked for (bfloat16: each piece
    converted on its way into the slots), with several in flight, on groups in and out of rank
    order and on mesh axes; the pieces are left as they were."""
    row = SHARED_ROW // 4 if transport == "shared" else ROW
    row -= row % 2
    for pool, kinds in ((gloo2, ["world", "reversed"]), (gloo4, ["world", "reversed", "dp", "pp"])):
        for rank, per_kind in enumerate(pool.run(_reduced_from_pieces, kinds, row, dtype, transport)):
            for kind, r in per_kind.items():
                where = f"rank {rank} of {4 if pool is gloo4 else 2}, {kind} ({transport}, {dtype})"
                assert r["path"] == transport, f"{where}: took {r['path']}"
                assert r["untouched"], f"{where}: a piece was written"
                n, i = r["size"], r["index"]
                for s, (got, whole) in enumerate(zip(r["got"], r["whole"], strict=True)):
                    mine = [x[i].to(dtype) for x in _summed(n, torch.float32, 300 + s, row)]
                    want = mine[0].clone()
                    for part in mine[1:]:
                        want += part
                    assert got.dtype == dtype, where
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{where}: reduce {s}")
                    assert torch.equal(got, whole), f"{where}: reduce {s} differs from the whole buffer's"


# -- a peer that never arrives -------------------------------------------------------------
TIMEOUT = 1.5


@pytest.fixture(scope="module")
def short_pool() -> Iterator[ProcessPool]:
    with ProcessPool(2, timeout=TIMEOUT) as pool:
        yield pool


def _rank() -> int:
    return current_backend().rank


def _rank_1_skips_a_reduce_scatter(transport: str) -> int:
    mesh = sw.Mesh(dp=2)
    x = torch.ones(2, gloo_exchange.CHUNK_BYTES // 2 + 1)  # streamed (by the group's thread either way)
    with shared_memory_exchange.loopback_exchanges() if transport == "tcp" else contextlib.nullcontext():
        sw.collectives.psum_scatter(x, "dp", mesh=mesh)  # both meet once (the exchange group is made)
        if mesh.rank != 1:
            sw.collectives.psum_scatter(x, "dp", mesh=mesh)
    return mesh.rank


@pytest.mark.parametrize("transport", ["tcp", "shared"])
def test_a_peer_that_skips_an_exchange_ends_in_a_timeout_naming_it(short_pool: ProcessPool, transport: str) -> None:
    short_pool.run(_rank)  # start the ranks first: only the faulty run is timed
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        short_pool.run(_rank_1_skips_a_reduce_scatter, transport)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert info.value.rank == 0, message
    assert "psum_scatter on axis 'dp'" in message and "timed out" in message, message
    assert elapsed < TIMEOUT + 8.0, elapsed


# -- choosing shared memory ----------------------------------------------------------------
def _open_with(patch: str) -> tuple[bool, str, list[str]]:
    """open_same_host on a new process group of both ranks, with one thing made to differ or fail
    on rank 1; what it gave, what it raised, and what it left in /dev/shm."""
    import glob
    import os

    import torch.distributed as dist

    backend = current_backend()
    pg = dist.new_group([0, 1], use_local_synchronization=True)
    module = shared_memory_exchange
    saved = (module._host_key, module._create_own, module.SLOT_BYTES)
    if backend.rank == 1:
        if patch == "host":
            module._host_key = lambda: "another host"  # type: ignore[assignment]
        elif patch == "shm":
            def refuse(*args: Any) -> Any:
                raise PermissionError("/dev/shm is read-only here")
            module._create_own = refuse  # type: ignore[assignment]
        elif patch == "slots":
            module.SLOT_BYTES //= 2
    try:
        made = module.open_same_host(pg, (0, 1), backend.rank, 30.0, lambda *a: RuntimeError(str(a)))
        outcome = (made is not None, "")
        if made is not None:
            _gather_then_close(made, backend.rank)
    except ValueError as exc:
        outcome = (False, str(exc))
    finally:
        module._host_key, module._create_own, module.SLOT_BYTES = saved  # type: ignore[assignment]
    dist.barrier(group=pg)
    # This rank's files (their names end with its pid): a member of another setup killed in it (a
    # fault test's) leaves its own, which the next setup sweeps once a minute old (sweep_stale).
    pid = os.getpid()
    return (*outcome, glob.glob(f"/dev/shm/shardwise-*-{pid}") + glob.glob(f"/dev/shm/shardwise-*-{pid}.fifo"))


def _gather_then_close(made: Any, rank: int) -> None:
    """An all-gather through ``made``, then ``close()``: the thread ends, the descriptors go, and a
    later exchange is refused."""
    row = 20_000
    got = made.all_gather(torch.full((row,), float(rank)), Group("dp", (0, 1)), "all_gather",
                          torch.Size([2, row])).wait()
    assert torch.equal(got, torch.stack([torch.zeros(row), torch.ones(row)])), got
    thread = made._jobs.thread
    made.close()
    thread.join(5.0)
    assert not thread.is_alive() and made._inbox == -1 and made._slots.numel() == 0
    with pytest.raises(sw.collectives.CollectiveError, match="closed"):
        made.all_gather(torch.ones(row), Group("dp", (0, 1)), "all_gather", torch.Size([2, row]))


@pytest.mark.parametrize("patch", ["none", "host", "shm", "slots"])
def test_shared_memory_only_when_every_member_can_and_nothing_is_left_behind(gloo2: Any, patch: str) -> None:
    """Members on different hosts or a member that cannot create its slots: every member keeps
    loopback TCP. Slots of different sizes: every member refuses, naming the sizes. Either way
    (and when it is taken) the files are gone from /dev/shm once the members have mapped them."""
    results = gloo2.run(_open_with, patch)
    for rank, (shared, error, left) in enumerate(results):
        assert left == [], f"rank {rank}: left in /dev/shm: {left}"
        assert shared == (patch == "none"), f"rank {rank} with {patch!r} different: shared memory {shared}"
        if patch == "slots":
            assert "slots of different sizes" in error and "SLOT_BYTES" in error, error
        else:
            assert error == "", error


def _setup_after_a_member_died() -> list[bool]:
    """Files as a member killed during a setup leaves them (its pid gone, older than STALE_SECONDS), on
    rank 0; then a setup of both ranks: whether each of those files is still there after it."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    backend = current_backend()
    stale: list[str] = []
    if backend.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(timeout=60)
        old = time.time() - 2 * shared_memory_exchange.STALE_SECONDS
        for suffix in ("", ".fifo"):
            path = f"/dev/shm/shardwise-00ff00ff00ff00ff-1-{child.pid}{suffix}"
            with open(path, "wb"):
                pass
            os.utime(path, (old, old))
            stale.append(path)
    pg = dist.new_group([0, 1], use_local_synchronization=True)
    dist.barrier(group=pg)
    made = shared_memory_exchange.open_same_host(pg, (0, 1), backend.rank, 30.0, lambda *a: RuntimeError(str(a)))
    assert made is not None
    made.close()
    dist.barrier(group=pg)
    return [os.path.exists(path) for path in stale]


def test_a_setup_sweeps_what_a_member_killed_during_one_left(gloo2: Any) -> None:
    assert gloo2.run(_setup_after_a_member_died) == [[False, False], []]


def _sums_of_random_floats(kinds: list[str]) -> dict[str, bool]:
    """Per group kind, whether a reduce-scatter of random floats (sums that depend on their order)
    is bitwise the same through shared memory and over TCP."""
    backend = current_backend()
    agree = {}
    for kind in kinds:
        group = _group(kind)
        x = torch.randn(group.size, 70_000, generator=torch.Generator().manual_seed(backend.rank))
        shared = backend.reduce_scatter(x, group).wait()
        with shared_memory_exchange.loopback_exchanges():
            tcp = backend.reduce_scatter(x, group).wait()
        agree[kind] = torch.equal(shared, tcp)
    return agree


def test_shared_memory_sums_in_the_tcp_exchanges_order(gloo4: Any) -> None:
    """The same additions in the same order over either transport, on groups listed in and out of
    rank order: a run's sums do not depend on whether its ranks share a host."""
    for rank, agree in enumerate(gloo4.run(_sums_of_random_floats, ["world", "reversed"])):
        assert all(agree.values()), f"rank {rank}: {agree}"


def _ranks_issue_different_all_gathers(differing: str) -> int:
    mesh = sw.Mesh(dp=2)
    numel = gloo_exchange.MIN_EXCHANGE_BYTES // 4 * 2
    if mesh.rank == 1 and differing == "length":
        numel += 8
    dtype = torch.int32 if mesh.rank == 1 and differing == "dtype" else torch.float32  # the same bytes
    sw.collectives.all_gather(torch.ones(numel, dtype=dtype), "dp", mesh=mesh)
    return mesh.rank


@pytest.mark.parametrize("differing", ["length", "dtype"])
def test_members_that_issue_different_exchanges_fail_them(short_pool: ProcessPool, differing: str) -> None:
    """Every member's chunks go through one stream of slots: an all-gather of another length or of
    another dtype of the same bytes on one member must fail the exchange on the others (naming what
    each issued), not hand them its bytes."""
    short_pool.run(_rank)
    with pytest.raises(RankFailed) as info:
        short_pool.run(_ranks_issue_different_all_gathers, differing)
    message = str(info.value)
    assert "issued different collectives" in message and "all_gather" in message, message


# -- all-gather into the caller's pieces -----------------------------------------------------
@functools.lru_cache(maxsize=16)
def _cut(row: int, seed: int) -> tuple[int, ...]:
    """Piece lengths laid end to end over ``row`` elements, at cuts no chunk or slot boundary shares:
    a few long pieces, then a run of 3,000 of one or two elements (a slot's chunk then spans more
    pieces than one read of the slots takes: shared_memory_exchange._IOV_MAX)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], row
    while left > row // 2:
        take = min(left, int(torch.randint(1, max(row // 3, 2), (1,), generator=gen)))
        lengths.append(take)
        left -= take
    for k in range(3000):
        if left <= 2:
            break
        lengths.append(1 + (k + seed) % 2)
        left -= lengths[-1]
    return (*lengths, left) if left else tuple(lengths)


GAP = 3  # elements left between two pieces in the destination: nothing may write them


def _rows_in(dest: torch.Tensor, n: int, row: int) -> list[list[torch.Tensor]]:
    """Each member's row as pieces of ``dest`` (cut differently per member), GAP apart: ``dest`` split at once
    into pieces and gaps, the gaps dropped (a slice per piece took twice the time)."""
    cuts = [_cut(row, j) for j in range(n)]
    views = dest.split([size for lengths in cuts for length in lengths for size in (length, GAP)])[::2]
    rows, at = [], 0
    for lengths in cuts:
        rows.append(list(views[at: at + len(lengths)]))
        at += len(lengths)
    return rows


def _gathered_into(kinds: list[str], dtype: torch.dtype, row: int, transport: str) -> dict[str, Any]:
    """Per group kind: IN_FLIGHT all-gathers into pieces, issued before any is waited and waited in
    reverse, their inputs given as one piece, as pieces cut at other places than the rows, and as
    pieces that are also this member's own row (its values where they lie: ZeRO's shards in the
    parameters); what landed in the pieces, whether anything outside them was written, and whether
    the inputs were left alone, unwritten."""
    backend = current_backend()
    out: dict[str, Any] = {}
    for kind, group, i in _groups(kinds, transport):
        moves = [_moved_by(i, dtype, 200 + s, row).reshape(-1) for s in range(IN_FLIGHT)]
        kept = [t.clone() for t in moves]
        n = group.size
        size = sum(row + GAP * len(_cut(row, j)) for j in range(n))  # every piece, each gap after it
        dests = [torch.full((size,), float("nan"), dtype=dtype) for _ in moves]
        rows = [_rows_in(d, n, moves[0].numel()) for d in dests]
        inputs = [[x] if s == 0 else list(torch.split(x, _cut(row, n + s))) for s, x in enumerate(moves)]
        rows[-1][i] = inputs[-1]  # the last gather's own row is its input where it lies
        versions = [[piece._version for piece in pieces] for pieces in inputs]
        works = [backend.all_gather_into(xs, r, group) for xs, r in zip(inputs, rows, strict=True)]
        returned = [w.wait() for w in reversed(works)][::-1]
        covered = [_covered(d.numel(), [pieces for pieces in r if pieces is not inputs[-1]])
                   for d, r in zip(dests, rows, strict=True)]
        out[kind] = {
            # Compared here, not in the test: the gathered rows are hundreds of MB to send back.
            "mismatches": [_mismatch(torch.stack([torch.cat(pieces) for pieces in r]),
                                     torch.stack([m.reshape(-1) for m in _moved(n, dtype, 200 + s, row)]))
                           for s, r in enumerate(rows)],
            "size": n,
            "outside_untouched": all(bool(d[~c].isnan().all()) for d, c in zip(dests, covered, strict=True)),
            "inputs_untouched": all(torch.equal(a, b) for a, b in zip(kept, moves, strict=True)) and versions == [
                [piece._version for piece in pieces] for pieces in inputs],
            "returns_empty": all(w.numel() == 0 and w.dtype == dtype for w in returned),
            "path": _path(moves[0], group),
        }
    return out


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None where ``got`` is ``want`` bit for bit (NaN where NaN), else where and how they differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    at = tuple(int(k) for k in (~same).nonzero()[0])
    return f"{int((~same).sum())} elements differ, the first at {at}: got {got[at].item()}, want {want[at].item()}"


def _covered(size: int, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Which of ``size`` elements the pieces of ``rows`` cover (views of one destination)."""
    pieces = [p for pieces in rows for p in pieces]
    starts = torch.tensor([p.storage_offset() for p in pieces])
    lengths = torch.tensor([p.numel() for p in pieces])
    # Element k of piece i lies at starts[i] + k: each piece's start repeated over its length, plus
    # the element's place within its piece.
    at = torch.repeat_interleave(starts, lengths)
    at += torch.arange(at.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    covered = torch.zeros(size, dtype=torch.bool)
    covered[at] = True
    return covered


def _path(x: torch.Tensor, group: Group) -> str:
    """Which transport a collective of ``x`` over ``group`` takes now."""
    if not gloo_exchange.exchanges(x, group, one_member=True):
        return "gloo's own"
    exchange = current_backend()._exchange_groups[tuple(sorted(group.ranks))]
    return "shared" if shared_memory_exchange.in_use(exchange.shared) else "tcp"


# Elements per member: several slots; enough for the TCP exchange (at least MIN_EXCHANGE_BYTES per
# member, in either dtype); too few for the exchanges.
GATHER_INTO = {
    "shared": lambda dtype: SHARED_ROW,
    "tcp": lambda dtype: gloo_exchange.MIN_EXCHANGE_BYTES * 4 // dtype.itemsize + 6,
    "gloo's own": lambda dtype: gloo_exchange.MIN_EXCHANGE_BYTES // 16,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(GATHER_INTO))
def test_all_gather_into_pieces_writes_each_members_row_there_and_nothing_else(
        gloo2: Any, gloo4: Any, dtype: torch.dtype, case: str) -> None:
    """Through shared memory (several slots per row, pieces cut across the slots' boundaries), over
    loopback TCP and through gloo's own all-gather (a message too small for the exchanges): every
    member's row lands in its pieces, nothing between them is written, the inputs (one piece, or
    several, or several that are this member's own row) are left alone and unwritten, and wait()
    returns an empty tensor; on groups listed in and out of rank order and on mesh axes."""
    row = GATHER_INTO[case](dtype)
    row -= row % 2
    transport = "shared" if case == "shared" else "tcp"
    for pool, kinds in ((gloo2, ["world", "reversed"]), (gloo4, ["world", "reversed", "dp", "pp"])):
        for rank, per_kind in enumerate(pool.run(_gathered_into, kinds, dtype, row, transport)):
            for kind, r in per_kind.items():
                where = f"rank {rank} of {4 if pool is gloo4 else 2}, {kind} ({case})"
                assert r["path"] == case, f"{where}: took {r['path']}"
                assert r["outside_untouched"], f"{where}: something outside the pieces was written"
                assert r["inputs_untouched"] and r["returns_empty"], where
                assert r["size"] == (2 if pool is gloo2 else (2 if kind in ("dp", "pp") else 4)), where
                assert len(r["mismatches"]) == IN_FLIGHT, where
                for s, mismatch in enumerate(r["mismatches"]):  # row j: group member j's input
                    assert mismatch is None, f"{where}: gather {s}: {mismatch}"
