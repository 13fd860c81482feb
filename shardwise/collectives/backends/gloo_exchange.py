"""gloo's reduce-scatter and all-gather as direct exchanges between the members of a group.

gloo has no reduce-scatter of its own worth calling (torch's on gloo took 1.45x an all-reduce of
the same buffer), so shardwise ran one as an all-reduce, a ring of 2(n-1) steps that moves twice a
reduce-scatter's bytes. A direct exchange moves what a reduce-scatter must and no more: member i
sends row j of its input to member j and adds the rows it receives into its own. Measured on
this project's 2-core machine (issue 27's notes): a donated reduce-scatter with some compute
between issue and wait took 0.73-0.92x the all-reduce's time at world 2 and 0.58-0.92x at world 4
(1-16 MiB, load 5); torch's own point to point, quiet, 0.3-0.6x an all-reduce at worlds 2 and 8.
The all-gather by exchange receives the parts straight into the result (gloo's own receives into
a buffer of its own, a whole unit, and copies from it), at about gloo's speed.

A reduce-scatter whose receives fit ``_RECEIVE_DEPTH x CHUNK_BYTES`` is posted whole by the caller
and its rows are added at the wait. A bigger one adds what it receives into its own row of the
input (the caller's, donated, or a copy of it) chunk by chunk through two receive buffers of
``CHUNK_BYTES``, on a daemon thread per member set that posts and waits these exchanges in issue
order (the chunks' receives must be posted as earlier ones are consumed, which nobody else would
do while the caller computes). Either way it holds at most two chunks beyond its input, as gloo's
ring did. The all-gather is posted whole at issue by the caller and waited by it.

When every member of a set runs on one host, its exchanges go through shared memory instead of
these messages (``shared_memory_exchange.py``, chosen when the set's process group is made).

Each member set gets a process group of its own for these messages, so they never meet the
user's point-to-point tags nor the set's other collectives. gloo matches the messages between two
ranks on one tag in posting order, and every member issues the same exchanges in the same order
(the program is SPMD) and takes the same path for each (the sizes agree): the thread's
reduce-scatters, the caller's reduce-scatters and the all-gathers each post on a tag of their
own, so each tag's posting order is its issue order.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from .base import Group, Work
from .exchange_thread import ErrorFor, Job, JobThread
from .shared_memory_exchange import SharedMemoryExchange, in_use
from .switch import Switch

# A reduce-scatter's two receive buffers are this big at most: what it holds of its own.
CHUNK_BYTES = 1 << 20
_RECEIVE_DEPTH = 2
# Below this many bytes per member gloo's own collectives are kept (one call, one message per peer
# either way); the exchanges are for the gradients and parameters of whole layers.
MIN_EXCHANGE_BYTES = 1 << 16
# The dtypes gloo's own collectives sum and move; others keep gloo's path (and its refusal).
EXCHANGE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                             torch.int32, torch.int64})
_REDUCE_SCATTER_TAG = 1
_ALL_GATHER_TAG = 2
_DIRECT_REDUCE_SCATTER_TAG = 3

_EXCHANGES = Switch()  # off within gloos_own_collectives()


def exchanges(x: torch.Tensor, group: Group, *, one_member: bool = False) -> bool:
    """Whether a collective of ``x`` over ``group`` runs as an exchange (else as gloo's own);
    ``one_member``: ``x`` is one member's part of it (an all-gather's input), not the whole."""
    return exchanges_of(x.numel() * x.element_size() * (group.size if one_member else 1), x.dtype, group)


def exchanges_of(nbytes: int, dtype: torch.dtype, group: Group) -> bool:
    """Whether a collective of ``nbytes`` in all of ``dtype`` over ``group`` runs as an exchange."""
    return _EXCHANGES.on and sized_for_exchange(nbytes, dtype, group.size)


def sized_for_exchange(nbytes: int, dtype: torch.dtype, members: int) -> bool:
    """Whether a collective of ``nbytes`` of ``dtype`` over ``members`` ranks is one the exchanges
    take (the Plan asks before any tensor exists)."""
    return members > 1 and dtype in EXCHANGE_DTYPES and nbytes // members >= MIN_EXCHANGE_BYTES


@contextlib.contextmanager
def gloos_own_collectives() -> Iterator[None]:
    """Within: gloo's own collectives (the reduce-scatter as an all-reduce), for measuring the
    exchanges against them in one run (``benchmarks/shard_params.py``'s ``*_ring`` variants).
    Every member must be within it for the same collectives."""
    with _EXCHANGES.off():
        yield


class ExchangeGroup:
    """One member set's exchanges: its own process group, and the thread that runs its big reduce-scatters."""

    def __init__(self, pg: Any, members: tuple[int, ...], rank: int, timeout: float, error_for: ErrorFor) -> None:
        # Weak, as the backend's other groups: torch's registry owns the process group (one kept
        # alive past destroy_process_group() makes gloo abort at interpreter exit now and then).
        self._pg_ref = weakref.ref(pg)
        self._members = members
        self._rank = rank
        self._timeout = timeout
        self._error_for = error_for
        self._jobs = JobThread(f"shardwise-exchange-{'-'.join(map(str, members))}-rank-{rank}", self._reduce_job,
                               timeout, error_for)
        # On one host: the same exchanges through shared memory (shared_memory_exchange.py).
        self.shared: SharedMemoryExchange | None = None

    @property
    def alive(self) -> bool:
        """False once torch destroyed the process group (a new one is made for the members)."""
        return self._pg_ref() is not None

    def _pg(self) -> Any:
        pg = self._pg_ref()
        if pg is None:
            raise RuntimeError("the process group of the exchange was destroyed (destroy_process_group())")
        return pg

    # -- reduce-scatter: rows of a donated buffer, reduced on the group's thread --------------
    def reduce_scatter(self, rows: torch.Tensor, group: Group, op_name: str, shape: torch.Size) -> Work:
        """Reduce ``rows`` (shape (n, m), in the group's order, this call's own: a big one is
        reduced in place) and return this member's row of the sum as ``shape``, in a tensor of its
        own (so the buffer is released at the wait)."""
        if in_use(self.shared):
            assert self.shared is not None
            return self.shared.reduce_scatter(rows, group, op_name, shape)
        if (group.size - 1) * rows.shape[1] * rows.element_size() <= _RECEIVE_DEPTH * CHUNK_BYTES:
            return self._reduce_scatter_direct(rows, group, op_name, shape)
        return self._jobs.submit(Job("reduce_scatter", op_name, group, None, rows, shape))

    def _reduce_job(self, job: Job) -> None:
        assert job.rows is not None
        job.result = self._reduce(job.rows, job.group).view(job.shape)

    def _reduce(self, rows: torch.Tensor, group: Group) -> torch.Tensor:
        ranks, n, i, pg = group.ranks, group.size, group.index(self._rank), self._pg()
        own = rows[i]
        step = max(1, CHUNK_BYTES // rows.element_size())
        spans = [(start, min(start + step, rows.shape[1])) for start in range(0, rows.shape[1], step)]
        deadline = time.monotonic() + self._timeout
        # Round k: send to member i+k, receive from member i-k (every member sends one row and
        # receives one per round). Sends are posted at once: gloo holds each until its receiver
        # posts the matching receive.
        sends = [
            dist.isend(rows[(i + k) % n, a:b], ranks[(i + k) % n], group=pg, tag=_REDUCE_SCATTER_TAG)
            for k in range(1, n) for a, b in spans
        ]
        incoming = [(ranks[(i - k) % n], a, b) for k in range(1, n) for a, b in spans]
        buffers = [torch.empty(min(step, rows.shape[1]), dtype=rows.dtype) for _ in range(_RECEIVE_DEPTH)]
        posted: deque[tuple[Any, torch.Tensor, int, int]] = deque()

        def post(s: int) -> None:
            src, a, b = incoming[s]
            buf = buffers[s % _RECEIVE_DEPTH][: b - a]
            posted.append((dist.irecv(buf, src, group=pg, tag=_REDUCE_SCATTER_TAG), buf, a, b))

        for s in range(min(_RECEIVE_DEPTH, len(incoming))):
            post(s)
        for s in range(len(incoming)):
            work, buf, a, b = posted.popleft()
            _wait(work, deadline)
            own[a:b] += buf
            if s + _RECEIVE_DEPTH < len(incoming):
                post(s + _RECEIVE_DEPTH)
        for work in sends:
            _wait(work, deadline)
        # Copied at the end, not summed into a tensor of its own from the start: the copy is held
        # only from here, not through the whole exchange (which the caller's compute overlaps).
        return own.clone()

    def _reduce_scatter_direct(self, rows: torch.Tensor, group: Group, op_name: str, shape: torch.Size) -> Work:
        """A reduce-scatter whose receives fit the receive buffers' bytes: posted whole by the
        caller (no hand-off to the thread, which costs a wake-up per message on busy cores), its
        rows added at the wait."""
        ranks, n, i, pg = group.ranks, group.size, group.index(self._rank), self._pg()
        tag = _DIRECT_REDUCE_SCATTER_TAG
        received = torch.empty(n - 1, rows.shape[1], dtype=rows.dtype)
        sends = [dist.isend(rows[(i + k) % n], ranks[(i + k) % n], group=pg, tag=tag) for k in range(1, n)]
        recvs = [dist.irecv(received[k - 1], ranks[(i - k) % n], group=pg, tag=tag) for k in range(1, n)]

        def finish() -> torch.Tensor:
            # Summed into a tensor of its own (the additions and their order are the in-place
            # sum's): no copy of the row is left to make for the caller to hold without the buffer.
            total = rows[i] + received[0]
            for k in range(1, n - 1):
                total += received[k]
            return total.view(shape)

        return _PostedWork(recvs + sends, finish, self._timeout, lambda exc: self._error_for(op_name, group, exc))

    # -- all-gather: posted by the caller, received into the result ---------------------------
    def all_gather(self, x: torch.Tensor, group: Group) -> tuple[list[Any], torch.Tensor]:
        """Post the all-gather of ``x`` (flat, contiguous); returns gloo's works and the result
        buffer (shape (n, numel), in the group's order), complete once every work is waited."""
        ranks, n, i, pg = group.ranks, group.size, group.index(self._rank), self._pg()
        out = torch.empty(n, x.numel(), dtype=x.dtype, device=x.device)
        out[i].copy_(x)
        mine = out[i]  # what travels: ours, so the caller's x may change at once
        works = [dist.isend(mine, ranks[(i + k) % n], group=pg, tag=_ALL_GATHER_TAG)
                 for k in range(1, n)]
        works += [dist.irecv(out[(i - k) % n], ranks[(i - k) % n], group=pg, tag=_ALL_GATHER_TAG)
                  for k in range(1, n)]
        return works, out


class _PostedWork(Work):
    """Messages the caller posted: waited (within the timeout) in order, then ``finish`` once."""

    def __init__(self, works: list[Any], finish: Callable[[], torch.Tensor], timeout: float,
                 error: Callable[[BaseException], CollectiveError]) -> None:
        self._works: list[Any] | None = works
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._timeout, self._error = timeout, error
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            assert self._works is not None and self._finish is not None
            deadline = time.monotonic() + self._timeout
            try:
                for work in self._works:
                    _wait(work, deadline)
            except Exception as exc:
                raise self._error(exc) from exc
            self._result = self._finish()
            self._works = self._finish = None  # the buffers are released with them
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None


def _wait(work: Any, deadline: float) -> None:
    remaining = max(deadline - time.monotonic(), 0.001)
    if work.wait(timeout=datetime.timedelta(seconds=remaining)) is False:
        raise TimeoutError(f"a message of the exchange was not delivered within {remaining:g} s")
