"""The optimizer states a rank's state may hold, as meta tensors: init's, and for a user's optimizer that makes
its state at its first update, what one update makes of init's (the step's check, engine/step/opt_check.py, and
checkpoint.load, which rebuilds a saved state as one of them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from .meta_like import meta_like
from .optimizers import updates_by_key


def expected_opt_states(optimizer: Any, update_meta: Mapping[str, Any],
                        after_update: bool = True) -> tuple[list[Any], bool]:
    """(the optimizer states this rank's state may hold, as meta tensors; whether they are all it may hold).

    What ``optimizer.init`` makes of ``update_meta`` (the tree ``Step.init`` gives it), then, for a user's
    optimizer and ``after_update``, what one update makes of that where it differs in structure (a state
    made at the first update). False where that update cannot run on meta tensors (it reads a value): then
    the state the step returns is accepted too (state_check.note_returned). Callers ask for the update's
    only where init's does not match: an in-place op of a user's update on meta tensors runs torch's Python
    meta kernel, which imports sympy (about 0.4 s of CPU and 36 MiB on each rank)."""
    with meta_like():  # a user's optimizer's zeros_like, without torch's Python reference (meta_like.py)
        made = optimizer.init(update_meta)
    found = [made]
    if not after_update or not updates_after_init(optimizer):
        return found, True
    try:
        with meta_like(), torch.no_grad():
            _, after = optimizer.update(update_meta, made, update_meta)
    except Exception:  # any failure of a user's update on meta tensors (.item(), a data-dependent branch)
        return found, False
    if optree.tree_structure(after) != optree.tree_structure(made):
        found.append(after)
    return found, True


def updates_after_init(optimizer: Any) -> bool:
    """Whether ``optimizer`` may make state at its first update: a user's may; the built-in ones (and their
    groups) make their whole state at init."""
    return not (updates_by_key(optimizer) or getattr(optimizer, "groups", None) is not None)
