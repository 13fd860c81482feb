"""The contract every communication backend fulfils.

A backend moves plain tensors between the ranks of a *group* (the global ranks
of one mesh axis slice, in axis order). It knows nothing of autograd, meshes or
the ledger: the differentiable collectives in ``collectives/ops.py`` sit on top of it, so a
new backend only has to implement these few primitives.

Every primitive is asynchronous: it returns a :class:`Work` whose ``wait()``
gives the result. The synchronous collectives simply wait at once; executors
that overlap communication with compute keep the handle.

Shape conventions (``n`` is the group size, ``i`` the caller's index in it):

* ``all_reduce(x)``        -> sum over ranks of ``x``, same shape.
* ``all_gather(x)``        -> ``stack([x_0, ..., x_{n-1}])``, shape ``(n, *x.shape)``.
* ``all_gather_into(xs, rows)`` -> the same values written where the caller says: member ``j``'s
  input, the 1-D pieces ``xs`` end to end, into ``rows[j]``, 1-D pieces that follow each other;
  ``wait()`` returns an empty tensor (the values are in the rows).
* ``reduce_scatter(x)``    -> ``x`` has shape ``(n, *rest)``; result is
  ``sum_j x_j[i]``, shape ``rest``.
* ``reduce_scatter_rows(rows, dtype)`` -> ``reduce_scatter`` of the ``(n, m)`` buffer whose row
  ``j`` is ``rows[j]``'s 1-D pieces end to end, converted to ``dtype``; the pieces are read until
  the wait.
* ``all_to_all(x)``        -> ``x`` has shape ``(n, *rest)``; result ``out[j] = x_j[i]``.
* ``broadcast(x, root)``   -> the value of ``x`` on group index ``root``.
* ``permute(x, pairs)``    -> ``pairs`` are ``(src, dst)`` group indices; the
  caller receives ``x_src`` from the pair whose ``dst == i``, zeros if none.

Point to point (for pipeline stages; no group, peers are GLOBAL ranks):

* ``send(x, dst, tag)``    -> deposits a snapshot of ``x`` for rank ``dst``; ``wait()``
  returns ``x`` (the caller may reuse or modify it at once; it never blocks on the
  receiver). With ``snapshot=False`` the backend may read ``x`` itself until
  ``wait()`` returns, and ``wait()`` may then wait for the receiver.
* ``recv(src, tag)``       -> ``wait()`` returns the next message from ``src`` with
  ``tag``, with the sender's shape and dtype (the receiver need not know them).

Messages between the same (src, dst) with the same tag arrive in send order and
are matched to receives in the order the receives were *issued* (not waited).
Different tags are independent. A rank may send to itself. Tags are ints in
``0..MAX_TAG``.

Sums are taken in the tensor's own dtype. Results are new tensors: a backend
never writes into its input, and a result never shares storage with the input
nor with another rank's result (so every rank, and the caller, may mutate what
it holds).

Snapshots. Every collective primitive takes a keyword ``snapshot`` (default
True). With ``snapshot=True`` the backend copies ``x`` (or otherwise makes sure
it has read it) before returning, so the caller may modify ``x`` at once, while
the collective is still in flight. ``snapshot=False`` is the caller's promise
that ``x`` stays unchanged (and alive) until ``wait()`` returned: the backend
may then read ``x`` itself while the collective runs instead of copying it
first, which saves a message-sized allocation and copy. The synchronous
collectives (which wait at once) pass False; the async ones keep True. Either
way the result is a new tensor that does not alias ``x``.

``all_gather_into`` is the exception: it writes into the caller's ``rows`` (which must not overlap
the input, but for the caller's own row, which may be the input's values where they lie: a part
already there is not copied) and reads its input and its own row until ``wait()``
(``snapshot=False`` always). Every backend has it: by default an ``all_gather`` of the input
(joined first when it is several pieces) whose result is copied into the rows at the wait; a
transport that copies what it sends and receives anyway (shared memory) sends from the caller's
own row and copies what it receives into the rows instead.

``reduce_scatter_rows`` reads its pieces until ``wait()`` as well. Every backend has it: by default
they are concatenated into the buffer (one copy), which ``reduce_scatter`` then takes donated; a
transport that copies its input anyway (shared memory) copies each piece where it goes instead.
The result is the same bit for bit.

``reduce_scatter`` also takes ``donate`` (default False): True hands ``x`` over (with
``snapshot=False``), so a backend that reduces in place may do it in ``x`` itself instead of a
copy of it (gloo's, an all-reduce); ``x``'s values are undefined afterwards. The others ignore it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CollectiveError


@dataclass(frozen=True)
class Group:
    """The global ranks that take part in one collective, in mesh-axis order."""

    axis: str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"Group for axis {self.axis!r} has no ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"Group for axis {self.axis!r} repeats a rank: {self.ranks}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """Position of global ``rank`` in this group."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in the group of axis {self.axis!r} {self.ranks}") from None


