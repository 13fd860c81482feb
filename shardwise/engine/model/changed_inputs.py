"""Batch inputs that a model's forward changes in place, in the call-recording split (``capture.py``).

Whisper's SpecAugment zeroes ``input_features`` in place (``_mask_input_features``, its mask drawn from
numpy) before the encoder runs. The split runs that code in ``embed`` and again, discarded, in each
replay up to its carried state (a bridge, ``head``), all on the same tensor: a replay masked again, with
its own draws, what ``embed`` had masked and saved for its backward (autograd's raw "modified by an
inplace operation" error), and the code after its carried state saw the input masked twice.

So the recording notes which of the input's tensors forward changes (their version counters), and then:

* ``embed`` runs on copies of them, which forward changes as it changes the batch in the module, and
  which its carry holds (the user's batch is left as it was);
* a replay runs on copies of the carried ones, and where it reaches its carried state puts the carried
  values back into them: the code after sees the input as the module has it there (changed by the code
  before, once), and what it changes in turn travels on in its carry;
* what a replay computes from such an input before its carried state (on values an earlier layer
  already changed, changed again with other draws) is not what the module computes: under the check
  on the example, a use of it after the carried state is refused, naming the input (:class:`ChangedInput`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
from torch import Tensor

from .tensor_reads import StandInGuard

#: Leaves of the layer input (flattened as ``carry.Layout`` flattens it, Nones as leaves) by position.
LeafIndices = tuple[int, ...]


def versions(x: Any) -> list[int | None]:
    """The version counter of each tensor leaf of ``x`` (None for the other leaves)."""
    return [t._version if isinstance(t, Tensor) else None for t in optree.tree_leaves(x, none_is_leaf=True)]


def changed_since(x: Any, before: Sequence[int | None]) -> LeafIndices:
    """The leaves of ``x`` changed in place since ``before`` (from :func:`versions`)."""
    now = versions(x)
    return tuple(j for j, (v, w) in enumerate(zip(before, now, strict=True)) if v is not None and v != w)


def copies(x: Any) -> Any:
    """``x`` with every tensor leaf copied (the recording's and the module check's runs: the example stays
    as the user gave it)."""
    return optree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, x, none_is_leaf=True)


def with_copies(x: Any, changed: LeafIndices) -> tuple[Any, list[tuple[int, Tensor, Tensor]]]:
    """``x`` with its ``changed`` leaves copied, and (leaf, copy, original) for each."""
    if not changed:
        return x, []
    leaves, spec = optree.tree_flatten(x, none_is_leaf=True)
    copied = []
    for j in changed:
        original = leaves[j]
        if isinstance(original, Tensor):  # None in this batch: nothing to change
            leaves[j] = original.clone()
            copied.append((j, leaves[j], original))
    return optree.tree_unflatten(spec, leaves), copied


def leaf_names(x: Any) -> list[str]:
    """Each leaf's place in ``x`` (``input_features``, ``0.mask``), as the messages name it."""
    return [".".join(str(k) for k in path) or "the input" for path in optree.tree_paths(x, none_is_leaf=True)]


class ChangedInput(str):
    """The name :class:`StandInGuard` follows a replay's copy of a changed input by, before its carried
    state (the input's place in the layer input)."""


def replaying_changed(x: Any, changed: LeafIndices, guard: Any) -> tuple[Any, Callable[[], None]]:
    """``x`` for a replay (a bridge, ``head``): its ``changed`` leaves copied, followed by ``guard`` (under
    the check on the example) until the carried state; and what to call there, which stops following the
    copies (what was computed from them stays followed) and puts the carried values back into them."""
    replayed, copied = with_copies(x, changed)
    if not copied:
        return replayed, lambda: None
    following = isinstance(guard, StandInGuard)
    if following:
        where = leaf_names(x)
        for j, copy, _ in copied:
            guard.mark(copy, ChangedInput(where[j]))

    def put_back() -> None:
        for _, copy, original in copied:
            if following:
                guard.unmark(copy)
            copy.copy_(original)

    return replayed, put_back
