"""The current mesh: ``with mesh:`` makes a Mesh the default of every collective in the block.

>>> from shardwise.collectives import Mesh, current_mesh
>>> with Mesh(dp=2) as mesh:
...     current_mesh() == mesh
True
>>> current_mesh() is None
True

The current mesh lives in a context variable, like the current backend: each
rank thread of the threads launcher runs in a copy of its caller's context, so
``with mesh: launch(main, 4)`` and ``with mesh:`` inside ``main`` both work, and
one rank's block never leaks into another's. Blocks nest; the innermost wins.

This module installs ``__enter__``/``__exit__`` on :class:`Mesh` when it is
imported (the package ``__init__`` imports it), so the Mesh stays a frozen
value that knows nothing of contexts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import TracebackType

from .mesh import Mesh

# A stack rather than a single value: Mesh is immutable (no slot to keep a reset
# token in), and re-entering the same mesh must still unwind correctly.
_stack: contextvars.ContextVar[tuple[Mesh, ...]] = contextvars.ContextVar(
    "shardwise_mesh_stack", default=()
)
# Set inside no_mesh(): a collective that names its mesh (mesh=...) is refused there too.
_silent: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_no_collectives", default=False)


def current_mesh() -> Mesh | None:
    """The mesh of the innermost enclosing ``with mesh:`` block, or None outside any."""
    stack = _stack.get()
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``mesh`` the current mesh inside the block (same as ``with mesh:``)."""
    _push(mesh)
    try:
        yield mesh
    finally:
        _pop(mesh)


@contextlib.contextmanager
def no_mesh() -> Iterator[None]:
    """No current mesh inside the block, and no collective: one raises there instead of running,
    whether it names its mesh or not (a second evaluation of a step's code, on one rank, must not
    issue what the Plan does not list, nor wait on ranks that do not evaluate it). Reading the
    layout of a mesh given by name (``axis_size(axis, mesh=m)``, ``axis_index``) still works."""
    token, silent = _stack.set(()), _silent.set(True)
    try:
        yield
    finally:
        _silent.reset(silent)
        _stack.reset(token)


def collectives_forbidden() -> bool:
    """Whether the caller is inside :func:`no_mesh` (every collective raises there)."""
    return _silent.get()


def _push(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a shardwise Mesh, got {type(mesh).__name__}")
    _stack.set((*_stack.get(), mesh))


def _pop(mesh: Mesh) -> None:
    stack = _stack.get()
    if not stack or stack[-1] is not mesh:
        raise RuntimeError(
            f"leaving `with {mesh!r}:` but the current mesh is "
            f"{stack[-1] if stack else None!r}: mesh blocks must nest"
        )
    _stack.set(stack[:-1])


def _enter(self: Mesh) -> Mesh:
    _push(self)
    return self


def _exit(
    self: Mesh,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    _pop(self)


Mesh.__enter__ = _enter  # type: ignore[attr-defined]
Mesh.__exit__ = _exit  # type: ignore[attr-defined]
