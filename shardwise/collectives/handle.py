"""A collective in flight (:class:`Handle`) and :func:`issue`, the one path by which every
collective, sync or async, starts on its backend and is recorded in the ledger."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import ledger as _ledger
from ._functorch import unwrap
from .backends.base import Backend, Group, Work
from .where import Pairs, Where, current_phase


class Handle:
    """An in-flight collective: ``wait()`` blocks until it is done and returns the result."""

    __slots__ = ("_finish", "_result", "_work")

    def __init__(self, work: Work, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish(self._work.wait())
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()


def issue(
    op: str,
    where: Where,
    x: torch.Tensor,
    send: Callable[[Backend, torch.Tensor, Group, bool], Work],
    finish: Callable[[torch.Tensor], torch.Tensor] = lambda r: r,
    *,
    snapshot: bool,
    layout: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    root: int | None = None,
    pairs: Pairs | None = None,
) -> Handle:
    """Send ``layout(x)`` through ``send``, record ``x`` in the ledger, return the handle.

    ``send(backend, tensor, group, snapshot)`` starts the backend primitive.
    ``snapshot=False`` promises the backend that ``x`` stays unchanged until the
    handle is waited on (the sync forms, which wait at once); the async forms
    pass True, since their caller may reuse ``x`` at once. When the layout made
    a new tensor anyway, nobody else can touch it, so no snapshot is needed.
    """
    x = unwrap(x)
    t = layout(x).contiguous()
    if snapshot and not _shares_storage(t, x):
        snapshot = False
    work = send(where.backend, t, where.group, snapshot)
    _ledger.record(
        op,
        axis=where.axis,
        rank=where.backend.rank,
        index=where.index,
        group_size=where.size,
        tensor=x,
        phase=current_phase(),
        root=root,
        pairs=pairs,
        ledgers=_ledger.active_ledgers() or where.ledgers,
    )
    return Handle(work, finish)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return True  # nothing to copy either way; be conservative
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
