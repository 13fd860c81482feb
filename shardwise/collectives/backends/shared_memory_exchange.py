"""The exchanges between ranks of one host through shared memory instead of loopback TCP.

gloo's point to point over loopback TCP costs two kernel copies, a system call and a wake-up per
message, in the caller's thread: an ``isend`` of 0.5 MiB cost its caller about 0.45 ms on this
project's machine (1.1 GB/s). When every member of a set runs on one host, each member here has
``SLOTS`` slots of ``SLOT_BYTES`` in a file of its own in ``/dev/shm``, which it maps and its
peers read; a member writes its part of a message into its next slot and its peers copy (or add)
their part out of it. A two-byte record through a FIFO per member says "slot written" or "slot
read"; a member waits on its FIFO with ``poll`` and a deadline. Measured between two ranks (issue 27's
notes), one exchange round took 0.24-0.46x gloo's time from 64 KiB to 16 MiB.

Messages are cut into chunks of one slot, so what a member set holds is fixed whatever the
message: ``SLOTS x SLOT_BYTES`` of its own (the Plan counts it, ``transport_bytes``); a member
reads its peers' slots with ``pread`` into the result, so their pages are not mapped twice. A
thread per member set runs the set's exchanges in issue order (the program is SPMD: every member
issues the same exchanges in the same order, so chunk ``s`` of every member goes through slot
``s mod SLOTS``); the caller only hands them over, so an issue never blocks on a slot a peer has
not read yet, however many exchanges are in flight. A member writes ahead into every slot its
peers have freed and takes their chunks as they come.

The files are unlinked as soon as every member opened them (``open_same_host``), so nothing is
left in ``/dev/shm`` when a rank dies afterwards. One killed during that setup (two rounds of
``all_gather_object``) leaves its ``shardwise-*`` files, whose names end with its pid: the next
setup on the host removes them once that process is gone (``sweep_stale``). A peer that dies or stops mid-exchange
shows as a wait that passes its deadline (or a FIFO that no one reads: ``BrokenPipeError``): the
exchange and every later one on the set fail with that error, as the TCP exchanges do. Each chunk
carries a header (which exchange, its kind and length, which chunk): members that issued different
collectives fail the exchange with both sides named instead of adding each other's bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import re
import secrets
import select
import socket
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DIFFERENT_COLLECTIVES, CollectiveError
from .base import Group, Rows, Work, copy_pieces, pieces_within
from .exchange_thread import ErrorFor, Job, JobThread
from .switch import Switch

# A slot holds one chunk of a message: SLOTS of them per member, written in turn.
SLOT_BYTES = 1 << 20
SLOTS = 4
_SHM_DIR = "/dev/shm"
# A member's files: shardwise-<the set's token>-<member index>-<creator's pid>[.fifo]
_FILE_NAME = re.compile(r"shardwise-[0-9a-f]+-\d+-(?P<pid>\d+)(?:\.fifo)?")
# A file whose creator died is removed once it is this old: a setup takes milliseconds, and a pid
# that names no process here may be a live one's of another PID namespace sharing /dev/shm.
STALE_SECONDS = 60.0
# A FIFO record is two bytes, what happened and who says it: a member's index fits one byte.
_MAX_MEMBERS = 255
_WRITTEN, _READ = 1, 2
# Each slot starts with a header of what its chunk is (exchange number, kind, dtype, length, chunk
# bytes, chunk number): a member that issued another exchange than its peers fails the exchange,
# not the sums.
_HEADER_BYTES = 64
_KINDS = {"all_gather": 0, "reduce_scatter": 1}
# The most buffers one preadv takes (Linux: 1024; EINVAL beyond).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

# SHARDWISE_SHARED_MEMORY=0: never (every rank must say the same); loopback_exchanges(): not now.
_ALLOWED = os.environ.get("SHARDWISE_SHARED_MEMORY", "1") != "0"
_SHARED_MEMORY = Switch()  # off within loopback_exchanges()


def in_use(exchange: SharedMemoryExchange | None) -> bool:
    """Whether a member set's collectives go through its shared-memory exchange now."""
    return exchange is not None and _SHARED_MEMORY.on


