"""How the sequence is cut where a context-parallel layer runs, for the attentions a user's module calls.

A module of one's own that calls :func:`ring_attention` / :func:`ulysses_attention` names the axis and
the layout itself. Under ``context_parallel`` the step cut the sequence over the transform's axis, in
its layout (balanced or not): a call naming another axis would exchange over the wrong ranks (or, over
a data axis, mix other sequences), and one in the other layout would mask the wrong positions, both
without an error. So while a context-parallel layer runs, its cut is known here and a call that
disagrees with it is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

from ...collectives import Mesh, axis_index, axis_size, current_mesh
from ...engine.stack import in_layer


class Cut(NamedTuple):
    axis: str
    balanced: bool


_cut: contextvars.ContextVar[Cut | None] = contextvars.ContextVar("shardwise_cp_cut", default=None)


@contextlib.contextmanager
def cutting(axis: str, balanced: bool) -> Iterator[None]:
    """Inside a layer whose ranks hold the parts of every sequence cut over ``axis`` (``balanced`` or not)."""
    token = _cut.set(Cut(axis, balanced))
    try:
        yield
    finally:
        _cut.reset(token)


def check_cut(op: str, axis: str, balanced: bool) -> None:
    """Refuse a call over another axis or layout than the one the running context-parallel layer cut."""
    cut = _cut.get()
    if cut is None or cut == (axis, balanced):
        return
    if cut.axis != axis:
        raise ValueError(
            f"{op}(axis={axis!r}): this layer runs under context_parallel over axis {cut.axis!r}, which cut the "
            f"sequence; attention over {axis!r} would exchange with the wrong ranks. Call it with {cut.axis!r} "
            "(or pass the axis context_parallel uses to both)"
        )
    raise ValueError(
        f"{op}(balanced={balanced!r}): context_parallel over {axis!r} cut the sequence with "
        f"balanced={cut.balanced!r}; the attention must read the parts in that layout: pass "
        f"balanced={cut.balanced!r} (or the same to both)"
    )


class Place(NamedTuple):
    """Where a call over ``axis`` runs: the axis' size and this rank's index on it, and whether no mesh binds it."""

    size: int
    at: int  # this rank's index on the axis
    one_device: bool


def place(op: str, axis: str, balanced: bool, mesh: Mesh | None) -> Place:
    """The axis a call over the sequence's parts runs on: the running cut's (:func:`check_cut`), one index
    with no mesh at all (one device), else the mesh's, which must hold it."""
    check_cut(op, axis, balanced)
    if in_layer.one_device(mesh):
        return Place(1, 0, True)
    bound = mesh if mesh is not None else current_mesh()
    if bound is not None and axis not in bound.axis_names:
        sizes = ", ".join(f"{a}={bound.axis_size(a)}" for a in bound.axis_names)
        raise ValueError(
            f"{op}(axis={axis!r}): the mesh {bound!r} has no axis {axis!r} (a misspelled name?). Under "
            f"context_parallel pass its axis; to run the model on this mesh without cutting the sequence, give the "
            f"mesh that axis with size 1: sw.Mesh({sizes}, {axis}=1)"
        )
    return Place(axis_size(axis, mesh=mesh), axis_index(axis, mesh=mesh), False)
