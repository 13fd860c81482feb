"""Point to point on torch.distributed (the send / recv half of the backend).

Point to point (``send`` / ``recv``) runs on the default group with global
ranks. A message is a fixed-size int64 header (ndim, dtype code, up to
``_HEADER_DIMS`` sizes; more dims follow in an extension message) and the
payload as raw bytes, so the receiver learns shape and dtype from the sender
and any dtype travels. User tag ``t`` uses gloo tags ``2t+1`` (headers) and
``2t+2`` (extensions and payloads); tag 0 stays free for ``permute``, which
runs on the default group too when an axis spans the world. gloo's send is a
rendezvous (its work completes only once the receiver has posted the matching
receive), so ``send`` snapshots ``x`` and returns at once: waiting on it never
waits for the receiver. And gloo reports a send or receive done only through
its ``wait()`` (``is_completed()`` stays False until then), so a daemon thread
per backend waits for the sends in order, with the backend timeout, and frees
their buffers; a send that failed or was not received in time surfaces at the
next send/recv (or at ``close()``, which waits for them all). A send with
``snapshot=False`` skips both the copy and that thread: gloo reads ``x`` itself
and the caller's ``wait()`` waits for the delivery, as ``dist.isend``'s does
(handing every send to the thread costs two thread switches per message, which
a pipeline pays on its critical path). The backend keeps such a send until it is
waited, and waits for the oldest itself once ``_MAX_UNWAITED`` are pending, so a
caller that never waits cannot pile them up. A receive posts
its header receive when issued and its payload receive once the header
arrived, strictly in the order the receives of one (src, tag) were issued; for
the same reason its ``is_completed()`` is True only once ``wait()`` returned. Sends to this very
rank go through a local mailbox (gloo cannot send
to itself). Only CPU tensors travel (NCCL ignores tags, so the pure ``nccl``
backend refuses point to point for now): ``collectives.send`` copies a CUDA
tensor to the CPU first (``p2p_device``), and ``recv(..., device=)`` puts it
back, which is how a pipeline runs on GPUs over ``gloo`` or
``cpu:gloo,cuda:nccl``.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeout
from .base import CheckedWork, CompletedWork, Layout, Work, check_p2p
from .mailbox import LocalRecvWork, Mailbox

# -- helpers ---------------------------------------------------------------------
# Point-to-point header: ndim, dtype code, then the first _HEADER_DIMS sizes.
_HEADER_DIMS = 8
_HEADER_LEN = 2 + _HEADER_DIMS
# The dtype code is the position here; dtypes a torch version lacks are left
# out at the end, so the common codes never move (ranks run one torch anyway).
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16",
    "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "complex32", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _header_tag(tag: int) -> int:
    return 2 * tag + 1


def _payload_tag(tag: int) -> int:
    return 2 * tag + 2


def _p2p_header(x: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The header announcing ``x`` (and the extension with its sizes past _HEADER_DIMS, if any)."""
    code = _DTYPE_CODES.get(x.dtype)
    if code is None:
        raise ValueError(f"{op}: dtype {x.dtype} cannot travel point to point; known: {list(_DTYPES)}")
    dims = list(x.shape)
    first = dims[:_HEADER_DIMS] + [0] * max(0, _HEADER_DIMS - len(dims))
    header = torch.tensor([x.dim(), code, *first], dtype=torch.int64, device="cpu")
    extension = torch.tensor(dims[_HEADER_DIMS:], dtype=torch.int64, device="cpu") if len(dims) > _HEADER_DIMS else None
    return header, extension


def is_timeout(exc: BaseException) -> bool:
    # gloo raises RuntimeError("... timed out ..."); newer torch may use DistError subclasses.
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def flat_copy(x: torch.Tensor) -> torch.Tensor:
    """A private contiguous 1-D copy: collectives write in place, never into the caller's tensor."""
    return x.detach().clone(memory_format=torch.contiguous_format).reshape(-1)


