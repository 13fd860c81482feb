"""The torch.distributed backend: every rank is a process (gloo on CPU, NCCL on CUDA).

Each :class:`~shardwise.collectives.backend.Group` gets its own process group,
created on first use, so collectives on different mesh axes never queue behind
each other. Every primitive is issued with ``async_op=True`` and returns a
:class:`Work`; its ``wait()`` applies the backend timeout and turns torch's
errors into :class:`CollectiveTimeout` / :class:`CollectiveError` naming the op,
the axis, the group and this rank.

The shape conventions are those of ``backend.py`` (and of the threads backend,
which is the reference): tensors travel flat and contiguous, so any shape
(0-dim included) works, and results are fresh tensors, never the input. With
``snapshot=True`` (the default, and the async collectives) the input is copied
when the collective is issued, so the caller may reuse its tensor at once; with
``snapshot=False`` (the sync collectives) torch reads the caller's tensor
wherever it only reads (all_gather, reduce_scatter, all_to_all, the sends of
permute, the broadcast root), and only all_reduce, which torch runs in place,
still copies (into the buffer it returns).

Two things differ from the threads backend. A group's first collective creates
its process group, which blocks until every member arrives (later ones are
truly asynchronous). And after a timeout or a failed peer, torch may leave the
process group unusable: start the ranks over (ProcessPool does).

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
next send/recv (or at ``close()``, which waits for them all). A receive posts
its header receive when issued and its payload receive once the header
arrived, strictly in the order the receives of one (src, tag) were issued; for
the same reason its ``is_completed()`` is True only once ``wait()`` returned. Sends to this very rank go through a local mailbox (gloo cannot send
to itself). Only CPU tensors travel (NCCL ignores tags, so the pure ``nccl``
backend refuses point to point for now).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .backend import (
    Backend,
    CollectiveError,
    CollectiveTimeout,
    CompletedWork,
    Group,
    Work,
    check_p2p,
)
from .runtime import LocalRecvWork
from .threads import Mailbox

# torch 2.13 renamed the flat collectives and warns (FutureWarning) on the old
# names; torch 2.4 only has the old ones.
_all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

# Words torch uses when a backend refuses a dtype (gloo: "Invalid scalar type").
_DTYPE_REFUSALS = ("scalar type", "dtype", "datatype", "data type")


class TorchDistributedBackend(Backend):
    """One rank's handle on an initialised torch.distributed world."""

    def __init__(self, timeout: float = 60.0) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchDistributedBackend needs an initialised default process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the environment "
                "for it), or use shardwise.launch(main, world=N, backend='processes')"
            )
        if timeout <= 0:
            raise ValueError(f"TorchDistributedBackend(timeout={timeout!r}): timeout must be positive seconds")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = float(timeout)
        self.name = str(dist.get_backend())
        self._groups: dict[tuple[int, ...], Any] = {}
        # Point to point: the sends gloo may still read (and their buffers),
        # receives per (src, tag) whose payload receive is not posted yet (in
        # issue order), and the mailbox of messages this rank sent to itself.
        self._p2p_lock = threading.RLock()
        self._sends = _SendReaper(self)
        self._recv_queues: dict[tuple[int, int], deque[_DistRecvWork]] = {}
        self._self_mailbox = Mailbox()

    @classmethod
    def from_initialized(cls, timeout: float | None = None) -> TorchDistributedBackend:
        """Build the backend on the default process group (what torchrun users get).

        Without ``timeout`` the default group's own timeout is used.
        """
        if timeout is None:
            timeout = _default_group_timeout()
        return cls(timeout)

    @property
    def device(self) -> torch.device:
        if "nccl" in self.name:  # "nccl", or a mixed "cpu:gloo,cuda:nccl"
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- primitives -----------------------------------------------------------
    # With snapshot=True the input is copied before the collective is issued
    # (the caller may change it at once); with snapshot=False torch reads the
    # caller's tensor itself (the caller leaves it alone until wait). Results
    # are fresh buffers either way, never the input.
    def all_reduce(
        self, x: torch.Tensor, group: Group, op_name: str = "psum", *, snapshot: bool = True
    ) -> Work:
        pg, _ = self._enter(x, group, op_name)
        # torch reduces in place, so this copy is needed whatever ``snapshot``
        # says; it is also the result buffer, so there is no second one.
        buf = _flat_copy(x)
        work = self._issue(op_name, group, x, lambda: dist.all_reduce(buf, group=pg, async_op=True))
        return _DistWork(self, op_name, group, x, [work], lambda: buf.view(x.shape))

    def all_gather(
        self, x: torch.Tensor, group: Group, op_name: str = "all_gather", *, snapshot: bool = True
    ) -> Work:
        pg, order = self._enter(x, group, op_name)
        send = _flat_input(x, snapshot)  # torch only reads it
        out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
        work = self._issue(op_name, group, x, lambda: _all_gather_flat(out, send, group=pg, async_op=True))

        def finish() -> torch.Tensor:
            rows = out.view(group.size, *x.shape)
            return rows if order is None else rows[order]  # process-group order -> group order

        return _DistWork(self, op_name, group, x, [work], finish, keep_alive=(send,))

    def reduce_scatter(
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True
    ) -> Work:
        _check_leading_dim(x, group, op_name)
        pg, order = self._enter(x, group, op_name)
        # torch leaves the input of a reduce-scatter unchanged (nccl by its API;
        # gloo checked by tests/collectives/test_no_alias.py), so without a
        # snapshot it reads the caller's tensor.
        send = _to_process_group_order(x, order, snapshot)
        rest = x.shape[1:]
        out = torch.empty(rest.numel(), dtype=x.dtype, device=x.device)
        work = self._issue(op_name, group, x, lambda: _reduce_scatter_flat(out, send, group=pg, async_op=True))
        return _DistWork(self, op_name, group, x, [work], lambda: out.view(rest), keep_alive=(send,))

    def all_to_all(
        self, x: torch.Tensor, group: Group, op_name: str = "all_to_all", *, snapshot: bool = True
    ) -> Work:
        _check_leading_dim(x, group, op_name)
        pg, order = self._enter(x, group, op_name)
        send = _to_process_group_order(x, order, snapshot)  # torch only reads it
        out = torch.empty_like(send)
        work = self._issue(op_name, group, x, lambda: dist.all_to_all_single(out, send, group=pg, async_op=True))

        def finish() -> torch.Tensor:
            rows = out.view(x.shape)
            return rows if order is None else rows[order]

        return _DistWork(self, op_name, group, x, [work], finish, keep_alive=(send,))

    def broadcast(
        self, x: torch.Tensor, root: int, group: Group, op_name: str = "broadcast", *, snapshot: bool = True
    ) -> Work:
        if not 0 <= root < group.size:
            raise ValueError(f"{op_name}: root {root} is outside the group of size {group.size}")
        pg, _ = self._enter(x, group, op_name)
        src = group.ranks[root]  # torch takes the root as a global rank
        if group.index(self.rank) != root:
            # Every element is overwritten by the root's: no copy of x, no zeros.
            buf = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            work = self._issue(op_name, group, x, lambda: dist.broadcast(buf, src=src, group=pg, async_op=True))
            return _DistWork(self, op_name, group, x, [work], lambda: buf.view(x.shape))
        if snapshot or not x.is_contiguous():
            # The root's copy of x is both what travels and its result.
            buf = _flat_copy(x)
            work = self._issue(op_name, group, x, lambda: dist.broadcast(buf, src=src, group=pg, async_op=True))
            return _DistWork(self, op_name, group, x, [work], lambda: buf.view(x.shape))
        # torch only reads the root's tensor: send x itself and make the root's
        # result (it must not be x) while the message travels.
        send = x.detach().view(-1)
        work = self._issue(op_name, group, x, lambda: dist.broadcast(send, src=src, group=pg, async_op=True))
        result = x.detach().clone()
        return _DistWork(self, op_name, group, x, [work], lambda: result, keep_alive=(send,))

    def permute(
        self,
        x: torch.Tensor,
        pairs: Sequence[tuple[int, int]],
        group: Group,
        op_name: str = "ppermute",
        *,
        snapshot: bool = True,
    ) -> Work:
        pairs = _check_pairs(pairs, group, op_name)
        pg, _ = self._enter(x, group, op_name)
        me = group.index(self.rank)
        dsts = [group.ranks[d] for s, d in pairs if s == me != d]
        srcs = [group.ranks[s] for s, d in pairs if d == me != s]  # at most one (destinations are unique)
        if (me, me) in pairs:
            out = x.detach().clone(memory_format=torch.contiguous_format)
        elif srcs:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # the receive fills it
        else:
            out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # nothing arrives: zeros
        if not dsts:
            send = out  # unused
        elif (me, me) in pairs:
            send = out  # a private copy already, untouched until wait returns
        elif snapshot or not x.is_contiguous():
            send = x.detach().clone(memory_format=torch.contiguous_format)
        else:
            send = x.detach()  # torch only reads it
        # Peers are global ranks (torch translates them for the group); pairs
        # that stay on this rank were handled above as a local copy.
        ops = [dist.P2POp(dist.isend, send, d, group=pg) for d in dsts]
        ops += [dist.P2POp(dist.irecv, out, s, group=pg) for s in srcs]
        if not ops:
            return CompletedWork(out)
        works = self._issue(op_name, group, x, lambda: dist.batch_isend_irecv(ops))
        return _DistWork(self, op_name, group, x, list(works), lambda: out, keep_alive=(send,))

    # -- point to point -------------------------------------------------------
    def send(self, x: torch.Tensor, dst: int, tag: int) -> Work:
        dst, tag = check_p2p("send", dst, tag, self.world_size, "dst")
        self._check_p2p_device("send", x.device)
        if dst == self.rank:
            self._self_mailbox.put((dst, dst, tag), x.detach().clone())
            return CompletedWork(x)
        header, extension = _p2p_header(x, "send")
        payload = _flat_copy(x).view(torch.uint8)  # a snapshot: x may change as soon as we return
        buffers = [header, *([extension] if extension is not None else []), payload]
        with self._p2p_lock:
            self._sends.raise_failure()
            works: list[Any] = []
            try:
                works.append(dist.isend(header, dst, tag=_header_tag(tag)))
                for buf in buffers[1:]:
                    if buf.numel():  # an empty tensor has no payload: the header says it all
                        works.append(dist.isend(buf, dst, tag=_payload_tag(tag)))
            except Exception as exc:
                raise self._p2p_error("send to", dst, tag, exc) from exc
            finally:
                if works:  # even a partly issued send must keep its buffers until gloo is done
                    self._sends.add(_PendingSend(dst, tag, works, buffers))
        return CompletedWork(x)

    def recv(self, src: int, tag: int) -> Work:
        src, tag = check_p2p("recv", src, tag, self.world_size, "src")
        self._check_p2p_device("recv", torch.device("cpu"))
        if src == self.rank:
            key = (src, src, tag)
            return LocalRecvWork(self._self_mailbox, key, self._self_mailbox.claim(key))
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        with self._p2p_lock:
            self._sends.raise_failure()
            try:
                work = dist.irecv(header, src, tag=_header_tag(tag))
            except Exception as exc:
                raise self._p2p_error("recv from", src, tag, exc) from exc
            recv = _DistRecvWork(self, src, tag, header, work)
            self._recv_queues.setdefault((src, tag), deque()).append(recv)
        return recv

    def close(self) -> None:
        """Wait (up to the timeout) until every send was received; raise if one failed."""
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
        if _is_timeout(exc):
            return CollectiveTimeout(
                f"{where} timed out after {self.timeout:g} s: rank {peer} never sent a matching message "
                f"(it failed, returned early, or used another tag): {exc}"
                if what == "recv from"
                else f"{where} timed out after {self.timeout:g} s: rank {peer} never received it: {exc}"
            )
        return CollectiveError(f"{where} failed (timeout {self.timeout:g} s): {type(exc).__name__}: {exc}")

    # -- plumbing -------------------------------------------------------------
    def _enter(self, x: torch.Tensor, group: Group, op_name: str) -> tuple[Any, torch.Tensor | None]:
        """Check the call and return (process group, group order or None when it is the identity)."""
        group.index(self.rank)  # raises a clear ValueError when this rank is not a member
        if max(group.ranks) >= self.world_size or min(group.ranks) < 0:
            raise ValueError(
                f"{op_name} on axis {group.axis!r}: group {group.ranks} names ranks outside the "
                f"world of {self.world_size}"
            )
        if self.name == "nccl" and x.device.type != "cuda":
            raise ValueError(
                f"{op_name} on axis {group.axis!r}: the nccl backend needs tensors on "
                f"{self.device}, got one on {x.device}; move it with x.to(backend.device)"
            )
        members = tuple(sorted(group.ranks))
        pg = self._process_group(members, group, op_name)
        # A process group numbers its members in sorted order; a Group may list
        # them in any order, so results are permuted back to the Group's order.
        if members == group.ranks:
            return pg, None
        order = torch.tensor([members.index(r) for r in group.ranks], device=x.device)
        return pg, order

    def _process_group(self, members: tuple[int, ...], group: Group, op_name: str) -> Any:
        pg = self._groups.get(members)
        if pg is not None:
            return pg
        if members == tuple(range(self.world_size)):
            pg = dist.group.WORLD
        else:
            # use_local_synchronization: only the members take part in creating
            # the group, so ranks outside it never have to call in. Creation
            # blocks until every member arrives; groups are created in the order
            # a rank first uses them, which SPMD programs share. Should ranks
            # disagree, creation fails after the timeout rather than hanging.
            try:
                pg = dist.new_group(
                    list(members),
                    timeout=datetime.timedelta(seconds=self.timeout),
                    use_local_synchronization=True,
                )
            except Exception as exc:
                raise self._error(f"creating the process group for {op_name}", group, exc) from exc
        self._groups[members] = pg
        return pg

    def _issue(self, op_name: str, group: Group, x: torch.Tensor, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            raise self._error(op_name, group, exc, x.dtype) from exc

    def _error(
        self, what: str, group: Group, exc: BaseException, dtype: torch.dtype | None = None
    ) -> CollectiveError:
        """The CollectiveError to raise for torch's ``exc``, saying where it happened."""
        where = (
            f"{what} on axis {group.axis!r} (group ranks {group.ranks}) on rank {self.rank} "
            f"[{self.name}, timeout {self.timeout:g} s]"
        )
        if _is_timeout(exc):
            return CollectiveTimeout(
                f"{where} timed out: a rank of the group never arrived (it failed, returned early, "
                f"or issued different collectives): {exc}"
            )
        if dtype is not None and any(word in str(exc).lower() for word in _DTYPE_REFUSALS):
            # gloo refuses e.g. float8 with a bare "Invalid scalar type", at issue or at wait.
            return CollectiveError(
                f"{where}: the {self.name} backend refused dtype {dtype} ({exc}). Cast the tensor "
                "to a dtype it supports (gloo: float16, bfloat16, float32, float64, integers) "
                "before the collective and back after it."
            )
        return CollectiveError(f"{where} failed: {type(exc).__name__}: {exc}")


class _DistWork(Work):
    """Waits on torch's works with the backend timeout, then builds the result once."""

    def __init__(
        self,
        backend: TorchDistributedBackend,
        op_name: str,
        group: Group,
        x: torch.Tensor,
        works: list[Any],
        finish: Callable[[], torch.Tensor],
        keep_alive: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._backend, self._op_name, self._group = backend, op_name, group
        self._dtype = x.dtype
        self._works = works
        self._finish = finish
        # Buffers torch reads asynchronously (an isend's tensor) must outlive the op.
        self._keep_alive = keep_alive
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            timeout = datetime.timedelta(seconds=self._backend.timeout)
            for work in self._works:
                try:
                    completed = work.wait(timeout=timeout)
                except Exception as exc:
                    raise self._backend._error(self._op_name, self._group, exc, self._dtype) from exc
                if completed is False:  # some backends report a timeout by returning False
                    raise self._backend._error(self._op_name, self._group, TimeoutError("wait timed out"))
            self._result = self._finish()
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or all(work.is_completed() for work in self._works)


class _PendingSend:
    """A send gloo may still be reading: its works and the buffers they read."""

    __slots__ = ("buffers", "dst", "tag", "works")

    def __init__(self, dst: int, tag: int, works: list[Any], buffers: list[torch.Tensor]) -> None:
        self.dst, self.tag, self.works, self.buffers = dst, tag, works, buffers


class _SendReaper:
    """Waits for a backend's sends, in order, on a daemon thread started with the first send.

    gloo reports a send done only through ``wait()``, so somebody has to wait
    for each one to free its buffers and to notice a failure; the sender itself
    must not (that would wait for the receiver). The first failure is kept and
    raised by :meth:`raise_failure`.
    """

    def __init__(self, backend: TorchDistributedBackend) -> None:
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
            deadline = time.monotonic() + backend.timeout
            try:
                for work in pending.works:
                    backend._wait_p2p(work, deadline, "send to", pending.dst, pending.tag)
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


class _DistRecvWork(Work):
    """A receive: header posted when issued, payload posted (in issue order) once the header is in."""

    def __init__(
        self, backend: TorchDistributedBackend, src: int, tag: int, header: torch.Tensor, header_work: Any
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
            extension = torch.empty(ndim - _HEADER_DIMS, dtype=torch.int64)
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
        out = torch.empty(dims[:ndim], dtype=_DTYPES[code])
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
    header = torch.tensor([x.dim(), code, *first], dtype=torch.int64)
    extension = torch.tensor(dims[_HEADER_DIMS:], dtype=torch.int64) if len(dims) > _HEADER_DIMS else None
    return header, extension


def _default_group_timeout() -> float:
    """The default group's own timeout in seconds (what init_process_group was given)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # private layout changed: torch's documented default
        return float(dist.default_pg_timeout.total_seconds())


def _is_timeout(exc: BaseException) -> bool:
    # gloo raises RuntimeError("... timed out ..."); newer torch may use DistError subclasses.
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def _flat_copy(x: torch.Tensor) -> torch.Tensor:
    """A private contiguous 1-D copy: collectives write in place, never into the caller's tensor."""
    return x.detach().clone(memory_format=torch.contiguous_format).reshape(-1)


def _flat_input(x: torch.Tensor, snapshot: bool) -> torch.Tensor:
    """``x`` as a flat contiguous tensor that torch only reads: a copy only when a snapshot is asked for."""
    return _flat_copy(x) if snapshot else x.detach().reshape(-1)


def _to_process_group_order(x: torch.Tensor, order: torch.Tensor | None, snapshot: bool) -> torch.Tensor:
    """Rows of ``x`` (one per group index) rearranged by process-group rank, flat.

    A copy when the order is not the identity (the rearranged rows are new
    anyway) or when a snapshot is asked for; otherwise a view of ``x``.
    """
    rows = x.detach()
    if order is None:
        return _flat_input(rows, snapshot)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return rows[inverse].reshape(-1)  # advanced indexing: a new contiguous tensor


def _check_leading_dim(x: torch.Tensor, group: Group, op_name: str) -> None:
    if x.dim() == 0 or x.shape[0] != group.size:
        raise ValueError(
            f"{op_name}: backend input must have shape (group size {group.size}, ...), got {tuple(x.shape)}"
        )


def _check_pairs(
    pairs: Sequence[tuple[int, int]], group: Group, op_name: str
) -> tuple[tuple[int, int], ...]:
    checked = tuple((int(s), int(d)) for s, d in pairs)
    for s, d in checked:
        if not (0 <= s < group.size and 0 <= d < group.size):
            raise ValueError(
                f"{op_name} on axis {group.axis!r}: pair ({s}, {d}) is outside the group of size {group.size}"
            )
    dsts = [d for _, d in checked]
    if len(set(dsts)) != len(dsts):
        raise ValueError(
            f"{op_name} on axis {group.axis!r}: pairs {checked} send twice to the same destination; "
            "each group index may receive from at most one source"
        )
    return checked
