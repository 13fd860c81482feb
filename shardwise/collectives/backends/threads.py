"""The threads backend: every rank is a thread of one process.

It exists for verification. Ranks meet at a rendezvous per (group, call
number); the last rank to arrive computes the result for everyone, reducing in
rank order, so results are bitwise identical from run to run whatever the
thread timing. A rank that fails aborts the world: every rank waiting in a
collective stops at once with :class:`RankAborted` instead of hanging, and a
rank that never arrives makes the others fail with :class:`CollectiveTimeout`.

Point-to-point messages go through a :class:`~.mailbox.Mailbox` per world, keyed by
(src, dst, tag) and guarded by the world's condition: ``send`` deposits a
detached clone and completes at once, ``recv`` waits for its message (or the
timeout, or an aborted world).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import DIFFERENT_COLLECTIVES, CollectiveError, CollectiveTimeout, RankAborted
from ._dispatch import outside_dispatch_modes
from .base import (
    Backend,
    CheckedWork,
    CompletedWork,
    Group,
    Layout,
    Work,
    check_p2p,
)
from .blocking import blocking, polled
from .mailbox import Mailbox, MailKey


class Payload(NamedTuple):
    """One rank's contribution to a collective."""

    tensor: torch.Tensor
    arg: object  # op-specific argument (the root, the pairs)
    owned: bool  # ``tensor`` is the backend's private snapshot, free to hand out as a result


Compute = Callable[[list[Payload]], list[torch.Tensor]]


@dataclass
class _Rendezvous:
    op_name: str
    group: Group
    slots: list[Payload | None]
    compute: Compute
    results: list[torch.Tensor] | None = None
    error: BaseException | None = None
    taken: int = 0
    arrived_ranks: list[int] = field(default_factory=list)


