"""Which backend the calling rank talks through.

Each rank (a thread of the threads backend, or a process on torch.distributed)
has its own current backend in a context variable: threads do not share it,
and nothing global is mutated. Outside any launch, a program runs as a world of
one, unless torch.distributed is already initialised (torchrun), in which case
the distributed backend is created for it on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch.distributed as dist

from .base import Backend
from .distributed import TorchDistributedBackend
from .single import SingleRankBackend
from .threads import ThreadsBackend

_current: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "shardwise_backend", default=None
)


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` the current rank's backend inside the block."""
    token = _current.set(backend)
    try:
        yield backend
    finally:
        _current.reset(token)


def current_backend() -> Backend:
    """The calling rank's backend (see the module docstring for the fallbacks). The world of one a program
    ran as before it called ``init_process_group`` (a single-device reference step run first, as the guide's
    verification does) gives way to torch.distributed once it is initialised."""
    backend = _current.get()
    if backend is not None and not (backend is _FALLBACK.get() and dist.is_available() and dist.is_initialized()):
        return backend  # (inline: every step asks)
    if _distributed():
        backend = TorchDistributedBackend.from_initialized()
    else:
        backend = SingleRankBackend()
        _FALLBACK.set(backend)
    _current.set(backend)
    return backend


# The world of one current_backend fell back to in this context, if it did: replaced once torch.distributed is up.
_FALLBACK: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("shardwise_fallback", default=None)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def on_rank_thread() -> bool:
    """Whether the caller is a rank thread of the threads backend: code that other ranks run at the same
    time in this process, on the same Python objects."""
    return isinstance(_current.get(), ThreadsBackend)