def transport_bytes(members: int) -> int:
    """What one member set's shared-memory exchanges hold on each member: its own slots (a peer's
    are read with ``pread``, not mapped: their pages are counted once, by their writer) and a
    reduce-scatter's buffer for a peer's part of a chunk."""
    return SLOTS * SLOT_BYTES + SLOT_BYTES // members if members > 1 and _ALLOWED else 0


@contextlib.contextmanager
def loopback_exchanges() -> Iterator[None]:
    """Within: the exchanges go over gloo's TCP even on one host, for measuring the two
    transports in one run (``benchmarks/shard_params.py``). Every member must be within it for
    the same collectives."""
    with _SHARED_MEMORY.off():
        yield


def open_same_host(pg: Any, members: tuple[int, ...], index: int, timeout: float,
                   error_for: ErrorFor) -> SharedMemoryExchange | None:
    """The member set's shared-memory exchange when every member is on this host and can map
    the others' slots, else None (every member decides alike, from what all of them said).
    Collective over ``pg``: every member calls it at the same point."""
    n = len(members)
    if n > _MAX_MEMBERS:
        return None
    said: list[Any] = [None] * n
    slot_bytes = SLOT_BYTES  # what this set's slots are, whatever the module says later
    dist.all_gather_object(said, (_ALLOWED and _host_key(), secrets.token_hex(8), slot_bytes, os.getpid()),
                           group=pg)
    if not said[0][0] or any(host != said[0][0] for host, _, _, _ in said):
        return None
    if any(size != slot_bytes for _, _, size, _ in said):  # every member raises alike
        raise ValueError(f"the members {members} of an exchange have slots of different sizes "
                         f"({[size for _, _, size, _ in said]} bytes): set SLOT_BYTES alike on every rank")
    sweep_stale()
    base = os.path.join(_SHM_DIR, f"shardwise-{said[0][1]}")
    paths = [f"{base}-{j}-{pid}" for j, (_, _, _, pid) in enumerate(said)]
    own: list[str] = []
    made: dict[str, Any] = {}
    oks: list[Any] = [None] * n
    try:
        try:
            _create_own(paths[index], own, slot_bytes, made)
            ok = "ok"
        except Exception as exc:  # said to every member, which all go on without shared memory
            ok = f"rank {dist.get_rank()}: {exc}"
        dist.all_gather_object(oks, ok, group=pg)
        if ok == "ok" and all(o == "ok" for o in oks):
            try:
                _open_peers(paths, index, made)
            except Exception as exc:
                ok = f"rank {dist.get_rank()}: {exc}"
        dist.all_gather_object(oks, ok, group=pg)
    except BaseException:
        _close(made)
        raise
    finally:
        for path in own:  # every member opened them (or gave up): the names can go
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if ok != "ok" or any(o != "ok" for o in oks):
        _close(made)
        return None
    return SharedMemoryExchange(members, index, timeout, error_for, slot_bytes=slot_bytes, **made)


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""  # not Linux: no /dev/shm to rely on
    return f"{socket.gethostname()}/{boot}/{os.stat(_SHM_DIR).st_dev}" if os.path.isdir(_SHM_DIR) else ""


