"""The stack's SPLIT specs as the one split the engine asks: each over its own axis.

A stack may hold several splits, one per mesh axis (compose.py's rule), e.g. tensor_parallel over
``tp`` beside another split over an axis of its own. The engine asks :class:`Splits` what it would
ask one split, and gets the parts' answers combined:

* ``axes``: the parts' axes, in the stack's order (each a coordinate of a rank's class in the Plan,
  an axis the metrics are summed over, an axis whose replicas are checked).
* ``tensor_splits``: the parts' cuts merged; two splits cutting one parameter are refused.
* ``local_view``: each part's view in turn (they cut different parameters).
* ``replicated``: what every part replicates (held whole on every index of every split axis).
* ``batch_cut``: the parts' batch axes in order, their sequence parts multiplied (one split at most
  cuts the sequence).
* ``counted`` / ``counts_losses``: a rank counts a gradient unless some part that does not count its
  replicated values here replicates it; its losses unless such a part does not cut the batch.
* ``replica_checks``: per part, over its axis, the gradients it replicates (they must agree there).
* ``rng_rank``: each part's choice of the coordinate on its own axis.
* ``predicting``: one ``in_layer.predicting`` block with every part's axis; ``own_prediction``: the
  one part's own prediction of the in-layer collectives, if one brings it (tensor parallel), else
  None (the engine's); it runs inside that block, so it records every part's collectives.

With no part it is :data:`NO_SPLIT`'s: nothing cut, every rank computes with whole parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...collectives.mesh import Mesh
from ..layout.state import Params
from ..layout.state_layout import TensorSplit
from ..model.chain import Chain
from . import in_layer
from .roles import NO_CUT, SPLIT, BatchCut, SplitRole, own_prediction

Keys = frozenset[tuple[str, str]]  # parameters by (owner layer, local name)


@dataclass(frozen=True)
class Replicated:
    """The gradients that must agree over ``axis`` (those the part ``by`` replicates), and its fix."""

    axis: str
    keys: Keys
    by: str
    fix: str


@dataclass(frozen=True)
class Splits:
    """The SPLIT specs of a stack, each over its own axis (see the module docstring)."""

    parts: tuple[SplitRole, ...] = ()

    @property
    def name(self) -> str:
        return " + ".join(p.name for p in self.parts) or "no split"

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(p.axis for p in self.parts)

    def __str__(self) -> str:
        return " + ".join(str(p) for p in self.parts) or "no split"

    def tensor_splits(self, chain: Chain, mesh: Mesh | None) -> dict[tuple[str, str], TensorSplit] | None:
        """Every cut parameter's cut, by (owner layer, local name); None when no part cuts any."""
        merged: dict[tuple[str, str], TensorSplit] = {}
        by: dict[tuple[str, str], str] = {}
        for part in self.parts:
            for key, cut in (part.tensor_splits(chain, mesh) or {}).items():
                if key in merged:
                    raise ValueError(
                        f"{by[key]} and {part.name} both cut parameter {key[1]!r} of layer {key[0]!r} (over axes "
                        f"{merged[key].axis!r} and {cut.axis!r}); a parameter is cut by one split: leave it out "
                        f"of one of them"
                    )
                merged[key], by[key] = cut, part.name
        return merged or None

    def local_view(self, chain: Chain, params: Params, mesh: Mesh | None, rank: int | None) -> Params:
        for part in self.parts:
            params = part.local_view(chain, params, mesh, rank)
        return params

    def replicated(self, chain: Chain) -> Keys:
        keys: Keys = frozenset((layer.name, n) for layer in chain for n in layer.owned_param_names)
        for part in self.parts:
            keys &= part.replicated(chain)
        return keys

    def batch_cut(self, mesh: Mesh | None) -> BatchCut:
        cuts = [part.batch_cut(mesh) for part in self.parts]
        sequences = [c for c in cuts if c.sequence_parts > 1]
        if len(sequences) > 1:
            raise ValueError(
                f"{self.name}: two splits cut each sequence; cut the sequence over one axis"
            )
        axes = tuple(a for c in cuts for a in c.axes)
        if not sequences:
            return BatchCut(axes=axes) if axes else NO_CUT
        return BatchCut(axes, sequences[0].sequence_parts, sequences[0].cut_sequence, sequences[0].sequence_dim)

    def counted(self, chain: Chain, mesh: Mesh | None) -> Keys | None:
        """The gradients this rank counts in the metrics (None: all): not those that a part which does
        not count replicated values on this rank replicates (another index of its axis counts them)."""
        quiet = [p for p in self.parts if not p.counts_replicated(mesh)]
        if not quiet:
            return None
        keys: Keys = frozenset((layer.name, n) for layer in chain for n in layer.owned_param_names)
        for part in quiet:
            keys -= part.replicated(chain)
        return keys

    def counts_losses(self, mesh: Mesh | None) -> bool:
        """Whether this rank counts its losses and tokens: unless a part that does not count replicated
        values here gives every index of its axis the same batch (it computes the same loss)."""
        return all(p.batch_cut(mesh).cuts for p in self.parts if not p.counts_replicated(mesh))

    def replica_checks(self, chain: Chain) -> tuple[Replicated, ...]:
        return tuple(Replicated(p.axis, p.replicated(chain), p.name, p.replica_fix) for p in self.parts)

    def rng_rank(self, mesh: Mesh | None) -> int | None:
        """The rank whose random streams this one draws: its own coordinates, but on each part's axis
        the coordinate that part draws at (tensor parallel: index 0, so replicated values draw alike)."""
        chosen = {p.axis: r for p in self.parts if (r := p.rng_rank(mesh)) is not None}
        if not chosen:
            return None
        assert mesh is not None
        coords = dict(mesh.coords)
        for axis, r in chosen.items():
            coords[axis] = mesh.coords_of(r)[axis]
        return mesh.rank_of(coords)

    def predicting(self, mesh: Mesh | None) -> contextlib.AbstractContextManager[list[in_layer.Issued]]:
        """A block in which the layers run on fake tensors, every part's collectives recording themselves
        (over any axis of the mesh: a split's layers may also sum a statistic over the batch's axes)."""
        if mesh is None or not self.axes:
            return contextlib.nullcontext([])
        return in_layer.predicting({axis: mesh.axis_size(axis) for axis in mesh.axis_names})

    def own_prediction(self) -> Callable[..., dict[tuple[str, int], list[in_layer.Issued]]] | None:
        """The part's own prediction of the in-layer collectives, if one brings it (compose.py allows one)."""
        found = [f for f in (own_prediction(p) for p in self.parts) if f is not None]
        return found[0] if found else None

    def coordinates(self, mesh: Mesh, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinates on the split axes (with its pipeline index: what decides its actions)."""
        coords = mesh.coords_of(rank)
        return tuple(coords[a] for a in self.axes)

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        notes: dict[str, list[str]] = {}
        for part in self.parts:
            for layer, note in part.layer_notes(chain).items():
                notes.setdefault(layer, []).append(note)
        return {layer: "; ".join(n) for layer, n in notes.items()}


NO_SPLIT = Splits()


def splits_of(stack: tuple[Any, ...]) -> Splits:
    """The stack's SPLIT specs as one :class:`Splits` (:data:`NO_SPLIT` without any)."""
    parts = tuple(spec for spec in stack if spec.role == SPLIT)
    return Splits(parts) if parts else NO_SPLIT
