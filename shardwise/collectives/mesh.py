"""Mesh: named axes over the ranks of a world, row-major.

A Mesh is pure layout (a frozen value): it can be built anywhere, printed,
compared and passed to ``step.plan(mesh)`` without any rank running. Only the
rank-dependent properties (``rank``, ``coords``, ``group``) look up the calling
rank's backend, and check that the world matches the mesh.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Iterator, Mapping

from .backends.base import Backend, Group
from .backends.current import current_backend


class Mesh:
    """Named mesh axes over ``prod(sizes)`` ranks, numbered row-major (last axis fastest).

    >>> mesh = Mesh(dp=2, pp=2)
    >>> mesh.size, mesh.axis_names
    (4, ('dp', 'pp'))
    >>> mesh.coords_of(3)
    {'dp': 1, 'pp': 1}
    >>> mesh.group_ranks("dp", rank=1)
    (1, 3)
    """

    __slots__ = ("_shape",)
    _shape: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | None = None, /, **sizes: int) -> None:
        merged = dict(axes or {})
        for name in sizes:
            if name in merged:
                raise ValueError(f"Mesh axis {name!r} is given twice")
        merged.update(sizes)
        if not merged:
            raise ValueError("Mesh needs at least one axis, for example Mesh(dp=2)")
        for name, size in merged.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"Mesh axis name {name!r} must be an identifier such as 'dp'")
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"Mesh axis {name!r} has size {size!r}; sizes must be ints")
            if size <= 0:
                raise ValueError(f"Mesh axis {name!r} has size {size}; sizes must be positive")
        object.__setattr__(self, "_shape", tuple(merged.items()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mesh is immutable")

    # -- layout ---------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(self._shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._shape)

    @property
    def size(self) -> int:
        """Number of ranks the mesh spans."""
        return math.prod(size for _, size in self._shape)

    def axis_size(self, axis: str) -> int:
        return self._shape[self._axis_position(axis)][1]

    def coords_of(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on every axis."""
        self._check_rank(rank)
        coords: dict[str, int] = {}
        for name, size in reversed(self._shape):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Global rank at ``coords`` (every axis must be given)."""
        missing = set(self.axis_names) - set(coords)
        extra = set(coords) - set(self.axis_names)
        if missing or extra:
            raise ValueError(
                f"rank_of needs exactly the axes {self.axis_names}; missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        rank = 0
        for name, size in self._shape:
            c = coords[name]
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} is outside the axis size {size}")
            rank = rank * size + c
        return rank

    def group_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """Global ranks of the ``axis`` slice through ``rank``, in axis order."""
        # Every collective asks this: remembered per (mesh shape, axis, rank).
        if isinstance(axis, str) and isinstance(rank, int):
            return _group_ranks(self, axis, rank)
        return self._compute_group_ranks(axis, rank)  # raises the usual errors

    def _compute_group_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        coords = self.coords_of(rank)
        return tuple(self.rank_of({**coords, axis: i}) for i in range(self.axis_size(axis)))

    def all_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every slice of ``axis`` (each rank appears in exactly one), ordered by first rank."""
        self._axis_position(axis)
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.size):
            seen.setdefault(self.group_ranks(axis, rank), None)
        return list(seen)

    def __iter__(self) -> Iterator[dict[str, int]]:
        """Coordinates of every rank, in rank order."""
        sizes = [range(size) for _, size in self._shape]
        for point in itertools.product(*sizes):
            yield dict(zip(self.axis_names, point, strict=True))

    # -- the calling rank -----------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The calling rank's backend, checked against this mesh's size."""
        backend = current_backend()
        if backend.world_size != self.size:
            launched = os.environ.get("WORLD_SIZE")
            if backend.world_size == 1 and launched not in (None, "", "1"):
                raise RuntimeError(
                    f"{self!r} spans {self.size} ranks but this process runs on a world of 1: it was launched as one "
                    f"of {launched} (WORLD_SIZE={launched}, torchrun's), but torch.distributed is not initialised. "
                    "Call torch.distributed.init_process_group() first (see the guide's chapter on torchrun)."
                )
            raise RuntimeError(
                f"{self!r} spans {self.size} ranks but this program runs on a world of "
                f"{backend.world_size} ({backend.name} backend). Launch it with "
                f"shardwise.launch(main, world={self.size}) or torchrun --nproc-per-node {self.size}."
            )
        return backend

    @property
    def rank(self) -> int:
        """Global rank of the caller."""
        return self.backend.rank

    @property
    def coords(self) -> dict[str, int]:
        """Coordinates of the caller."""
        return self.coords_of(self.rank)

    def axis_index(self, axis: str) -> int:
        """The caller's position along ``axis``."""
        return self.coords[self._check_axis(axis)]

    def group(self, axis: str) -> Group:
        """The caller's slice of ``axis`` as a backend Group."""
        return Group(axis, self.group_ranks(axis, self.rank))

    # -- helpers --------------------------------------------------------------
    def _axis_position(self, axis: str) -> int:
        for i, (name, _) in enumerate(self._shape):
            if name == axis:
                return i
        raise ValueError(f"unknown mesh axis {axis!r}; this mesh has axes {self.axis_names}")

    def _check_axis(self, axis: str) -> str:
        self._axis_position(axis)
        return axis

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside {self!r} (ranks 0..{self.size - 1})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._shape == other._shape

    def __hash__(self) -> int:
        return hash(self._shape)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self._shape) + ")"

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Mesh, (dict(self._shape),))


@functools.lru_cache(maxsize=4096)
def _group_ranks(mesh: Mesh, axis: str, rank: int) -> tuple[int, ...]:
    # Meshes are values (equal and hashing by their axes), so equal meshes share entries.
    return mesh._compute_group_ranks(axis, rank)