class PointToPoint:
    """The point-to-point half of :class:`PointToPoint` (a mixin: it uses the backend's
    ``rank``, ``world_size``, ``timeout`` and ``name``)."""

    rank: int
    world_size: int
    timeout: float
    name: str

    @property
    def p2p_device(self) -> torch.device | None:
        """Messages travel through gloo, which moves CPU tensors (also under a mixed
        ``cpu:gloo,cuda:nccl`` group, where only collectives of CUDA tensors use NCCL)."""
        return torch.device("cpu")

    def _init_p2p(self) -> None:
        # Point to point: the sends gloo may still read (and their buffers),
        # receives per (src, tag) whose payload receive is not posted yet (in
        # issue order), and the mailbox of messages this rank sent to itself.
        self._p2p_lock = threading.RLock()
        self._sends = _SendReaper(self)
        # snapshot=False sends, oldest first: their parts, which let go of the sent tensor once waited for (the
        # entry leaves at a later send); the works did not, and kept a pipeline's last sends, every micro-batch's
        # output and input gradient, alive from one step to the next's first send.
        self._unwaited: deque[_PendingSend] = deque()
        self._recv_queues: dict[tuple[int, int], deque[_DistRecvWork]] = {}
        self._self_mailbox = Mailbox()

    def send(
        self, x: torch.Tensor, dst: int, tag: int, *, announce: bool = True, snapshot: bool = True,
        bounded: bool = True,
    ) -> Work:
        dst, tag = check_p2p("send", dst, tag, self.world_size, "dst")
        self._check_p2p_device("send", x.device)
        if dst == self.rank:
            self._self_mailbox.put((dst, dst, tag), x.detach().clone())
            return CompletedWork(x)
        if snapshot or not x.is_contiguous():
            payload = flat_copy(x).view(torch.uint8)  # a snapshot: x may change as soon as we return
        else:  # x stays unchanged until wait(): gloo reads it in place
            payload = x.detach().reshape(-1).view(torch.uint8)
        buffers = [payload]
        if announce:
            header, extension = _p2p_header(x, "send")
            buffers = [header, *([extension] if extension is not None else []), payload]
        with self._p2p_lock:
            self._sends.raise_failure()
            if not snapshot and bounded:
                self._limit_unwaited()
            works: list[Any] = []
            issued = False
            try:
                if announce:
                    works.append(dist.isend(buffers[0], dst, tag=_header_tag(tag)))
                for buf in buffers[1:] if announce else buffers:
                    if buf.numel():  # an empty tensor has no payload: the header says it all
                        works.append(dist.isend(buf, dst, tag=_payload_tag(tag)))
                issued = True
            except Exception as exc:
                raise self._p2p_error("send to", dst, tag, exc) from exc
            finally:
                # Even a partly issued send must keep its buffers until gloo is done.
                if works and (snapshot or not issued):
                    self._sends.add(_PendingSend(dst, tag, works, buffers))
            if snapshot:
                return CompletedWork(x)
            pending = _PendingSend(dst, tag, works, buffers)
            self._unwaited.append(pending)
        return _DeliveryWork(self, pending, x)

    def _limit_unwaited(self) -> None:
        """Forget the waited snapshot=False sends; past ``_MAX_UNWAITED`` pending, wait for the oldest."""
        unwaited = self._unwaited
        while unwaited and unwaited[0].done:
            unwaited.popleft()
        while len(unwaited) >= _MAX_UNWAITED:
            unwaited.popleft().wait(self)

    def recv(self, src: int, tag: int, *, like: Layout | None = None) -> Work:
        src, tag = check_p2p("recv", src, tag, self.world_size, "src")
        self._check_p2p_device("recv", torch.device("cpu"))
        if src == self.rank:
            key = (src, src, tag)
            return CheckedWork(LocalRecvWork(self._self_mailbox, key, self._self_mailbox.claim(key)), like, src, tag)
        if like is not None:
            return self._recv_known(src, tag, like)
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device="cpu")
        with self._p2p_lock:
            self._sends.raise_failure()
            try:
                work = dist.irecv(header, src, tag=_header_tag(tag))
            except Exception as exc:
                raise self._p2p_error("recv from", src, tag, exc) from exc
            recv = _DistRecvWork(self, src, tag, header, work)
            self._recv_queues.setdefault((src, tag), deque()).append(recv)
        return recv

    def _recv_known(self, src: int, tag: int, like: Layout) -> Work:
        """An unannounced message of a known layout: one receive, posted at once, straight into its buffer."""
        shape, dtype = torch.Size(like[0]), like[1]
        out = torch.empty(shape, dtype=dtype, device="cpu")
        if out.numel() == 0:  # nothing travels for an empty tensor
            return CompletedWork(out)
        with self._p2p_lock:
            self._sends.raise_failure()
            try:
                work = dist.irecv(out.view(-1).view(torch.uint8), src, tag=_payload_tag(tag))
            except Exception as exc:
                raise self._p2p_error("recv from", src, tag, exc) from exc
        return _KnownRecvWork(self, src, tag, work, out)

    def close(self) -> None:
        """Wait (up to the timeout) until every send was received; raise if one failed."""
        with self._p2p_lock:
            unwaited, self._unwaited = list(self._unwaited), deque()
        for pending in unwaited:
            pending.wait(self)
        if not self._sends.drain(time.monotonic() + self.timeout):
            raise CollectiveTimeout(
                f"close on rank {self.rank} [{self.name}]: sends were still not received after "
                f"{self.timeout:g} s (did their receivers return early?)"
            )
        self._sends.raise_failure()

    def _check_p2p_device(self, op: str, device: torch.device) -> None:
        if self.name == "nccl":
            raise NotImplementedError(
                f"{op}: point-to-point messages are not supported on the nccl backend yet (nccl "
                "ignores tags); initialise torch.distributed with 'cpu:gloo,cuda:nccl' and send CPU tensors"
            )
        if device.type != "cpu":
            raise ValueError(
                f"{op}: point-to-point messages on torch.distributed travel through gloo and need CPU "
                f"tensors, got one on {device}; move it with x.cpu()"
            )

    def _advance(self, src: int, tag: int, upto: _DistRecvWork, deadline: float) -> None:
        """Post payload receives for (src, tag) in issue order, up to and including ``upto``.

        Each waits (until ``deadline``) for its header first: the payloads of
        one (src, tag) arrive in send order, so their receives are posted in
        the order the receives were issued, whatever order they are waited in.
        """
        with self._p2p_lock:
            queue = self._recv_queues.get((src, tag))
            while queue:
                head = queue[0]
                head._post_payload(deadline)
                queue.popleft()
                if head is upto:
                    break
            if not queue:
                self._recv_queues.pop((src, tag), None)

    def _wait_p2p(self, work: Any, deadline: float, what: str, peer: int, tag: int) -> None:
        """Wait for one torch work until ``deadline``, turning its failures into CollectiveErrors."""
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            completed = work.wait(timeout=datetime.timedelta(seconds=remaining))
        except Exception as exc:
            raise self._p2p_error(what, peer, tag, exc) from exc
        if completed is False:
            raise self._p2p_error(what, peer, tag, TimeoutError("wait timed out"))

    def _p2p_error(self, what: str, peer: int, tag: int, exc: BaseException) -> CollectiveError:
        where = f"{what} rank {peer} (tag {tag}) on rank {self.rank} [{self.name}]"
        if is_timeout(exc):
            return CollectiveTimeout(
                f"{where} timed out after {self.timeout:g} s: rank {peer} never sent a matching message "
                f"(it failed, returned early, or used another tag): {exc}"
                if what == "recv from"
                else f"{where} timed out after {self.timeout:g} s: rank {peer} never received it: {exc}"
            )
        return CollectiveError(f"{where} failed (timeout {self.timeout:g} s): {type(exc).__name__}: {exc}")