class ThreadsWorld:
    """State shared by the ranks of one threads launch."""

    def __init__(self, world_size: int, timeout: float) -> None:
        if world_size <= 0:
            raise ValueError(f"world size must be positive, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._pending: dict[tuple[tuple[int, ...], int], _Rendezvous] = {}
        self._calls: dict[tuple[int, tuple[int, ...]], int] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.cancelled: str | None = None  # why the launcher stopped the world, if it did
        self.returned: set[int] = set()  # ranks whose function returned while others run: they join no collective
        self.mailbox = Mailbox(self._cond)

    def abort(self, rank: int, error: BaseException) -> None:
        """Record that ``rank`` failed and wake every waiting rank."""
        with self._cond:
            if self.failure is None:
                self.failure = (rank, error)
            self._cond.notify_all()

    def rank_returned(self, rank: int) -> None:
        """Record that ``rank``'s function returned and wake every waiting rank: one waiting for it in a
        collective or a receive fails at once, naming it, instead of at the timeout."""
        with self._cond:
            self.returned.add(rank)
            self._cond.notify_all()

    def launch_ended(self) -> None:
        """Forget which ranks returned: every rank of the launch has ended (see thread_ranks.run_on_threads)."""
        with self._cond:
            self.returned.clear()

    def _refuse_returned(self, rank: int, where: str, gone: list[int]) -> None:
        if gone:
            raise CollectiveError(
                f"{where} on rank {rank}: ranks {gone} returned from their function without joining it, so it "
                "never completes: it was called on some ranks only (a call that runs collectives, such as "
                "sw.checkpoint.save, step.init or a step, under `if rank == 0:`); every rank must call it"
            )

    def cancel(self, reason: str) -> None:
        """Stop every rank waiting in (or later issuing) a collective, as ``abort`` does, for ``reason``."""
        with self._cond:
            self.cancelled = self.cancelled or reason
            self._cond.notify_all()

    def arrive(
        self, rank: int, group: Group, op_name: str, payload: Payload, compute: Compute
    ) -> _ThreadWork:
        """Deposit ``rank``'s contribution to its next collective on ``group``."""
        index = group.index(rank)
        with self._cond:
            self._raise_if_aborted(rank, op_name, group)
            call_key = (rank, group.ranks)
            seq = self._calls.get(call_key, 0)
            self._calls[call_key] = seq + 1
            key = (group.ranks, seq)
            rdv = self._pending.get(key)
            if rdv is None:
                rdv = _Rendezvous(op_name, group, [None] * group.size, compute)
                self._pending[key] = rdv
            elif rdv.op_name != op_name:
                error = CollectiveError(
                    f"collective mismatch on axis {group.axis!r} (call #{seq} of group {group.ranks}): "
                    f"rank {rank} called {op_name} but rank {rdv.arrived_ranks[0]} called {rdv.op_name}. "
                    f"{DIFFERENT_COLLECTIVES}"
                )
                rdv.error = error
                self._cond.notify_all()
                raise error
            rdv.slots[index] = payload
            rdv.arrived_ranks.append(rank)
            if len(rdv.arrived_ranks) == group.size:
                try:
                    # Outside this thread's dispatch modes: the arithmetic is every rank's, not this one's.
                    with outside_dispatch_modes():
                        rdv.results = rdv.compute([s for s in rdv.slots if s is not None])
                except BaseException as exc:  # shape mismatch and such: every rank sees it
                    rdv.error = exc
                self._cond.notify_all()
            return _ThreadWork(self, rank, key, rdv, index)

    def _raise_if_aborted(self, rank: int, op_name: str, group: Group) -> None:
        self._raise_if_aborted_in(rank, f"{op_name} on axis {group.axis!r}")

    def _raise_if_aborted_in(self, rank: int, where: str) -> None:
        if self.cancelled is not None:
            raise RankAborted(f"rank {rank} stopped in {where}: {self.cancelled}")
        if self.failure is not None:
            failed, error = self.failure
            raise RankAborted(
                f"rank {rank} stopped in {where} because rank {failed} "
                f"failed with {type(error).__name__}: {error}"
            )

    # -- point to point ------------------------------------------------------------
    def send(self, rank: int, x: torch.Tensor, dst: int, tag: int) -> None:
        """Deposit a detached clone of ``x`` for ``dst``."""
        with self._cond:
            self._raise_if_aborted_in(rank, f"send to rank {dst} (tag {tag})")
            self.mailbox.put((rank, dst, tag), x.detach().clone())

    def recv(self, rank: int, src: int, tag: int) -> _ThreadRecvWork:
        with self._cond:
            self._raise_if_aborted_in(rank, f"recv from rank {src} (tag {tag})")
            key = (src, rank, tag)
            return _ThreadRecvWork(self, key, self.mailbox.claim(key))

    def take(self, work: _ThreadRecvWork) -> torch.Tensor:
        src, rank, tag = work.key
        where = f"recv from rank {src} (tag {tag})"

        def on_timeout() -> CollectiveTimeout:
            return CollectiveTimeout(
                f"{where} timed out after {self.timeout:g} s on rank {rank}: rank {src} never sent "
                f"message #{work.seq} with tag {tag} (it failed, returned early, or sent with another tag)"
            )

        def check() -> None:
            self._raise_if_aborted_in(rank, where)
            self._refuse_returned(rank, f"{where}, message #{work.seq},", [src] if src in self.returned else [])

        return self.mailbox.take(work.key, work.seq, self.timeout, on_timeout, check)

    def wait(self, work: _ThreadWork) -> torch.Tensor:
        rdv = work.rendezvous
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while rdv.results is None and rdv.error is None:
                self._raise_if_aborted(work.rank, rdv.op_name, rdv.group)
                self._refuse_returned(work.rank, f"{rdv.op_name} on axis {rdv.group.axis!r}", [
                    r for r in rdv.group.ranks if r in self.returned and r not in rdv.arrived_ranks])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in rdv.group.ranks if r not in rdv.arrived_ranks]
                    raise CollectiveTimeout(
                        f"{rdv.op_name} on axis {rdv.group.axis!r} timed out after {self.timeout:g} s "
                        f"on rank {work.rank}: ranks {missing} of group {rdv.group.ranks} never arrived"
                    )
                self._cond.wait(remaining)
            if rdv.error is not None:
                if isinstance(rdv.error, CollectiveError):
                    raise rdv.error
                raise CollectiveError(
                    f"{rdv.op_name} on axis {rdv.group.axis!r} failed: {rdv.error}"
                ) from rdv.error
            assert rdv.results is not None
            result = rdv.results[work.index]
            rdv.taken += 1
            if rdv.taken == rdv.group.size:
                del self._pending[work.key]
            return result


