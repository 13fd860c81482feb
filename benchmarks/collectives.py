"""Throughput of shardwise's collectives, on threads and on gloo processes, against raw torch.distributed.

Run it from the repository root:

    python benchmarks/collectives.py                                  # defaults: ~2-3 minutes on 2 cores
    python benchmarks/collectives.py --backends gloo --worlds 4 --ops psum --sizes 1M,64M --reps 10
    python benchmarks/collectives.py --out collectives.jsonl

What is measured
----------------
For every (backend, world, op, size) one point: ``bytes`` is the logical input
of ONE rank (a flat float32 tensor of ``bytes / 4`` elements), and each op is
called the way a user calls it, on a 1-axis ``Mesh(x=world)``:

==============  ==============================================  =============================================
op              shardwise call                                   torch.distributed call (gloo only)
==============  ==============================================  =============================================
psum            ``psum(x, "x")``                                 ``all_reduce(x)`` (in place)
all_gather      ``all_gather(x, "x", tiled=True)``               ``all_gather_single(out, x)`` [#]_
psum_scatter    ``psum_scatter(x, "x", tiled=True)``             ``reduce_scatter_single(out, x)`` [#]_
all_to_all      ``all_to_all(x, "x", 0, 0, tiled=True)``         ``all_to_all_single(out, x)``
broadcast       ``broadcast(x, "x", root=0)``                    ``broadcast(x, src=0)`` (in place)
ppermute        ``ppermute(x, "x", [(i, i+1 mod n)])``, a ring   ``batch_isend_irecv([isend(x, next), irecv(out, prev)])``
send_recv       a round trip between ranks 2k and 2k+1 [#]_      the same with ``irecv`` / ``isend``
==============  ==============================================  =============================================

.. [#] ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on torch older than 2.13.
.. [#] How a pipeline passes activations and gradients: each rank first posts
   ``recv(x, partner, like=(shape, dtype))``; the even rank then sends ``x``
   (``send(..., announce=False, snapshot=False)``) and waits for the reply, the
   odd rank waits for ``x`` and sends it back. One call is one round trip, so
   small sizes measure the latency a message adds to a pipeline's critical path
   (twice: there and back). Needs an even world.

Torch's calls get preallocated outputs (their fastest use); ours allocate their
results, as the functional API must. Backends:

* ``threads``: :func:`shardwise.launch` ranks as threads of this process (the
  verification backend: the last rank to arrive computes every rank's result).
* ``gloo``: ranks as processes of one :class:`ProcessPool` per world (gloo over
  loopback TCP, ``torch.set_num_threads(cores // world)`` per rank). Inside a
  rank, each repetition times our call and then torch's, so both see the same
  machine conditions.

Each point: one untimed warm-up call (also the one a ``comm_ledger()`` is
opened around), then ``reps`` timed calls. Before every timed call the ranks
meet at a barrier; a rank's time runs from leaving the barrier to holding the
result. Per repetition the slowest rank's time counts; ``median_s`` is the
median of those over the repetitions. Large messages get fewer repetitions:
``reps = min(--reps, max(3, --rep-budget / bytes))``.

How to read the output
----------------------
One JSON object per (backend, world, op, size) on stdout (and in ``--out``):

* ``median_s``: as above.  ``algbw_GBps`` = ``bytes / median_s`` (1 GB = 1e9 B).
* ``busbw_GBps``: ``algbw`` times the op's bus factor, chosen so that it equals
  nccl-tests' busbw (the per-rank link traffic a perfect ring would need per
  second): psum 2(n-1)/n; all_gather n-1 (nccl-tests sizes all-gather by its
  output, n x ours); psum_scatter and all_to_all (n-1)/n; broadcast and
  ppermute 1. ``busbw x median_s`` is therefore the bytes one rank sends, and
  equals ``ledger_sent_bytes`` for every op here. Compare busbw across ops and
  worlds; compare it with your memory bandwidth (threads) or loopback TCP
  throughput (gloo).
* ``ledger_sent_bytes``: what ``shardwise.collectives.comm_ledger()`` recorded as sent for
  ONE call, largest over ranks (the broadcast chain's last rank sends nothing).
* ``torch_median_s`` / ``ratio_to_torch`` (gloo only, ``null`` on threads): the
  same statistic for torch's own call, and ours divided by it (> 1: we are
  slower). Ratios near 1 mean our overhead (validation, one input copy,
  allocating the result, the ledger hook) is small against the transfer.
* ``reps``, ``cores`` (``os.cpu_count()``), ``torch`` (version). With
  ``world > cores`` the ranks oversubscribe the CPU, and times measure
  contention as much as the collective; the threads backend additionally runs
  under one GIL and computes every rank's result on one thread.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    add_out_flag,
    add_worlds_flag,
    environment,
    json_lines,
    median_of_max,
    note,
    timed,
)

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.processes import ProcessPool

OPS = ("psum", "all_gather", "psum_scatter", "all_to_all", "broadcast", "ppermute", "send_recv")
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
AXIS = "x"
TIMEOUT_S = 300.0

# torch 2.13 renamed the flat collectives (the old names warn); older torch has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks, with algbw = input bytes per rank / time."""
    return {
        "psum": 2 * (n - 1) / n,
        "all_gather": n - 1,
        "psum_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
        "ppermute": 1.0,
        "send_recv": 1.0,
    }[op]