def sweep_stale(now: float | None = None) -> list[str]:
    """Remove the ``shardwise-*`` files of members that died during a setup, before their peers had
    opened them (nothing else unlinks them, and ``/dev/shm`` is memory): those whose creator's pid
    names no process here and that are older than :data:`STALE_SECONDS`. Returns what it removed
    (another member sweeping at once, or another user's file, is passed over)."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    now = time.time() if now is None else now
    removed = []
    for name in names:
        match = _FILE_NAME.fullmatch(name)
        if match is None or _alive(int(match.group("pid"))):
            continue
        path = os.path.join(_SHM_DIR, name)
        with contextlib.suppress(OSError):
            if now - os.lstat(path).st_mtime >= STALE_SECONDS:
                os.unlink(path)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` names a process here (one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _create_own(slots_path: str, own: list[str], slot_bytes: int, made: dict[str, Any]) -> None:
    """This member's slots and FIFO, into ``made`` as they are opened (closed by the caller on failure)."""
    fifo_path = f"{slots_path}.fifo"
    fd = os.open(slots_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    own.append(slots_path)
    try:
        # Allocated now, not sparse: a /dev/shm too small fails here (every member then keeps TCP),
        # not as a SIGBUS at the first write into the mapping.
        os.posix_fallocate(fd, 0, SLOTS * slot_bytes)
    finally:
        os.close(fd)
    os.mkfifo(fifo_path, 0o600)
    own.append(fifo_path)
    # Read and write: the open does not wait for a writer, and the FIFO never reads end-of-file.
    made["inbox"] = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK)
    made["slots"] = torch.from_file(slots_path, shared=True, size=SLOTS * slot_bytes, dtype=torch.uint8)


def _open_peers(paths: list[str], index: int, made: dict[str, Any]) -> None:
    made["peer_slots"] = peer_slots = [-1] * len(paths)
    made["outboxes"] = outboxes = [-1] * len(paths)
    for j, path in enumerate(paths):
        if j != index:
            # Read with pread, not mapped: a peer's pages would count again in this member's resident set.
            peer_slots[j] = os.open(path, os.O_RDONLY)
            outboxes[j] = os.open(f"{path}.fifo", os.O_WRONLY | os.O_NONBLOCK)


