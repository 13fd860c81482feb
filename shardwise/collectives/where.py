"""Where a collective runs (its axis, the caller's backend and group, the ledgers to record in)
and in which phase (forward, or the backward of another collective).

Both are resolved once, when a collective is issued in forward, and kept for
its backward: autograd may run backward on a thread that sees none of the
caller's context variables.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from . import ledger as _ledger
from .backends.base import Backend, Group
from .mesh import Mesh
from .mesh_context import collectives_forbidden, current_mesh

Pairs = tuple[tuple[int, int], ...]

_phase: contextvars.ContextVar[str] = contextvars.ContextVar("shardwise_comm_phase", default="forward")


def current_phase() -> str:
    """"backward" while a collective's autograd backward issues collectives, else "forward"."""
    return _phase.get()


@contextlib.contextmanager
def in_backward() -> Iterator[None]:
    token = _phase.set("backward")
    try:
        yield
    finally:
        _phase.reset(token)


@dataclass(frozen=True)
class Where:
    """Where a collective runs. Resolved once in forward and kept for its backward."""

    axis: str
    backend: Backend
    group: Group
    # Autograd may run backward on a device thread that sees none of the
    # caller's context variables; the forward's ledgers are the fallback then.
    ledgers: tuple[_ledger.Ledger, ...]

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index(self.backend.rank)


def resolve(op: str, axis: str, mesh: Mesh | None) -> Where:
    if op != "axis_index" and collectives_forbidden():
        raise RuntimeError(
            f"{op}(axis={axis!r}) inside no_mesh(): no collective runs in this block (a second evaluation of "
            "a step's code on one rank, which the other ranks do not join)"
        )
    if mesh is None:
        mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(f"{op}(axis={axis!r}) needs a mesh: call it inside `with mesh:` or pass mesh=")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{op}(mesh=...) expects a shardwise Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str):  # jax.lax takes a tuple of axes; these collectives run over one
        raise TypeError(
            f"{op}(axis={axis!r}): one mesh axis, by name (a str; {mesh!r} has axes {mesh.axis_names}); "
            "over several axes, call it once per axis"
        )
    if axis not in mesh.axis_names:
        raise ValueError(f"{op}: unknown mesh axis {axis!r}; {mesh!r} has axes {mesh.axis_names}")
    backend = mesh.backend
    return Where(axis, backend, _group(axis, mesh.group_ranks(axis, backend.rank)), _ledger.active_ledgers())


@functools.lru_cache(maxsize=4096)  # every collective resolves its group; Group is a frozen value
def _group(axis: str, ranks: tuple[int, ...]) -> Group:
    return Group(axis, ranks)
