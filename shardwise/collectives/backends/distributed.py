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
still copies (into the buffer it returns). On gloo CPU tensors a reduce-scatter or
all-gather of at least 64 KiB per member runs as a direct exchange between the
members (``gloo_exchange.py``), through shared memory when they share a host
(``shared_memory_exchange.py``); a smaller reduce-scatter runs as an all-reduce
(faster there than torch's gloo reduce-scatter), copying its input unless donated.

Two things differ from the threads backend. A group's first collective creates
its process group, which blocks until every member arrives (later ones are
truly asynchronous). And after a timeout or a failed peer, torch may leave the
process group unusable: start the ranks over (ProcessPool does).

Point to point (``send`` / ``recv``) lives in ``distributed_p2p.py``.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DIFFERENT_COLLECTIVES, CollectiveError, CollectiveTimeout
from ..timeout import DEFAULT_TIMEOUT_S, check_timeout
from .base import Backend, CompletedWork, Group, Rows, Work
from .distributed_p2p import PointToPoint
from .distributed_p2p import flat_copy as _flat_copy
from .distributed_p2p import is_timeout as _is_timeout
from .gloo_exchange import ExchangeGroup, exchanges, exchanges_of
from .shared_memory_exchange import in_use, open_same_host

# torch 2.13 renamed the flat collectives and warns (FutureWarning) on the old
# names; torch 2.4 only has the old ones.
_all_gather_flat: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

# Words torch uses when a backend refuses a dtype (gloo: "Invalid scalar type").
_DTYPE_REFUSALS = ("scalar type", "dtype", "datatype", "data type")


class TorchDistributedBackend(PointToPoint, Backend):
    """One rank's handle on an initialised torch.distributed world."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchDistributedBackend needs an initialised default process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the environment "
                "for it), or use shardwise.launch(main, world=N, backend='processes')"
            )
        timeout = check_timeout("TorchDistributedBackend", timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = float(timeout)
        self.name = str(dist.get_backend())
        # Weak: torch's registry owns the process groups. A group shardwise kept alive past
        # destroy_process_group() would be torn down at interpreter exit, and gloo then aborts the
        # process now and then ("terminate called without an active exception").
        self._groups: dict[tuple[int, ...], weakref.ref[Any]] = {}
        # gloo on CPU: the member sets' exchanges (gloo_exchange.py), each on a process group of its own.
        self._exchange_groups: dict[tuple[int, ...], ExchangeGroup] = {}
        self._init_p2p()

    @classmethod
    def from_initialized(cls, timeout: float | None = None) -> TorchDistributedBackend:
        """Build the backend on the default process group (what torchrun users get).

        Without ``timeout``: the timeout given to ``init_process_group(timeout=...)``,
        which is how a torchrun script sets the one timeout; when none was given
        (the group has torch's default of 30 minutes), shardwise's own default
        of 5 minutes (``collectives/timeout.py``). It bounds every wait of this
        backend and the process groups it creates per mesh axis.
        """
        if timeout is None:
            given = _default_group_timeout()
            timeout = DEFAULT_TIMEOUT_S if given == dist.default_pg_timeout.total_seconds() else given
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
        if self._exchanges(x, group, one_member=True):
            exchange = self._exchange_group(group, op_name)
            if in_use(exchange.shared):
                assert exchange.shared is not None
                return exchange.shared.all_gather(_flat_input(x, False), group, op_name,
                                                  torch.Size([group.size, *x.shape]))
            works, rows = exchange.all_gather(_flat_input(x, False), group)
            return _DistWork(self, op_name, group, x, works, lambda: rows.view(group.size, *x.shape))
        send = _flat_input(x, snapshot)  # torch only reads it
        out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
        work = self._issue(op_name, group, x, lambda: _all_gather_flat(out, send, group=pg, async_op=True))

        def finish() -> torch.Tensor:
            rows = out.view(group.size, *x.shape)
            return rows if order is None else rows[order]  # process-group order -> group order

        return _DistWork(self, op_name, group, x, [work], finish, keep_alive=(send,))

    def all_gather_into(
        self, xs: Sequence[torch.Tensor], rows: Rows, group: Group, op_name: str = "all_gather"
    ) -> Work:
        """Through shared memory, this member's row is sent from where the caller's pieces are and
        each peer's is copied out of its slots straight into ``rows`` (the copies made anyway), with
        no buffer; elsewhere joined, gathered, then copied (Backend's)."""
        nbytes = group.size * sum(x.numel() for x in xs) * xs[0].element_size()
        if self._on_gloo_cpu(xs[0]) and exchanges_of(nbytes, xs[0].dtype, group):
            self._enter(xs[0], group, op_name)
            exchange = self._exchange_group(group, op_name)
            if in_use(exchange.shared):
                assert exchange.shared is not None
                return exchange.shared.all_gather_into(xs, rows, group, op_name)
        return super().all_gather_into(xs, rows, group, op_name)

    def reduce_scatter(
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True,
        donate: bool = False,
    ) -> Work:
        _check_leading_dim(x, group, op_name)
        pg, order = self._enter(x, group, op_name)
        if self._exchanges(x, group):
            # The exchange reduces in its input: the donated buffer itself, else a copy of x.
            rows = (x.detach().reshape(-1) if donate and x.is_contiguous() else _flat_copy(x)).view(group.size, -1)
            return self._exchange_group(group, op_name).reduce_scatter(rows, group, op_name, x.shape[1:])
        if self._on_gloo_cpu(x):
            return self._reduce_scatter_by_all_reduce(x, group, pg, op_name, donate)
        # torch leaves the input of a reduce-scatter unchanged (nccl by its API;
        # gloo checked by tests/collectives/test_no_alias.py), so without a
        # snapshot it reads the caller's tensor.
        send = _to_process_group_order(x, order, snapshot)
        rest = x.shape[1:]
        out = torch.empty(rest.numel(), dtype=x.dtype, device=x.device)
        work = self._issue(op_name, group, x, lambda: _reduce_scatter_flat(out, send, group=pg, async_op=True))
        return _DistWork(self, op_name, group, x, [work], lambda: out.view(rest), keep_alive=(send,))

    def reduce_scatter_rows(self, rows: Rows, dtype: torch.dtype, group: Group, op_name: str = "psum_scatter") -> Work:
        """Through shared memory, each member's pieces are copied into the slots they are sent from
        (the copy made anyway), with no buffer of the whole input; elsewhere concatenated first
        (Backend's)."""
        first = next(piece for row in rows for piece in row)
        numel = group.size * sum(piece.numel() for piece in rows[0])
        if self._on_gloo_cpu(first) and exchanges_of(numel * dtype.itemsize, dtype, group):
            self._enter(first, group, op_name)
            exchange = self._exchange_group(group, op_name)
            if in_use(exchange.shared):
                assert exchange.shared is not None
                return exchange.shared.reduce_scatter_rows(rows, dtype, group, op_name)
        return super().reduce_scatter_rows(rows, dtype, group, op_name)

    def _reduce_scatter_by_all_reduce(
        self, x: torch.Tensor, group: Group, pg: Any, op_name: str, donate: bool = False
    ) -> Work:
        """gloo's reduce-scatter: an all-reduce of a copy of ``x`` (of ``x`` itself when it is
        donated and contiguous), then this rank's row, copied.

        gloo has no reduce-scatter of its own: torch's ``reduce_scatter_single`` on gloo took 1.45x
        an all-reduce of the same buffer here (8 MiB, world 2; 1.15x at world 4, 1.2x at 1 MiB;
        benchmarks/README.md, issue 27), and its list form as long or longer. The all-reduce runs
        in place, so it works on a copy (the caller's tensor is left as it was), and the result is
        a copy of this rank's row, so the whole buffer is released at the wait. The rows are in
        the Group's order already: no reordering for a group listed out of rank order. The ledger
        still counts the reduce-scatter's bytes (the op the program asked for). A donated ``x``
        saves the copy, a whole input's bytes (ZeRO's flat gradients: one unit at the backward's
        peak); gloo's ring then holds under 2 MiB of its own (measured at worlds 2-8, 4-24 MiB)."""
        buf = x.detach().reshape(-1) if donate and x.is_contiguous() else _flat_copy(x)
        row, shape = group.index(self.rank), x.shape  # the closure keeps no reference to x
        work = self._issue(op_name, group, x, lambda: dist.all_reduce(buf, group=pg, async_op=True))
        return _DistWork(self, op_name, group, x, [work], lambda: buf.view(shape)[row].clone())

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
        if self._stages_permute(x):
            # gloo's point to point writes and reads host memory only (a CUDA tensor's address fails
            # its writev with "Bad address"): the message travels as a host copy, the result comes back.
            host = self._permute(x.detach().to("cpu"), pairs, group, pg, op_name, snapshot=False)
            return _MovedTo(host, x.device)
        return self._permute(x, pairs, group, pg, op_name, snapshot)

    def _permute(
        self, x: torch.Tensor, pairs: Sequence[tuple[int, int]], group: Group, pg: Any, op_name: str, snapshot: bool
    ) -> Work:
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

    # -- plumbing -------------------------------------------------------------
    def _stages_permute(self, x: torch.Tensor) -> bool:
        """Whether a ppermute of ``x`` travels as a host copy: off the CPU where no NCCL carries it."""
        return x.device.type != "cpu" and "nccl" not in self.name

    def _on_gloo_cpu(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and "gloo" in self.name

    def _exchanges(self, x: torch.Tensor, group: Group, *, one_member: bool = False) -> bool:
        """Whether this collective runs as a direct exchange (gloo_exchange.py): gloo on CPU, a
        layer-sized message of a dtype gloo sums; ``one_member``: ``x`` is one member's part (an
        all-gather's input: the Plan asks of the gathered whole, ``sized_for_exchange``)."""
        return self._on_gloo_cpu(x) and exchanges(x, group, one_member=one_member)

    def _exchange_group(self, group: Group, op_name: str) -> ExchangeGroup:
        """The member set's exchanges, on a process group of their own (created at first use,
        which every member reaches at the same collective)."""
        members = tuple(sorted(group.ranks))
        known = self._exchange_groups.get(members)
        if known is not None and known.alive:
            return known
        if known is not None and known.shared is not None:
            known.shared.close()
        try:
            pg = dist.new_group(
                list(members), timeout=datetime.timedelta(seconds=self.timeout), use_local_synchronization=True
            )
        except Exception as exc:
            raise self._error(f"creating the exchange process group for {op_name}", group, exc) from exc
        error_for = lambda what, g, exc: self._error(what, g, exc)  # noqa: E731
        made = ExchangeGroup(pg, members, self.rank, self.timeout, error_for)
        try:
            made.shared = open_same_host(pg, members, members.index(self.rank), self.timeout, error_for)
        except Exception as exc:
            raise self._error(f"opening the shared-memory exchange for {op_name}", group, exc) from exc
        self._exchange_groups[members] = made
        return made

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
        known = self._groups.get(members)
        pg = None if known is None else known()
        if pg is not None:
            return pg
        if not dist.is_initialized():
            raise self._error(f"starting {op_name}", group, RuntimeError(
                "the default process group was destroyed (destroy_process_group()); collectives need it"))
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
        self._groups[members] = weakref.ref(pg)
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
                f"or issued different collectives): {exc}. {DIFFERENT_COLLECTIVES}"
            )
        if dtype is not None and any(word in str(exc).lower() for word in _DTYPE_REFUSALS):
            # gloo refuses e.g. float8 with a bare "Invalid scalar type", at issue or at wait.
            return CollectiveError(
                f"{where}: the {self.name} backend refused dtype {dtype} ({exc}). Cast the tensor "
                "to a dtype it supports (gloo: float16, bfloat16, float32, float64, integers) "
                "before the collective and back after it."
            )
        return CollectiveError(f"{where} failed: {type(exc).__name__}: {exc}")


class _MovedTo(Work):
    """A collective run on host copies, its result moved back to the caller's device at the wait."""

    def __init__(self, work: Work, device: torch.device) -> None:
        self._work, self._device = work, device
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._work.wait().to(self._device)
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()


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




def _default_group_timeout() -> float:
    """The default group's own timeout in seconds (what init_process_group was given)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # private layout changed: torch's documented default
        return float(dist.default_pg_timeout.total_seconds())




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
