"""Point to point, for pipeline stages: ``send(x, axis, dst, tag=)`` and
``recv(axis, src, tag=)`` move one tensor between two ranks of an axis (dst and
src are indices along it), return a :class:`Handle` and are not differentiable
(a pipeline sends the gradient back itself). The receiver learns the shape and
dtype from the message; see ``Backend.send`` / ``Backend.recv`` for ordering.
"""

from __future__ import annotations

import torch

from . import ledger as _ledger
from ._functorch import unwrap
from .backends.base import check_p2p
from .handle import Handle
from .mesh import Mesh
from .validate import refuse_grad, require_tensor
from .where import Where, current_phase, resolve


# -- point to point: not differentiable ------------------------------------------------
def _peer(op: str, where: Where, index: object, name: str) -> int:
    """The global rank at axis index ``index`` of the caller's group."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{op}: {name} must be an int axis index, got {type(index).__name__} {index!r}")
    if not 0 <= index < where.size:
        raise ValueError(f"{op}: {name}={index} is outside the axis {where.axis!r} of size {where.size}")
    return where.group.ranks[index]


def _record_p2p(op: str, where: Where, t: torch.Tensor, sent_bytes: int, phase: str) -> None:
    targets = _ledger.active_ledgers() or where.ledgers
    if not targets:
        return
    entry = _ledger.CommRecord(
        op=op,
        axis=where.axis,
        rank=where.backend.rank,
        group_size=where.size,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=tuple(t.shape),
        nbytes=t.numel() * t.element_size(),
        sent_bytes=sent_bytes,
        phase=phase,
    )
    for ledger in targets:
        ledger.add(entry)


def send(
    x: torch.Tensor,
    axis: str,
    dst: int,
    *,
    tag: int = 0,
    announce: bool = True,
    snapshot: bool = True,
    bounded: bool = True,
    mesh: Mesh | None = None,
) -> Handle:
    """Send ``x`` to the rank at index ``dst`` of ``axis``; ``.wait()`` returns ``x``.

    By default the message is a snapshot taken now: ``x`` may be modified at
    once, and ``wait()`` never waits for the receiver. Messages to one rank with one
    ``tag`` (an int in ``0..MAX_TAG``) arrive in send order; tags are
    independent. ``announce=False`` leaves out the shape and dtype (one
    transfer less on torch.distributed): the receiver passes them as
    ``recv(..., like=(shape, dtype))``. ``snapshot=False`` promises that
    ``x`` stays unchanged until ``wait()`` returned and that you call
    ``wait()``: no copy is taken, the transport reads ``x`` itself, and
    ``wait()`` may block until the receiver has the message (on
    torch.distributed it does, as ``dist.isend``'s wait; post your own
    receives first). The receiver still gets a tensor of its own. Not
    differentiable. A backend holding such sends until they are waited for
    waits for the oldest itself once many (1024 on torch.distributed) are
    pending; ``bounded=False`` turns that off where the caller waits for every
    send and the peer may post a receive only after one from this rank (a
    pipeline's, whose receives are posted a few ahead of their waits).

    A tensor on a device the backend's messages cannot travel on (a CUDA
    tensor on torch.distributed, whose point-to-point goes through gloo) is
    copied to the backend's ``p2p_device`` first; the receiver puts it back
    with ``recv(..., device=)``.
    """
    x = require_tensor("send", x)
    refuse_grad("send", x, "send x.detach() (a pipeline sends the gradient back itself)")
    where = resolve("send", axis, mesh)
    peer = _peer("send", where, dst, "dst")
    _, tag = check_p2p("send", peer, tag, where.backend.world_size, "dst")
    plain = unwrap(x)
    carrier = where.backend.p2p_device
    if carrier is not None and plain.device != carrier:
        plain = plain.detach().to(carrier)  # staged (a blocking copy): the transport reads our copy
    work = where.backend.send(plain, peer, tag, announce=announce, snapshot=snapshot, bounded=bounded)
    # Like ppermute: a message to oneself moves no bytes.
    sent_bytes = 0 if dst == where.index else plain.numel() * plain.element_size()
    _record_p2p("send", where, plain, sent_bytes, current_phase())
    return Handle(work, lambda _: x)


def recv(
    axis: str,
    src: int,
    *,
    tag: int = 0,
    like: tuple[torch.Size, torch.dtype] | None = None,
    device: torch.device | str | None = None,
    mesh: Mesh | None = None,
) -> Handle:
    """Receive the next message with ``tag`` from the rank at index ``src`` of ``axis``.

    ``.wait()`` returns it with the sender's shape and dtype, or raises
    CollectiveTimeout after the backend timeout. Receives from one rank with
    one tag take the messages in the order the receives were issued. The
    ledger records the receive (sent_bytes 0) when its wait completes.
    ``like=(shape, dtype)`` receives a message sent with ``announce=False``.
    ``device`` is where the received tensor goes; by default it stays where
    the transport delivers it (the CPU on torch.distributed, the sender's
    device on threads).
    """
    target = None if device is None else torch.device(device)
    where = resolve("recv", axis, mesh)
    peer = _peer("recv", where, src, "src")
    _, tag = check_p2p("recv", peer, tag, where.backend.world_size, "src")
    work = where.backend.recv(peer, tag, like=like)
    phase = current_phase()

    def finish(received: torch.Tensor) -> torch.Tensor:
        _record_p2p("recv", where, received, 0, phase)
        return received if target is None or received.device == target else received.to(target)

    return Handle(work, finish)