MAX_TAG = 2**30 - 2
"""Largest point-to-point tag (gloo takes non-negative int32 tags, and each message uses two)."""


def check_p2p(op_name: str, peer: int, tag: int, world_size: int, peer_name: str) -> tuple[int, int]:
    """Validate a send/recv peer (a global rank) and tag; return them as ints."""
    for what, value in ((peer_name, peer), ("tag", tag)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op_name}: {what} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= peer < world_size:
        raise ValueError(f"{op_name}: {peer_name}={peer} is outside the world of {world_size} ranks")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{op_name}: tag={tag} must be in 0..{MAX_TAG}")
    return int(peer), int(tag)


Layout = tuple[torch.Size, torch.dtype]
"""The shape and dtype of a message, when the receiver knows them in advance."""


def check_layout(received: torch.Tensor, like: Layout | None, src: int, tag: int) -> torch.Tensor:
    """Refuse a received tensor whose shape or dtype differs from the layout the receiver expected."""
    if like is not None and (tuple(received.shape) != tuple(like[0]) or received.dtype != like[1]):
        raise CollectiveError(
            f"recv from rank {src} (tag {tag}): expected {tuple(like[0])} {like[1]}, got "
            f"{tuple(received.shape)} {received.dtype}; sender and receiver disagree on the message layout"
        )
    return received


class Work(abc.ABC):
    """Handle of an asynchronous collective; ``wait()`` returns its result."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the collective finished (or raise CollectiveError) and return the result."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True when ``wait()`` would not block."""


class CheckedWork(Work):
    """A receive whose result must have the layout the receiver passed (``like``), if any."""

    def __init__(self, work: Work, like: Layout | None, src: int, tag: int) -> None:
        self._work, self._like, self._src, self._tag = work, like, src, tag

    def wait(self) -> torch.Tensor:
        return check_layout(self._work.wait(), self._like, self._src, self._tag)

    def is_completed(self) -> bool:
        return self._work.is_completed()


Rows = Sequence[Sequence[torch.Tensor]]
"""Where an all-gather's rows go: ``rows[j]``, 1-D contiguous pieces of the input's dtype whose
numels add up to the input's, takes group member ``j``'s input in order."""


def copy_pieces(source: Sequence[torch.Tensor], into: Sequence[torch.Tensor]) -> None:
    """Copy the elements of ``source`` (1-D pieces end to end) into ``into`` (as many elements, 1-D
    pieces end to end), leaving any part that already lies where it goes as it is."""
    if len(source) == 1:  # a gathered row: its views made at once (a walk slices both sides per piece, 3x the time)
        for part, d in zip(source[0].split([d.numel() for d in into]), into, strict=True):
            if part.data_ptr() != d.data_ptr():
                d.copy_(part)
        return
    i = j = a = b = 0  # the pieces walked, and the elements of each already covered
    while i < len(source) and j < len(into):
        s, d = source[i], into[j]
        n = min(s.numel() - a, d.numel() - b)
        if n and s.data_ptr() + a * s.element_size() != d.data_ptr() + b * d.element_size():
            d[b: b + n].copy_(s[a: a + n])
        a, b = a + n, b + n
        if a == s.numel():
            i, a = i + 1, 0
        if b == d.numel():
            j, b = j + 1, 0
    left = sum(t.numel() for t in source[i:]) - a, sum(t.numel() for t in into[j:]) - b
    if left != (0, 0):  # (a source of another length: elements left uncopied, or pieces left unwritten)
        raise ValueError(
            f"copy_pieces: the source's pieces hold {sum(t.numel() for t in source)} elements, the pieces to fill "
            f"{sum(t.numel() for t in into)}; they must hold as many"
        )


