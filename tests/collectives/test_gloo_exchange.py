"""gloo's reduce-scatter and all-gather by direct exchange (collectives/backends/gloo_exchange.py).

Layer-sized messages take the exchange; these tests make them big enough to run through several
receive chunks with a remainder, on groups listed in and out of rank order and on mesh axes, with
several exchanges in flight at once, and check every result exactly (the summed values are small
dyadic rationals, exact in any order down to bfloat16), the inputs left alone unless donated, and
a peer that never arrives ending in a timeout that names the collective.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.collectives import RankFailed
from shardwise.collectives.backends import gloo_exchange
from shardwise.collectives.backends.base import Group
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.collectives.mesh import Mesh

pytestmark = pytest.mark.gloo

# Per member: 2.3 chunks of float32 (three chunks, the last one short; the group's thread streams
# them, through chunks made small here to keep the test quick), or a row whose receives fit the two
# receive buffers of the default chunk (the caller posts it whole).
SMALL_CHUNK = gloo_exchange.MIN_EXCHANGE_BYTES
ROW = (SMALL_CHUNK // 4) * 23 // 10 + 7
SMALL_ROW = gloo_exchange.MIN_EXCHANGE_BYTES // 4 * 2 + 3
CASES = {"streamed": (ROW, SMALL_CHUNK), "posted": (SMALL_ROW, gloo_exchange.CHUNK_BYTES)}
IN_FLIGHT = 3


def _summed(n: int, dtype: torch.dtype, seed: int, row: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(-63, 64, (n, row), generator=gen) / 8).to(dtype) for _ in range(n)]


def _moved(n: int, dtype: torch.dtype, seed: int, row: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(row // 2, 2, generator=gen, dtype=torch.float64).to(dtype) for _ in range(n)]


def _group(kind: str) -> Group:
    backend = current_backend()
    if kind in ("dp", "pp"):
        return Mesh(dp=2, pp=2).group(kind)
    if kind == "reversed":
        return Group(kind, tuple(reversed(range(backend.world_size))))
    return Group(kind, tuple(range(backend.world_size)))


def _exchange_all(kinds: list[str], dtype: torch.dtype, row: int, chunk_bytes: int) -> dict[str, Any]:
    """Per group kind: IN_FLIGHT reduce-scatters (donated and not) and all-gathers issued before
    any is waited, waited in reverse order."""
    default, gloo_exchange.CHUNK_BYTES = gloo_exchange.CHUNK_BYTES, chunk_bytes
    try:
        return _exchange_each(kinds, dtype, row)
    finally:
        gloo_exchange.CHUNK_BYTES = default


def _exchange_each(kinds: list[str], dtype: torch.dtype, row: int) -> dict[str, Any]:
    backend = current_backend()
    out: dict[str, Any] = {}
    for kind in kinds:
        group = _group(kind)
        i = group.index(backend.rank)
        sums = [_summed(group.size, dtype, seed, row)[i] for seed in range(IN_FLIGHT)]
        moves = [_moved(group.size, dtype, 100 + seed, row)[i] for seed in range(IN_FLIGHT)]
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
            "exchanged": tuple(sorted(group.ranks)) in backend._exchange_groups,
        }
    return out


def _check(results: list[dict[str, Any]], dtype: torch.dtype, row: int) -> None:
    for rank, per_kind in enumerate(results):
        for kind, r in per_kind.items():
            assert r["exchanged"], f"rank {rank} {kind}: the collectives did not take the exchange"
            assert r["untouched"], f"rank {rank} {kind}: a collective wrote into an input it was not given"
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
    row, chunk = CASES[case]
    _check(gloo2.run(_exchange_all, ["world", "reversed"], dtype, row, chunk), dtype, row)


@pytest.mark.parametrize("case", list(CASES))
def test_exchanges_world_4_and_mesh_axes(gloo4: Any, case: str) -> None:
    row, chunk = CASES[case]
    _check(gloo4.run(_exchange_all, ["world", "reversed", "dp", "pp"], torch.float32, row, chunk), torch.float32, row)


def test_small_or_odd_messages_keep_gloos_own_collectives() -> None:
    group = Group("dp", (0, 1))
    assert gloo_exchange.exchanges(torch.empty(2, gloo_exchange.MIN_EXCHANGE_BYTES // 4), group)
    assert not gloo_exchange.exchanges(torch.empty(2, gloo_exchange.MIN_EXCHANGE_BYTES // 8), group)
    assert not gloo_exchange.exchanges(torch.empty(2, 1 << 20, dtype=torch.float8_e4m3fn), group)
    assert not gloo_exchange.exchanges(torch.empty(1, 1 << 20), Group("dp", (0,)))


# -- a peer that never arrives -------------------------------------------------------------
TIMEOUT = 1.5


@pytest.fixture(scope="module")
def short_pool() -> Iterator[ProcessPool]:
    with ProcessPool(2, timeout=TIMEOUT) as pool:
        yield pool


def _rank() -> int:
    return current_backend().rank


def _rank_1_skips_a_reduce_scatter() -> int:
    mesh = sw.Mesh(dp=2)
    x = torch.ones(2, gloo_exchange.CHUNK_BYTES // 2 + 1)  # streamed by the group's thread
    sw.collectives.psum_scatter(x, "dp", mesh=mesh)  # both meet once (the exchange group is made)
    if mesh.rank != 1:
        sw.collectives.psum_scatter(x, "dp", mesh=mesh)
    return mesh.rank


def test_a_peer_that_skips_an_exchange_ends_in_a_timeout_naming_it(short_pool: ProcessPool) -> None:
    short_pool.run(_rank)  # start the ranks first: only the faulty run is timed
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        short_pool.run(_rank_1_skips_a_reduce_scatter)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert info.value.rank == 0, message
    assert "psum_scatter on axis 'dp'" in message and "timed out" in message, message
    assert elapsed < TIMEOUT + 8.0, elapsed