# Pending snapshot=False sends nobody waited for yet, past which a send waits for the oldest.
_MAX_UNWAITED = 1024


class _DeliveryWork(Work):
    """A ``snapshot=False`` send: ``wait()`` waits until gloo is done reading (the receiver has it).

    Its parts are waited for at most once (gloo's send works count their waits), by the caller, by
    the backend when too many are pending, or by ``close()``, whichever comes first.
    """

    def __init__(self, backend: PointToPoint, pending: _PendingSend, x: torch.Tensor) -> None:
        self._backend, self._pending, self._x = backend, pending, x

    def wait(self) -> torch.Tensor:
        self._pending.wait(self._backend)
        return self._x

    def is_completed(self) -> bool:
        return self._pending.done


class _PendingSend:
    """A send gloo may still be reading: its works and the buffers they read, both let go of once
    waited for (the buffers may be views of the caller's tensor)."""

    __slots__ = ("_lock", "buffers", "dst", "tag", "works")

    def __init__(self, dst: int, tag: int, works: list[Any], buffers: list[torch.Tensor]) -> None:
        self.dst, self.tag = dst, tag
        self.works: list[Any] | None = works
        self.buffers: list[torch.Tensor] | None = buffers
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.works is None

    def wait(self, backend: PointToPoint) -> None:
        """Wait until gloo is done with every part (within the backend timeout); raise if one failed.
        Once: a later call returns at once (a failure is reported once; gloo is done with it)."""
        with self._lock:
            if self.works is None:
                return
            try:
                deadline = time.monotonic() + backend.timeout
                for work in self.works:
                    backend._wait_p2p(work, deadline, "send to", self.dst, self.tag)
            finally:
                self.works = self.buffers = None