def _close(made: dict[str, Any]) -> None:
    fds = [made.get("inbox", -1), *made.get("outboxes", []), *made.get("peer_slots", [])]
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Row:
    """One member's row of an exchange as the caller's pieces laid end to end, read by span."""

    def __init__(self, pieces: Sequence[torch.Tensor]) -> None:
        self.pieces = pieces
        self.starts = list(itertools.accumulate((p.numel() for p in pieces), initial=0))

    def within(self, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset from ``lo``, slice) of each piece's part in elements ``[lo, hi)``, in order: found
        by bisection, so a chunk costs the pieces it holds, not the row's."""
        k = bisect.bisect_right(self.starts, lo) - 1
        while k < len(self.pieces) and self.starts[k] < hi:
            start = self.starts[k]
            a, b = max(lo, start), min(hi, self.starts[k + 1])
            if a < b:
                yield a - lo, self.pieces[k][a - start: b - start]
            k += 1

    def copy_into(self, lo: int, hi: int, into: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` into ``into`` (converted to its dtype)."""
        for at, piece in self.within(lo, hi):
            into[at: at + piece.numel()].copy_(piece)

    def add_into(self, lo: int, hi: int, part: torch.Tensor, into: torch.Tensor) -> None:
        """``into`` = elements ``[lo, hi)`` in ``into``'s dtype, plus ``part``: what ``torch.add(row,
        part, out=into)`` gives on the row converted first, bit for bit."""
        for at, piece in self.within(lo, hi):
            end = at + piece.numel()
            if piece.dtype == into.dtype:
                torch.add(piece, part[at:end], out=into[at:end])
            else:  # converted first, then added in into's dtype (not added in the piece's)
                into[at:end].copy_(piece)
                into[at:end] += part[at:end]


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number for a dtype in every process (``hash`` of a string is salted per process)."""
    return zlib.crc32(str(dtype).encode())


def _described(heading: list[int], ours: torch.dtype) -> str:
    job, kind, dtype, length, chunk, number = heading
    what = {v: k for k, v in _KINDS.items()}.get(kind, f"kind {kind}")
    element = str(ours).removeprefix("torch.") if dtype == _dtype_code(ours) else f"other than {ours}"
    return f"chunk {number} of its exchange {job} ({what}, {length} elements of {element} a member, {chunk} B chunks)"


class SharedMemoryExchange:
    """One member set's reduce-scatters and all-gathers through its members' slots, run in issue
    order on a thread of its own."""

    def __init__(self, members: tuple[int, ...], index: int, timeout: float, error_for: ErrorFor, *,
                 slot_bytes: int, inbox: int, slots: torch.Tensor, peer_slots: list[int],
                 outboxes: list[int]) -> None:
        self._members, self._index, self._timeout, self._error_for = members, index, timeout, error_for
        self._inbox, self._slots, self._peer_slots, self._outboxes = inbox, slots, peer_slots, outboxes
        self._slot_bytes = slot_bytes
        n = len(members)
        self._written = [0] * n  # chunks each peer said it wrote into its slots
        self._read = [0] * n  # chunks of ours each peer said it read
        self._seq = 0  # chunks this member wrote
        self._pending = b""
        self._exchanges_run = 0  # exchanges this member ran: every chunk's header says which
        self._heading = torch.empty(6, dtype=torch.int64)  # a peer's chunk header, read
        # poll, not select: select refuses descriptors from 1024 on, which gloo's sockets reach.
        self._poller = select.poll()
        self._poller.register(inbox, select.POLLIN)
        self._jobs = JobThread(f"shardwise-shm-{'-'.join(map(str, members))}-rank-{members[index]}", self._run,
                               timeout, error_for, release=self._release)

    def close(self) -> None:
        """Fail what is queued, end the thread and release the descriptors and slots (at once when
        the thread is idle, else by the thread when its exchange ends)."""
        self._jobs.close()

    def _release(self) -> None:
        _close({"inbox": self._inbox, "outboxes": self._outboxes, "peer_slots": self._peer_slots})
        self._inbox, self._outboxes, self._peer_slots = -1, [], []
        self._slots = torch.empty(0, dtype=torch.uint8)  # the mapping goes with its last reference

    # -- what the backend calls --------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, group: Group, op_name: str, shape: torch.Size) -> Work:
        """All-gather ``x`` (flat): the rows (n, numel) in the group's order, viewed as ``shape``."""
        out = torch.empty(group.size, x.numel(), dtype=x.dtype)
        out[group.index(self._member_rank)].copy_(x)  # the caller may change x at once
        return self._jobs.submit(Job("all_gather", op_name, group, out, None, shape))

    def all_gather_into(self, xs: Sequence[torch.Tensor], into: Rows, group: Group, op_name: str) -> Work:
        """All-gather ``xs`` (1-D pieces end to end) into ``into`` (each member's row as the caller's
        pieces): ``xs`` into this member's own row where it does not lie there already, then each
        chunk is sent from that row and a peer's copied out of its slot straight into its pieces.
        This member's row is read until the wait."""
        own = into[group.index(self._member_rank)]
        copy_pieces(xs, own)
        shape = torch.Size([sum(piece.numel() for piece in own)])
        return self._jobs.submit(Job("all_gather", op_name, group, None, None, shape, into=into, dtype=xs[0].dtype))

    def reduce_scatter(self, rows: torch.Tensor, group: Group, op_name: str, shape: torch.Size) -> Work:
        """Reduce ``rows`` ((n, m), in the group's order, this call's own) and return this member's
        row of the sum as ``shape``, in a tensor of its own (``rows`` is released at the end)."""
        # The result is made when the set's thread starts on it, not here: held no longer than needed.
        return self._jobs.submit(Job("reduce_scatter", op_name, group, None, rows, shape))

    def reduce_scatter_rows(self, rows: Rows, dtype: torch.dtype, group: Group, op_name: str) -> Work:
        """Reduce the (n, m) buffer whose row ``j`` is ``rows[j]``'s pieces end to end, in ``dtype``,
        and return this member's row of the sum: each piece is copied (and converted) straight into
        the slots it is sent from, and this member's own row into the result. The pieces are read
        until the wait."""
        shape = torch.Size([sum(piece.numel() for piece in rows[0])])
        return self._jobs.submit(Job("reduce_scatter", op_name, group, None, None, shape, pieces=rows, dtype=dtype))

    @property
    def _member_rank(self) -> int:
        return self._members[self._index]

    # -- the set's thread -------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        """Write this member's chunks into its slots as fast as the peers free them, and take each
        peer's chunks out of theirs as they come (chunk by chunk, peers in a fixed order)."""
        group, rows, into, pieces = job.group, job.rows, job.into, job.pieces
        by_row = None if pieces is None else [_Row(row) for row in pieces]
        # Members in the set's order (sorted ranks) index the slots; the group may list them in
        # another order, which only says where each row goes.
        n, me = len(self._members), self._index
        place = [group.index(rank) for rank in self._members]  # set index -> group index
        if job.out is None and into is None:
            if pieces is not None:
                assert job.dtype is not None
                job.out = torch.empty(job.shape.numel(), dtype=job.dtype)
            else:
                assert rows is not None
                job.out = torch.empty(rows.shape[1], dtype=rows.dtype)
        # An all-gather into the caller's pieces sends from this member's row of them, the input
        # its issue put there; it has no buffer of its own (``out`` only names its dtype and length).
        sent = None if into is None else _Row(into[place[me]])
        out = job.out if into is None else torch.empty(job.shape, dtype=job.dtype, device="meta")
        assert out is not None
        gather = job.kind == "all_gather"
        step = (self._slot_bytes - _HEADER_BYTES) // (out.element_size() * (1 if gather else n))
        length = out.shape[-1] if gather else out.shape[0]
        spans = [(a, min(a + step, length)) for a in range(0, length, step)]
        # Peers in the order the TCP exchanges add them (back through the group's order), so the
        # sums agree bitwise whichever transport a run takes.
        at = group.index(self._member_rank)
        peers = [self._members.index(group.ranks[(at - k) % n]) for k in range(1, n)]
        first, deadline = self._seq, time.monotonic() + self._timeout
        job_number, self._exchanges_run = self._exchanges_run, self._exchanges_run + 1
        heading = [job_number, _KINDS[job.kind], _dtype_code(out.dtype), length, step * out.element_size()]
        scratch = None if gather else torch.empty(step, dtype=out.dtype)  # a peer's part, to add
        written = taken = 0  # this job's chunks written into our slots; chunks taken from every peer
        peer_at = 0  # the next peer to take chunk ``taken`` from
        while taken < len(spans) or written < len(spans):
            moved = False
            while written < len(spans) and self._free(first + written):
                a, b = spans[written]
                slot = (first + written) % SLOTS
                self._slots[slot * self._slot_bytes:][:_HEADER_BYTES].view(torch.int64)[:6].copy_(
                    torch.tensor([*heading, written]))
                own = self._slot(self._slots, slot, out.dtype)
                if sent is not None:
                    sent.copy_into(a, b, own[: b - a])
                elif gather:
                    own[: b - a].copy_(out[place[me], a:b])
                else:
                    cells = own[: n * step].view(n, step)
                    for j in range(n):
                        if j == me:
                            continue
                        if by_row is not None:
                            by_row[place[j]].copy_into(a, b, cells[j, : b - a])
                        else:
                            assert rows is not None
                            cells[j, : b - a].copy_(rows[place[j], a:b])
                self._signal_all(_WRITTEN)
                written += 1
                moved = True
            while taken < len(spans) and self._written[peers[peer_at]] > first + taken:
                j, (a, b) = peers[peer_at], spans[taken]
                offset = (first + taken) % SLOTS * self._slot_bytes
                self._check_heading(j, offset, [*heading, taken], out.dtype)
                offset += _HEADER_BYTES
                if into is not None:
                    self._take_pieces(j, offset, pieces_within(into[place[j]], a, b))
                elif gather:
                    self._take(j, offset, out[place[j], a:b])
                else:
                    assert scratch is not None
                    part = self._take(j, offset + me * step * out.element_size(), scratch[: b - a])
                    if peer_at == 0 and by_row is not None:  # this member's own values plus the first peer's
                        by_row[place[me]].add_into(a, b, part, out[a:b])
                    elif peer_at == 0:
                        assert rows is not None
                        torch.add(rows[place[me], a:b], part, out=out[a:b])
                    else:
                        out[a:b] += part
                self._signal(j, _READ)
                peer_at += 1
                if peer_at == len(peers):
                    peer_at, taken = 0, taken + 1
                moved = True
            if not moved:
                self._hear(deadline)
        self._seq = first + len(spans)
        job.result = out.view(job.shape) if into is None else torch.empty(0, dtype=out.dtype)

    def _take(self, j: int, offset: int, into: torch.Tensor) -> torch.Tensor:
        """Copy ``into``'s bytes from member ``j``'s slots at ``offset``."""
        self._take_pieces(j, offset, [into])
        return into

    def _take_pieces(self, j: int, offset: int, pieces: list[torch.Tensor]) -> None:
        """Copy member ``j``'s bytes at ``offset`` into ``pieces``, end to end: one read per
        ``_IOV_MAX`` pieces (the most buffers one ``preadv`` takes)."""
        # Through ctypes, not numpy: torch marks a tensor's storage it lent numpy unresizable, and
        # ZeRO-3 frees a gathered unit by resizing its storage to nothing.
        views = [(ctypes.c_char * (p.numel() * p.element_size())).from_address(p.data_ptr()) for p in pieces]
        for start in range(0, len(views), _IOV_MAX):
            batch = views[start: start + _IOV_MAX]
            nbytes = sum(len(v) for v in batch)
            got = os.preadv(self._peer_slots[j], batch, offset)
            if got != nbytes:
                raise CollectiveError(f"member {self._members[j]}'s slots were cut short ({got} of {nbytes} bytes)")
            offset += nbytes

    def _check_heading(self, j: int, offset: int, expected: list[int], dtype: torch.dtype) -> None:
        got = self._take(j, offset, self._heading).tolist()
        if got != expected:
            raise CollectiveError(
                f"member {self._members[j]} of the exchange sent {_described(got, dtype)}, where this member "
                f"takes {_described(expected, dtype)}: the members issued different collectives. "
                f"{DIFFERENT_COLLECTIVES}")

    def _free(self, seq: int) -> bool:
        """Whether every peer has taken what our slot for chunk ``seq`` held before."""
        return all(done > seq - SLOTS for j, done in enumerate(self._read) if j != self._index)

    def _slot(self, slots: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``slot``'s data (after its header) as ``dtype``."""
        return slots[slot * self._slot_bytes + _HEADER_BYTES: (slot + 1) * self._slot_bytes].view(dtype)

    def _signal_all(self, kind: int) -> None:
        for j in range(len(self._members)):
            if j != self._index:
                self._signal(j, kind)

    def _signal(self, j: int, kind: int) -> None:
        try:
            written = os.write(self._outboxes[j], bytes((kind, self._index)))
        except BlockingIOError:
            written = 0
        except BrokenPipeError:
            if kind == _READ:
                # The peer is done with its slots (its last exchange ended before we said we read its
                # last chunk, and it closed or exited): nothing waits for this record.
                return
            raise
        if written != 2:
            raise CollectiveError(f"member {self._members[j]} of the exchange stopped reading what it was sent")

    def _hear(self, deadline: float) -> None:
        """Wait (until ``deadline``) for what the peers say, and count it."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._poller.poll(max(1, int(remaining * 1000))):
            raise TimeoutError(f"timed out after {self._timeout:g} s waiting for a peer's slot")
        data = self._pending + os.read(self._inbox, 4096)
        whole = len(data) - len(data) % 2
        for at in range(0, whole, 2):
            kind, sender = data[at], data[at + 1]
            if kind == _WRITTEN:
                self._written[sender] += 1
            else:
                self._read[sender] += 1
        self._pending = data[whole:]
