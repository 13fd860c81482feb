"""The communication ledger: every collective a rank runs, and the bytes it sends.

>>> import torch
>>> from shardwise.collectives import Mesh, comm_ledger, launch, psum
>>> def main():
...     return psum(torch.ones(8), "dp", mesh=Mesh(dp=4))
>>> with comm_ledger() as ledger:
...     _ = launch(main, 4)
>>> ledger.sent_bytes(op="psum")   # 4 ranks x 2 * 32 B * 3/4
192

The active ledgers live in a context variable. The threads launcher runs every
rank in a copy of the caller's context, so a ledger opened around ``launch``
records all ranks; under processes each rank opens its own. Ledgers nest: a
record goes to every open ledger, so an outer one can span a run and an inner
one a single step. Appends are thread-safe.

Each :class:`CommRecord` holds what the calling rank passed in (``nbytes``: the
logical bytes of its input tensor) and ``sent_bytes``: the exact number of bytes
this rank sends under the standard algorithm for the op. With ``B`` the input
bytes, ``n`` the group size, ``i`` the rank's index in its group:

* psum / pmean (ring all-reduce): split the flat input into ``n`` chunks as
  evenly as possible (like ``torch.tensor_split``: the first ``numel % n`` chunks
  get one element more). The reduce-scatter phase sends every chunk except
  chunk ``(i+1) % n``; the all-gather phase every chunk except ``(i+2) % n``.
  That is exactly ``2 B (n-1) / n`` when ``n`` divides the element count.
* all_gather (ring): ``(n-1) B``.
* psum_scatter (ring reduce-scatter): ``B (n-1) / n`` (the input divides by n).
* all_to_all (pairwise): ``B (n-1) / n``: every chunk but the one it keeps.
* broadcast (pipelined chain root, root+1, ... mod n): every rank except the
  last in the chain, ``(root-1) % n``, sends ``B``.
* ppermute: ``B`` if the rank is a source whose destination is another rank,
  else 0.
* send (point to point): ``B``, the bytes of the tensor sent; 0 when the rank
  sends to itself.
* recv (point to point): 0 sent; ``nbytes``, ``shape`` and ``dtype`` are those
  of the tensor received, and the record is made when the receive's ``wait()``
  completes (a receive never waited on is not recorded).
* A group of one sends nothing.

``phase`` is "backward" for collectives issued by an autograd backward (the
transposes of the forward collectives), "forward" otherwise. A backward
collective goes to the ledgers open when backward runs; on a thread that sees
none (autograd runs CUDA backward on its own device threads, which do not see
the caller's context variables) it goes to those open when its forward ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

_RING_ALL_REDUCE = ("psum", "pmean")
_OPS = (*_RING_ALL_REDUCE, "all_gather", "psum_scatter", "all_to_all", "broadcast", "ppermute")


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by one rank."""

    op: str
    axis: str
    rank: int
    group_size: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sent_bytes: int
    phase: str = "forward"


@dataclass(frozen=True)
class OpSummary:
    """Totals of one (axis, op) over every recorded rank."""

    count: int
    nbytes: int
    sent_bytes: int
    sent_bytes_per_rank: dict[int, int]