class _SendReaper:
    """Waits for a backend's sends, in order, on a daemon thread started with the first send.

    gloo reports a send done only through ``wait()``, so somebody has to wait
    for each one to free its buffers and to notice a failure; the sender itself
    must not (that would wait for the receiver). The first failure is kept and
    raised by :meth:`raise_failure`.
    """

    def __init__(self, backend: PointToPoint) -> None:
        self._backend = backend
        self._cond = threading.Condition()
        self._queue: deque[_PendingSend] = deque()
        self._in_flight = 0
        self._failure: CollectiveError | None = None
        self._thread: threading.Thread | None = None

    def add(self, pending: _PendingSend) -> None:
        with self._cond:
            self._queue.append(pending)
            self._in_flight += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"shardwise-sends-rank-{self._backend.rank}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        backend = self._backend
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                pending = self._queue.popleft()
            try:
                pending.wait(backend)
            except CollectiveError as exc:
                with self._cond:
                    self._failure = self._failure or exc
            finally:
                del pending  # frees the buffers
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def raise_failure(self) -> None:
        with self._cond:
            failure = self._failure
        if failure is not None:
            raise CollectiveError(f"an earlier {failure}") from failure

    def drain(self, deadline: float) -> bool:
        """Wait until every send finished (or ``deadline``); True when none is left."""
        with self._cond:
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True


class _KnownRecvWork(Work):
    """A posted receive of a known layout; ``wait()`` applies the backend timeout."""

    def __init__(self, backend: PointToPoint, src: int, tag: int, work: Any, out: torch.Tensor) -> None:
        self._backend, self._src, self._tag, self._work, self._out = backend, src, tag, work, out
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            deadline = time.monotonic() + self._backend.timeout
            self._backend._wait_p2p(self._work, deadline, "recv from", self._src, self._tag)
            self._done = True
        return self._out

    def is_completed(self) -> bool:
        return self._done


class _DistRecvWork(Work):
    """A receive: header posted when issued, payload posted (in issue order) once the header is in."""

    def __init__(
        self, backend: PointToPoint, src: int, tag: int, header: torch.Tensor, header_work: Any
    ) -> None:
        self._backend, self._src, self._tag = backend, src, tag
        self._header = header
        self.header_work = header_work
        self._out: torch.Tensor | None = None  # allocated once the header arrived
        self._payload_work: Any = None
        self._result: torch.Tensor | None = None

    def _post_payload(self, deadline: float) -> None:
        """Wait for the header, then post the receive of the payload (called in issue order)."""
        b, src, tag = self._backend, self._src, self._tag
        b._wait_p2p(self.header_work, deadline, "recv from", src, tag)
        ndim, code, *dims = (int(v) for v in self._header.tolist())
        if ndim > _HEADER_DIMS:
            extension = torch.empty(ndim - _HEADER_DIMS, dtype=torch.int64, device="cpu")
            try:
                work = dist.irecv(extension, src, tag=_payload_tag(tag))
            except Exception as exc:
                raise b._p2p_error("recv from", src, tag, exc) from exc
            b._wait_p2p(work, deadline, "recv from", src, tag)
            dims += [int(v) for v in extension.tolist()]
        if not 0 <= code < len(_DTYPES):
            raise CollectiveError(
                f"recv from rank {src} (tag {tag}) on rank {b.rank}: unknown dtype code {code} in the "
                "header; do both ranks run the same torch version?"
            )
        out = torch.empty(dims[:ndim], dtype=_DTYPES[code], device="cpu")
        if out.numel():
            try:
                self._payload_work = dist.irecv(out.view(-1).view(torch.uint8), src, tag=_payload_tag(tag))
            except Exception as exc:
                raise b._p2p_error("recv from", src, tag, exc) from exc
        self._out = out

    def wait(self) -> torch.Tensor:
        if self._result is None:
            deadline = time.monotonic() + self._backend.timeout
            if self._out is None:
                self._backend._advance(self._src, self._tag, self, deadline)
            assert self._out is not None
            if self._payload_work is not None:
                self._backend._wait_p2p(self._payload_work, deadline, "recv from", self._src, self._tag)
            self._result = self._out
        return self._result

    def is_completed(self) -> bool:
        # gloo's send/recv works say they are done only once waited on, so this
        # cannot tell an arrived message from a missing one without blocking.
        return self._result is not None