def write_rows(gathered: torch.Tensor, rows: Rows, own: int | None = None,
               source: Sequence[torch.Tensor] = ()) -> None:
    """Copy each row of ``gathered`` ((n, numel)) into its pieces, and row ``own``'s from ``source``
    (this member's input, whose values it is); a piece that already holds those values where they
    lie (in ``gathered`` itself, or in ``source``) is left as it is."""
    for j, (got, pieces) in enumerate(zip(gathered.view(len(rows), -1), rows, strict=True)):
        copy_pieces(source if j == own else [got], pieces)


def pieces_within(pieces: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """The parts of ``pieces`` (laid end to end) that hold elements ``[lo, hi)``, in order."""
    out, at = [], 0
    for piece in pieces:
        n = piece.numel()
        a, b = max(lo - at, 0), min(hi - at, n)
        if a < b:
            out.append(piece[a:b])
        at += n
        if at >= hi:
            break
    return out


class _IntoRows(Work):
    """An all-gather whose result is copied into the caller's rows at the wait."""

    def __init__(self, work: Work, rows: Rows, own: int, source: Sequence[torch.Tensor]) -> None:
        self._work: Work | None = work
        self._rows: Rows | None = rows
        self._own, self._source = own, source
        self._empty = source[0].new_empty(0)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            assert self._rows is not None
            write_rows(self._work.wait(), self._rows, self._own, self._source)
            self._work = self._rows = None  # the gathered buffer goes now
            self._source = ()
        return self._empty

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class CompletedWork(Work):
    """A Work whose result is already known (world of one, or computed eagerly)."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result

    def is_completed(self) -> bool:
        return True


class Backend(abc.ABC):
    """One rank's handle on a communication world.

    ``rank`` and ``world_size`` are global. ``timeout`` (seconds) bounds every
    wait, so a dead or diverged peer turns into a :class:`CollectiveTimeout`
    instead of a hang.
    """

    name: str
    rank: int
    world_size: int
    timeout: float

    @property
    def device(self) -> torch.device:
        """Device on which this backend expects tensors (cpu for threads and gloo)."""
        return torch.device("cpu")

    @property
    def p2p_device(self) -> torch.device | None:
        """The device point-to-point messages travel on; ``None`` (here): any, a message is
        handed over where it is. ``collectives.send`` stages other tensors through it."""
        return None

    @abc.abstractmethod
    def all_reduce(
        self, x: torch.Tensor, group: Group, op_name: str = "psum", *, snapshot: bool = True
    ) -> Work: ...

    @abc.abstractmethod
    def all_gather(
        self, x: torch.Tensor, group: Group, op_name: str = "all_gather", *, snapshot: bool = True
    ) -> Work: ...

    def all_gather_into(
        self, xs: Sequence[torch.Tensor], rows: Rows, group: Group, op_name: str = "all_gather"
    ) -> Work:
        """The all-gather of ``xs`` (1-D pieces end to end) written into ``rows`` (see the module's
        docstring); ``xs`` is read until the wait. Here: ``xs`` joined (a copy, where it is several
        pieces), gathered into a buffer, then copied into the rows."""
        x = xs[0] if len(xs) == 1 else torch.cat(list(xs))
        work = self.all_gather(x, group, op_name, snapshot=False)
        return _IntoRows(work, rows, group.index(self.rank), xs)

    @abc.abstractmethod
    def reduce_scatter(
        self, x: torch.Tensor, group: Group, op_name: str = "psum_scatter", *, snapshot: bool = True,
        donate: bool = False,
    ) -> Work: ...

    def reduce_scatter_rows(self, rows: Rows, dtype: torch.dtype, group: Group, op_name: str = "psum_scatter") -> Work:
        """``reduce_scatter`` of the (n, m) buffer whose row ``j`` is ``rows[j]``'s 1-D pieces end to
        end, in ``dtype``; the pieces are read until the wait. Here: concatenated into that buffer
        (one copy), which the reduce-scatter then takes as its own."""
        pieces = [piece for row in rows for piece in row]
        # Converted as it is concatenated: no buffer in the pieces' dtype beside the one in ``dtype``.
        flat = torch.cat(pieces, out=torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device))
        return self.reduce_scatter(flat.view(group.size, -1), group, op_name, snapshot=False, donate=True)

    @abc.abstractmethod
    def all_to_all(
        self, x: torch.Tensor, group: Group, op_name: str = "all_to_all", *, snapshot: bool = True
    ) -> Work: ...

    @abc.abstractmethod
    def broadcast(
        self, x: torch.Tensor, root: int, group: Group, op_name: str = "broadcast", *, snapshot: bool = True
    ) -> Work: ...

    @abc.abstractmethod
    def permute(
        self,
        x: torch.Tensor,
        pairs: Sequence[tuple[int, int]],
        group: Group,
        op_name: str = "ppermute",
        *,
        snapshot: bool = True,
    ) -> Work: ...

    @abc.abstractmethod
    def send(
        self, x: torch.Tensor, dst: int, tag: int, *, announce: bool = True, snapshot: bool = True,
        bounded: bool = True,
    ) -> Work:
        """Send ``x`` to global rank ``dst`` with ``tag``; ``wait()`` returns ``x``.

        The backend snapshots ``x`` (or waits until it is safe to reuse) before
        ``wait()`` returns, so the caller may then modify it. ``wait()`` never
        waits for the receiver. Messages to one ``dst`` with one ``tag`` arrive in
        send order. ``announce=False`` sends no shape and dtype with the data:
        the receiver must pass them (``recv(..., like=...)``); one tag must not
        mix announced and unannounced messages. ``snapshot=False`` is the
        caller's promise that ``x`` stays unchanged until ``wait()`` returned, as
        for the collectives, and that it calls ``wait()``: a backend may then read
        ``x`` itself instead of copying it first, and its ``wait()`` may wait
        until the receiver has the message (so issue your own receives before
        waiting on such a send). The receiver always gets a tensor of its own.
        ``bounded=False`` (with ``snapshot=False``): the backend never waits for
        an older send itself to bound how many are pending, which could wait for a
        receive the peer posts only after one from this rank; the caller waits for
        every send.
        """

    @abc.abstractmethod
    def recv(self, src: int, tag: int, *, like: Layout | None = None) -> Work:
        """Receive the next message sent by global rank ``src`` with ``tag``.

        ``like=(shape, dtype)`` receives an unannounced message of that layout
        (one message less per send where the transport needs a header); a
        message of another layout is an error where the backend can tell.
        ``wait()`` returns a new tensor with the sender's shape and dtype. Receives
        from one ``src`` with one ``tag`` take the messages in the order the
        receives were issued; a receive for one tag never takes a message sent
        with another. ``wait()`` raises :class:`CollectiveTimeout` (naming "recv",
        the peer, the tag, this rank and the timeout) when nothing arrives in
        time, and :class:`RankAborted` when the world learns that a rank failed.
        ``is_completed()`` may stay False until ``wait()`` where the transport
        cannot tell without blocking (gloo).
        """

    def barrier(self, group: Group) -> None:
        """Wait until every rank of ``group`` arrives."""
        self.all_reduce(torch.zeros(1, device=self.device), group, op_name="barrier", snapshot=False).wait()

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have nothing to release
        """Release resources held by this rank's handle."""