class Ledger:
    """The records of one ``comm_ledger()`` block, in the order ranks issued them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[CommRecord] = []

    def add(self, record: CommRecord) -> None:
        with self._lock:
            self._records.append(record)

    @property
    def records(self) -> tuple[CommRecord, ...]:
        with self._lock:
            return tuple(self._records)

    def __len__(self) -> int:
        return len(self.records)

    def sent_bytes(self, rank: int | None = None, axis: str | None = None, op: str | None = None) -> int:
        """Bytes sent by the matching records (None matches everything)."""
        return sum(
            r.sent_bytes
            for r in self.records
            if (rank is None or r.rank == rank)
            and (axis is None or r.axis == axis)
            and (op is None or r.op == op)
        )

    def summary(self) -> dict[tuple[str, str], OpSummary]:
        """Per (axis, op): count, total input bytes, total sent bytes, sent bytes per rank."""
        grouped: dict[tuple[str, str], list[CommRecord]] = {}
        for r in self.records:
            grouped.setdefault((r.axis, r.op), []).append(r)
        result = {}
        for key in sorted(grouped):
            records = grouped[key]
            per_rank: dict[int, int] = {}
            for r in records:
                per_rank[r.rank] = per_rank.get(r.rank, 0) + r.sent_bytes
            result[key] = OpSummary(
                count=len(records),
                nbytes=sum(r.nbytes for r in records),
                sent_bytes=sum(r.sent_bytes for r in records),
                sent_bytes_per_rank=dict(sorted(per_rank.items())),
            )
        return result

    def to_jsonl(self) -> str:
        """One JSON object per record, one per line."""
        return "".join(json.dumps({**asdict(r), "shape": list(r.shape)}) + "\n" for r in self.records)

    def __str__(self) -> str:
        header = ("axis", "op", "count", "bytes in", "bytes sent", "sent per rank")
        rows = [
            (
                axis,
                op,
                str(s.count),
                str(s.nbytes),
                str(s.sent_bytes),
                " ".join(f"{rank}:{b}" for rank, b in s.sent_bytes_per_rank.items()),
            )
            for (axis, op), s in self.summary().items()
        ]
        if not rows:
            return "Ledger: no collectives recorded"
        widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                 for row in (header, *rows)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Ledger with {len(self)} records>"


_active: contextvars.ContextVar[tuple[Ledger, ...]] = contextvars.ContextVar(
    "shardwise_comm_ledgers", default=()
)


@contextlib.contextmanager
def comm_ledger() -> Iterator[Ledger]:
    """Record every collective run inside the block (on this rank, or on every rank of a threads launch)."""
    ledger = Ledger()
    token = _active.set((*_active.get(), ledger))
    try:
        yield ledger
    finally:
        _active.reset(token)


def active_ledgers() -> tuple[Ledger, ...]:
    """The open ledgers of the calling context, outermost first."""
    return _active.get()


def ring_chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of the ``n`` ring chunks of a flat tensor, as ``torch.tensor_split`` cuts it."""
    q, r = divmod(numel, n)
    return [q + 1 if k < r else q for k in range(n)]


def algorithm_sent_bytes(
    op: str,
    *,
    numel: int,
    itemsize: int,
    group_size: int,
    index: int,
    root: int | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Bytes the rank at ``index`` of its group sends for ``op`` (formulas in the module docstring)."""
    if op not in _OPS:
        raise ValueError(f"no send-volume formula for op {op!r}; known ops: {_OPS}")
    n, total = group_size, numel * itemsize
    if n == 1:
        return 0
    if op in _RING_ALL_REDUCE:
        chunks = ring_chunk_sizes(numel, n)
        return (2 * numel - chunks[(index + 1) % n] - chunks[(index + 2) % n]) * itemsize
    if op == "all_gather":
        return (n - 1) * total
    if op in ("psum_scatter", "all_to_all"):
        return total * (n - 1) // n
    if op == "broadcast":
        if root is None:
            raise ValueError("broadcast needs its root to count bytes sent")
        return 0 if index == (root - 1) % n else total
    # ppermute
    dst = dict(pairs or ()).get(index)
    return total if dst is not None and dst != index else 0


def record(
    op: str,
    *,
    axis: str,
    rank: int,
    index: int,
    group_size: int,
    tensor: torch.Tensor,
    phase: str,
    root: int | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
    ledgers: tuple[Ledger, ...] | None = None,
) -> None:
    """Append one record to ``ledgers`` (default: the open ones); free when no ledger is open."""
    targets = active_ledgers() if ledgers is None else ledgers
    if not targets:
        return
    numel, itemsize = tensor.numel(), tensor.element_size()
    entry = CommRecord(
        op=op,
        axis=axis,
        rank=rank,
        group_size=group_size,
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(tensor.shape),
        nbytes=numel * itemsize,
        sent_bytes=algorithm_sent_bytes(
            op, numel=numel, itemsize=itemsize, group_size=group_size, index=index, root=root, pairs=pairs
        ),
        phase=phase,
    )
    for ledger in targets:
        ledger.add(entry)