class _ThreadWork(Work):
    def __init__(
        self, world: ThreadsWorld, rank: int, key: tuple[tuple[int, ...], int], rdv: _Rendezvous, index: int
    ) -> None:
        self.world, self.rank, self.key, self.rendezvous, self.index = world, rank, key, rdv, index
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            rdv = self.rendezvous
            # The last rank to arrive computed every result (or the error) as it arrived: its wait takes
            # them without blocking, so nothing is lent around it (the engine's random streams lend torch's
            # generators around a blocking wait: saving and restoring numpy's state costs 0.1 ms, a third
            # of a small tensor-parallel step's Python).
            done = rdv.results is not None or rdv.error is not None
            with contextlib.nullcontext() if done else blocking():
                self._result = self.world.wait(self)
        return self._result

    def is_completed(self) -> bool:
        polled()
        return self._result is not None or self.rendezvous.results is not None


class _ThreadRecvWork(Work):
    def __init__(self, world: ThreadsWorld, key: MailKey, seq: int) -> None:
        self.world, self.key, self.seq = world, key, seq
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            sent = self.world.mailbox.has(self.key, self.seq)  # taken without blocking: nothing lent
            with contextlib.nullcontext() if sent else blocking():
                self._result = self.world.take(self)
        return self._result

    def is_completed(self) -> bool:
        polled()
        return self._result is not None or self.world.mailbox.has(self.key, self.seq)


def _check_same(payloads: list[Payload], op_name: str) -> None:
    first = payloads[0][0]
    for i, t in enumerate(p.tensor for p in payloads):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise CollectiveError(
                f"{op_name}: group index {i} passed {tuple(t.shape)} {t.dtype} but index 0 passed "
                f"{tuple(first.shape)} {first.dtype}; every rank must pass the same shape and dtype (ranks in "
                "different calls pass different tensors: a call that runs collectives, such as sw.checkpoint.save "
                "or a step, made on some ranks only, under `if rank == 0:`)"
            )