# -- inside a rank (module level: gloo ranks import this module) -----------------------
def _round_trip(mesh: sw.Mesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """``send_recv``: the pipeline's message pattern there and back (see the module docstring)."""
    me = mesh.axis_index(AXIS)
    partner = me ^ 1

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        back = sw.collectives.recv(AXIS, partner, like=(x.shape, x.dtype), mesh=mesh)
        if me % 2 == 0:
            sent = sw.collectives.send(x, AXIS, partner, announce=False, snapshot=False, mesh=mesh)
            out = back.wait()
            sent.wait()
            return out
        out = back.wait()
        sw.collectives.send(out, AXIS, partner, announce=False, snapshot=False, mesh=mesh).wait()
        return out

    return round_trip


def _ours(op: str, mesh: sw.Mesh) -> Callable[[torch.Tensor], torch.Tensor]:
    if op == "send_recv":
        return _round_trip(mesh)
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "psum": lambda x: sw.collectives.psum(x, AXIS, mesh=mesh),
        "all_gather": lambda x: sw.collectives.all_gather(x, AXIS, 0, tiled=True, mesh=mesh),
        "psum_scatter": lambda x: sw.collectives.psum_scatter(x, AXIS, 0, tiled=True, mesh=mesh),
        "all_to_all": lambda x: sw.collectives.all_to_all(x, AXIS, 0, 0, tiled=True, mesh=mesh),
        "broadcast": lambda x: sw.collectives.broadcast(x, AXIS, 0, mesh=mesh),
        "ppermute": lambda x: sw.collectives.ppermute(x, AXIS, ring, mesh=mesh),
    }[op]


