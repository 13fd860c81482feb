"""ZeRO-1/2's full parameters beside the shards they are gathered from, the gathers maybe still in flight.

A ZeRO-1/2 step updates this rank's shards and all-gathers them into the full parameters the
next step computes with. Its TrainState's ``params`` is an :class:`InFlightParams`: the full
parameters, and the updated shards, which the next update starts from instead of cutting them
again out of the full parameters. With ``shard_params(..., overlap_gather=True)`` the step
returns as soon as those all-gathers are issued, and the next step waits for each bucket's
all-gather just before the first forward that uses it (the Plan's ``wait_params``), so the
gather overlaps that step's forward; otherwise the step waited for them at its end.

Stale values can never be read: every way in (``state.params[layer]``, iterating it, ``len``,
``in``, ``repr``, optree flattening, pickling, ``torch.save``, ``copy.deepcopy``, and so
``sw.checkpoint.save``, ``step.full_params`` and ``sw.testing.assert_equivalent``) first waits
for every gather still in flight. Only the step itself reads the in-flight buckets one by one.
Flattened or pickled, it becomes the plain dict it stands for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import optree
import torch

from ...collectives import Handle
from ..model.pytrees import GLOBAL_NAMESPACE
from .buckets import Bucket

Layers = dict[str, dict[str, torch.Tensor]]


class InFlightParams(Mapping[str, dict[str, torch.Tensor]]):
    """A params pytree (layer name -> local name -> tensor) of which some layers are still on their
    way in an all-gather: any read waits for all of them first (see the module docstring).

    ``shards`` is this rank's updated shard of every unit, the all-gathers' input: the next step's
    update starts from them instead of cutting them again out of the full parameters, unless the
    parameters were read (``exposed``): whatever the reader did with them is then what counts.

    >>> import torch
    >>> from shardwise.engine.layout.in_flight import InFlightParams
    >>> params = InFlightParams({"head": {"w": torch.ones(2)}}, [], {}, ("head",))
    >>> params["head"]["w"], dict(params) == {"head": params["head"]}
    (tensor([1., 1.]), True)
    """

    __slots__ = ("_base", "_done", "_exposed", "_full", "_lock", "_order", "_pending", "shards")

    def __init__(
        self, base: Mapping[str, Mapping[str, torch.Tensor]], pending: Sequence[tuple[Bucket, Handle]],
        shards: Mapping[str, torch.Tensor], order: Sequence[str],
    ) -> None:
        self._base = {k: dict(v) for k, v in base.items()}  # layers no gather brings
        self._pending = list(pending)  # (bucket, its all-gather), in issue order
        self._done: Layers = {}
        self._order = tuple(order)  # the layers, in the order the state held them
        self._full: Layers | None = None
        self._exposed = False
        self._lock = threading.Lock()
        self.shards = dict(shards)

    # -- the step's own access ------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """How many buckets' all-gathers are still not waited for."""
        return len(self._pending)

    @property
    def exposed(self) -> bool:
        """Whether anything but a step read these parameters (and so may have changed them)."""
        return self._exposed

    def wait_bucket(self, units: Sequence[str]) -> Layers:
        """Wait for the all-gather of the bucket of ``units`` (a step's ``wait_params``) and return
        their parameters. A bucket no gather carries (a state that was settled) returns at once."""
        with self._lock:
            for i, (bucket, handle) in enumerate(self._pending):
                if bucket.names == tuple(units):
                    del self._pending[i]
                    self._done.update(bucket.unflatten(handle.wait()))
                    break
            else:
                if any(u not in self._done and u not in self._base for u in units):
                    self._settle_locked()  # another cut into buckets: everything, to be safe
            return {u: self._done[u] if u in self._done else self._base[u] for u in units}

    def ready(self) -> Layers:
        """The layers already here (those no gather brings, and the buckets waited for), without
        waiting for the rest (the step's view: it does not count as a read)."""
        with self._lock:
            return {**self._base, **self._done} if self._full is None else self._full

    def settle(self) -> Layers:
        """Wait for every all-gather still in flight; the complete parameters (the step's view: it
        does not count as a read)."""
        with self._lock:
            return self._settle_locked()

    def _settle_locked(self) -> Layers:
        if self._full is None:
            for bucket, handle in self._pending:
                self._done.update(bucket.unflatten(handle.wait()))
            self._pending.clear()
            got = {**self._base, **self._done}
            order = [k for k in self._order if k in got] + [k for k in got if k not in self._order]
            self._full = {k: got[k] for k in order}
        return self._full

    def _read(self) -> Layers:
        full = self.settle()
        self._exposed = True
        return full

    # -- everyone else's: every read settles ---------------------------------------------------
    def __getitem__(self, layer: str) -> dict[str, torch.Tensor]:
        return self._read()[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __contains__(self, layer: object) -> bool:
        return layer in self._read()

    def __repr__(self) -> str:
        return repr(self._read())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (torch.save, deepcopy, a process's result) as the plain dict it stands for."""
        return (dict, (dict(self._read()),))

    def copy(self) -> Layers:
        """A plain dict of the (settled) parameters, one level deep as ``dict.copy``."""
        return dict(self._read())


def _flatten(params: InFlightParams) -> tuple[list[dict[str, torch.Tensor]], tuple[str, ...], tuple[str, ...]]:
    full = params._read()
    keys = tuple(sorted(full))  # a dict's order under optree: its leaves line up with a dict's
    return [full[k] for k in keys], keys, keys


def _unflatten(keys: tuple[str, ...], children: Any) -> dict[str, Any]:
    return dict(zip(keys, children, strict=True))


optree.register_pytree_node(
    InFlightParams,
    _flatten,  # type: ignore[arg-type]
    _unflatten,  # type: ignore[arg-type]
    path_entry_type=optree.MappingEntry,
    namespace=GLOBAL_NAMESPACE,
)