def _sum_in_order(tensors: Sequence[torch.Tensor], into_first: bool = False) -> torch.Tensor:
    # Left to right in rank order: the same rounding on every run. With
    # ``into_first`` the first tensor (a private snapshot) is the accumulator.
    total = tensors[0] if into_first else tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def _one_each(result: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``result`` (fresh, referenced by nobody else) for the first rank, a copy for each other one.

    Ranks may mutate what they get, so no two of them share storage.
    """
    return [result, *(result.clone() for _ in range(n - 1))]


class ThreadsBackend(Backend):
    """One rank's handle on a :class:`ThreadsWorld`."""

    name = "threads"

    def __init__(self, world: ThreadsWorld, rank: int) -> None:
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank} is outside the world of {world.world_size}")
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout = world.timeout

    def _run(
        self, group: Group, op_name: str, x: torch.Tensor, arg: object, compute: Compute, snapshot: bool = True
    ) -> Work:
        if group.size > 1 and isinstance(threading.current_thread(), threading._DummyThread):
            raise CollectiveError(
                f"{op_name} on axis {group.axis!r}: thread rank {self.rank} issued it from a thread Python did "
                f"not start (a tensor on {x.device}). On an accelerator, torch's autograd runs the backward of "
                "every thread rank's tensors on one thread per device, where the ranks would wait for each "
                "other's collectives forever. Run ranks whose backward communicates as processes "
                "(launch(..., backend='processes'): gloo, or NCCL with a device per rank), or on the CPU"
            )
        # Snapshot by default: the caller may reuse or modify x before the others arrive.
        # Without one, the caller promises to leave x alone until wait (all results exist
        # before any wait returns), and compute must never hand x out as a result.
        payload = Payload(x.detach().clone(), arg, owned=True) if snapshot else Payload(x.detach(), arg, owned=False)
        return self.world.arrive(self.rank, group, op_name, payload, compute)

    def all_reduce(
        self, x: torch.Tensor, group: Group, op_name: str = "psum", *, snapshot: bool = True
    ) -> Work:
        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            return _one_each(_sum_in_order([p.tensor for p in ps], into_first=ps[0].owned), len(ps))

        return self._run(group, op_name, x, None, compute, snapshot)

    def all_gather(
        self, x: torch.Tensor, group: Group, op_name: str = "all_gather", *, snapshot: bool = True
    ) -> Work:
        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            return _one_each(torch.stack([p.tensor for p in ps]), len(ps))

        return self._run(group, op_name, x, None, compute, snapshot)

    def reduce_scatter(
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True,
        donate: bool = False,
    ) -> Work:
        if x.dim() == 0 or x.shape[0] != group.size:
            raise ValueError(
                f"{op_name}: backend input must have shape (group size {group.size}, ...), got {tuple(x.shape)}"
            )

        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            # A fresh sum per rank (never a view into a shared snapshot).
            return [_sum_in_order([p.tensor[i] for p in ps]) for i in range(len(ps))]

        return self._run(group, op_name, x, None, compute, snapshot)

    def all_to_all(
        self, x: torch.Tensor, group: Group, op_name: str = "all_to_all", *, snapshot: bool = True
    ) -> Work:
        if x.dim() == 0 or x.shape[0] != group.size:
            raise ValueError(
                f"{op_name}: backend input must have shape (group size {group.size}, ...), got {tuple(x.shape)}"
            )

        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            return [torch.stack([p.tensor[i] for p in ps]) for i in range(len(ps))]

        return self._run(group, op_name, x, None, compute, snapshot)

    def broadcast(
        self, x: torch.Tensor, root: int, group: Group, op_name: str = "broadcast", *, snapshot: bool = True
    ) -> Work:
        if not 0 <= root < group.size:
            raise ValueError(f"{op_name}: root {root} is outside the group of size {group.size}")

        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            roots = {p.arg for p in ps}
            if len(roots) != 1:
                raise CollectiveError(f"{op_name}: ranks disagree on the root: {sorted(roots)}")  # type: ignore[type-var]
            value = ps[root]
            if not value.owned:  # the root's own tensor: never a result
                return [value.tensor.clone() for _ in ps]
            # The root's snapshot goes back to the root itself, a copy to everyone else.
            return [value.tensor if i == root else value.tensor.clone() for i in range(len(ps))]

        return self._run(group, op_name, x, root, compute, snapshot)

    def permute(
        self,
        x: torch.Tensor,
        pairs: Sequence[tuple[int, int]],
        group: Group,
        op_name: str = "ppermute",
        *,
        snapshot: bool = True,
    ) -> Work:
        pairs = tuple((int(s), int(d)) for s, d in pairs)

        def compute(ps: list[Payload]) -> list[torch.Tensor]:
            _check_same(ps, op_name)
            if len({p.arg for p in ps}) != 1:
                raise CollectiveError(f"{op_name}: ranks passed different permutations")
            out: list[torch.Tensor | None] = [None] * len(ps)
            handed_out: set[int] = set()
            for src, dst in pairs:
                sent = ps[src]
                if sent.owned and src not in handed_out:  # a snapshot goes to one receiver as is
                    handed_out.add(src)
                    out[dst] = sent.tensor
                else:
                    out[dst] = sent.tensor.clone()
            return [t if t is not None else torch.zeros_like(p.tensor) for t, p in zip(out, ps, strict=True)]

        return self._run(group, op_name, x, pairs, compute, snapshot)

    def send(
        self, x: torch.Tensor, dst: int, tag: int, *, announce: bool = True, snapshot: bool = True,
        bounded: bool = True,
    ) -> Work:
        # In one process a message is the tensor itself: announced or not, nothing more travels.
        # World.send copies it either way: the receiver gets a tensor of its own.
        dst, tag = check_p2p("send", dst, tag, self.world_size, "dst")
        self.world.send(self.rank, x, dst, tag)
        return CompletedWork(x)

    def recv(self, src: int, tag: int, *, like: Layout | None = None) -> Work:
        src, tag = check_p2p("recv", src, tag, self.world_size, "src")
        return CheckedWork(self.world.recv(self.rank, src, tag), like, src, tag)
