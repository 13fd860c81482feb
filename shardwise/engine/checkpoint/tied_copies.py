"""A tied weight stored under more than one of its names: the copies must be equal, or the load is refused.

A module whose weights are tied (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) trains
one tensor, so a weights file can give it only one value. ``save_pretrained`` stores one name; a
torch ``state_dict`` stores every name, all holding the one tensor. A file whose copies differ
(an untied fine-tune's weights, loaded into a model built tied) holds two weights the model cannot
hold: taking either would silently drop the other's values, so ``init_from_state_dict`` refuses
it, and so do the weights loaders here.

The comparison keeps a loader's memory and reads at a rank's share: each rank compares only its
``1/world`` of the elements of each copy, a bounded run at a time, and the ranks then agree (an
exchange of their findings, as ``save_load`` agrees on a save), so every rank refuses alike even
where only one rank's elements differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from ...collectives.mesh import Mesh
from ..run.agreement import gather_texts
from .cut import boxes, flat_start
from .errors import CheckpointError
from .regions import Placed

_RUN = 1 << 20  # elements of each copy compared at a time

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
ReadInto = Callable[[str, list[Placed]], None]


def refuse_differing_copies(
    where: str, copies: Mapping[str, list[str]], shapes: Shapes, read_into: ReadInto, mesh: Mesh | None,
    device: torch.device,
) -> None:
    """Refuse, on every rank alike, a tied weight whose stored names (``copies[key]``: its key first,
    then its other names, each stored) hold different shapes or values. Every rank calls it (the
    ranks exchange what they found)."""
    for key, names in copies.items():  # shapes: every rank knows them, no exchange needed
        for other in names[1:]:
            if shapes[other][0] != shapes[names[0]][0]:
                how = f"their shapes differ ({list(shapes[names[0]][0])} and {list(shapes[other][0])})"
                raise CheckpointError(differing_copies_message(where, key, names[0], other, how))
    rank, world = (0, 1) if mesh is None else (mesh.rank, mesh.size)
    problem = next((differing_copies_message(where, key, names[0], other, "their values differ")
                    for key, names in copies.items() for other in names[1:]
                    if not _equal_share(names[0], other, shapes, read_into, rank, world)), None)
    if world > 1 and copies:
        assert mesh is not None
        found = [texts[0] for texts in gather_texts(mesh, [problem or ""], device)]
        problem = next((text for text in found if text), None)
    if problem is not None:
        raise CheckpointError(problem)


def _equal_share(a: str, b: str, shapes: Shapes, read_into: ReadInto, rank: int, world: int) -> bool:
    """Whether stored tensors ``a`` and ``b`` (of one shape) are equal in this rank's share of
    their elements, read a run of at most ``_RUN`` elements at a time."""
    shape = tuple(shapes[a][0])
    numel = math.prod(shape)
    share = -(-numel // world)
    start, stop = min(rank * share, numel), min((rank + 1) * share, numel)
    common = torch.promote_types(shapes[a][1], shapes[b][1])
    for first in range(start, stop, _RUN):
        last = min(first + _RUN, stop)
        values = []
        for key in (a, b):
            flat = torch.empty(last - first, dtype=shapes[key][1])
            placed = []
            for offsets, sizes in boxes(shape, first, last):
                at = flat_start(shape, offsets) - first
                placed.append(((offsets, sizes), flat[at : at + math.prod(sizes)].view(sizes)))
            read_into(key, placed)
            values.append(flat.to(common))
        if not torch.equal(values[0], values[1]):
            return False
    return True


def differing_copies_message(where: str, key: str, first: str, other: str, how: str) -> str:
    """Why tied copies ``first`` and ``other`` (names of ``key``'s weight) that differ are refused,
    and what to do."""
    tied = f"{other!r} is tied to {key!r}" if first == key else f"{first!r} and {other!r} are tied to {key!r}"
    return (
        f"{where}: {tied} in the module (one weight), but both are stored and {how}: loading would keep "
        "one and silently drop the other. To train them as two weights, untie them in the model "
        "(tie_word_embeddings=False for a transformers model) and build the step again; to train one "
        f"weight, keep one copy (drop {other!r}: save_pretrained stores one)"
    )