def _torch_call(op: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """torch.distributed's own call for ``op`` on ``x``, outputs allocated once, up front."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if op == "psum":
        return lambda: (dist.all_reduce(x), x)[1]
    if op == "broadcast":
        return lambda: (dist.broadcast(x, src=0), x)[1]
    if op == "all_gather":
        out = torch.empty(n * x.numel(), dtype=x.dtype)
        return lambda: (_all_gather_flat(out, x), out)[1]
    if op == "psum_scatter":
        out = torch.empty(x.numel() // n, dtype=x.dtype)
        return lambda: (_reduce_scatter_flat(out, x), out)[1]
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: (dist.all_to_all_single(out, x), out)[1]
    if op == "ppermute":
        out = torch.empty_like(x)

        def ring_shift() -> torch.Tensor:
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return out

        return ring_shift
    if op == "send_recv":
        out = torch.empty_like(x)
        partner = rank ^ 1

        def round_trip() -> torch.Tensor:
            back = dist.irecv(out, partner)
            if rank % 2 == 0:
                sent = dist.isend(x, partner)
                back.wait()
                sent.wait()
            else:
                back.wait()
                dist.isend(out, partner).wait()
            return out

        return round_trip
    raise ValueError(f"unknown op {op!r}")


def rank_main(op: str, sizes: list[int], reps: list[int], with_torch: bool) -> list[dict[str, Any]]:
    """Measure ``op`` at every size on the calling rank; return its per-rep times per size."""
    mesh = sw.Mesh({AXIS: current_backend().world_size})
    backend, group = mesh.backend, mesh.group(AXIS)
    barrier = lambda: backend.barrier(group)  # noqa: E731
    ours = _ours(op, mesh)
    points = []
    for nbytes, n_reps in zip(sizes, reps, strict=True):
        x = torch.full((nbytes // 4,), mesh.rank + 1.0)  # the values do not matter, only the bytes
        # Torch's in-place calls (all_reduce, broadcast) overwrite their input: give them their own.
        raw = _torch_call(op, x.clone()) if with_torch else None
        barrier()
        with sw.collectives.comm_ledger() as ledger:  # the warm-up call
            result = ours(x)
        if raw is not None and (theirs := raw()).shape != result.shape:  # also torch's warm-up
            raise AssertionError(f"{op}: ours returned {tuple(result.shape)}, torch {tuple(theirs.shape)}")
        if op == "send_recv" and not bool((result == mesh.rank - mesh.rank % 2 + 1.0).all()):
            raise AssertionError("send_recv: a pair's round trip must leave the even rank's values on both")
        del result
        ours_s, torch_s = [], []
        for _ in range(n_reps):
            ours_s.append(timed(ours, x, barrier=barrier)[1])
            if raw is not None:
                torch_s.append(timed(raw, barrier=barrier)[1])
        points.append({"sent": ledger.sent_bytes(rank=mesh.rank), "ours": ours_s, "torch": torch_s})
    return points


# -- the parent ----------------------------------------------------------------------
def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    value = int(text[:-1] if scale > 1 else text) * scale
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return value


def reps_for(nbytes: int, max_reps: int, budget: int) -> int:
    return min(max_reps, max(3, budget // nbytes))


def summarise(
    backend: str, world: int, op: str, sizes: list[int], reps: list[int], per_rank: list[list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Combine every rank's times into one JSON line per size."""
    lines = []
    for k, nbytes in enumerate(sizes):
        ranks = [points[k] for points in per_rank]

        ours_s = median_of_max(r["ours"] for r in ranks)
        torch_s = median_of_max(r["torch"] for r in ranks) if ranks[0]["torch"] else None  # gloo only
        algbw = nbytes / ours_s / 1e9
        lines.append({
            "bench": "collectives",
            "backend": backend,
            "world": world,
            "op": op,
            "bytes": nbytes,
            "median_s": ours_s,
            "algbw_GBps": round(algbw, 4),
            "busbw_GBps": round(algbw * bus_factor(op, world), 4),
            "ledger_sent_bytes": max(r["sent"] for r in ranks),
            "torch_median_s": torch_s,
            "ratio_to_torch": None if torch_s is None else round(ours_s / torch_s, 3),
            "reps": reps[k],
            **environment(keys=("cores", "torch")),
        })
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per rank, K/M/G suffixes (default {DEFAULT_SIZES})")
    add_worlds_flag(parser)
    parser.add_argument("--backends", default="threads,gloo", help="threads and/or gloo (default both)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions at small sizes (default 20)")
    parser.add_argument(
        "--rep-budget", type=parse_size, default=parse_size("64M"),
        help="fewer reps for large sizes: at most this many input bytes per point, min 3 reps (default 64M)",
    )
    add_out_flag(parser)
    args = parser.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    ops = [o.strip() for o in args.ops.split(",")]
    backends = [b.strip() for b in args.backends.split(",")]
    if unknown := sorted(set(ops) - set(OPS)):
        parser.error(f"unknown ops {unknown}; choose from {OPS}")
    if unknown := sorted(set(backends) - {"threads", "gloo"}):
        parser.error(f"unknown backends {unknown}; choose threads and/or gloo")
    if "send_recv" in ops and (odd := [w for w in worlds if w % 2]):
        parser.error(f"send_recv pairs ranks 2k and 2k+1: worlds {odd} are odd")
    for world in worlds:
        if bad := [s for s in sizes if (s // 4) % world]:
            parser.error(f"sizes {bad} do not split into {world} float32 chunks (psum_scatter, all_to_all)")
    reps = [reps_for(s, args.reps, args.rep_budget) for s in sizes]

    started = time.perf_counter()
    with json_lines(args.out) as emit:
        for backend in backends:
            for world in worlds:
                pool = ProcessPool(world, timeout=TIMEOUT_S) if backend == "gloo" else None
                try:
                    for op in ops:
                        t0 = time.perf_counter()
                        task = (op, sizes, reps, pool is not None)
                        if pool is not None:
                            per_rank = pool.run(rank_main, *task)
                        else:
                            per_rank = sw.launch(rank_main, world, timeout=TIMEOUT_S, args=task)
                        for line in summarise(backend, world, op, sizes, reps, per_rank):
                            emit(line)
                        note(f"# {backend} world={world} {op}: {time.perf_counter() - t0:.1f} s")
                finally:
                    if pool is not None:
                        pool.close()
    note(f"# total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
