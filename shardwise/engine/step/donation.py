"""A TrainState an in-place optimizer consumed must not step again.

``sw.optim.sgd(..., inplace=True)`` and ``adamw(..., inplace=True)`` write the new parameters and
optimizer state into the ones they are given (torch's way, JAX's ``donate_argnums``): after
``new, _ = step(state, batch)`` the tensors of ``state`` are those of ``new``. Stepping ``state``
again (a retry, two branches from one state, an evaluation loop that reuses it) would start from
moments and parameters a later update already wrote, while ``state.step`` says otherwise: another
run, and no error. So each in-place step tags the tensors it leaves with the update count they
hold, and a step refuses a state whose tensors hold more updates than the state says.

One tensor per tree is tagged and checked: an in-place update writes every one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optree
import torch

from ..layout.in_flight import InFlightParams
from ..layout.state import TrainState
from ..optim.optimizers import updates_in_place

if TYPE_CHECKING:
    from .step import Step

_UPDATES = "_shardwise_updates"  # the update count a tensor holds, set by an in-place step


def donates(step: Step) -> bool:
    """Whether the step's optimizer updates in place (a user's optimizer: as it says, else not)."""
    return updates_in_place(step.optimizer)


def _witnesses(state: TrainState) -> list[torch.Tensor]:
    """A tensor the update writes from each of the optimizer state and the parameters (not the
    update count, a new tensor each step; not parameters still in flight, which reading would settle)."""
    trees: list[Any] = [state.opt_state]
    if isinstance(state.params, dict):  # a plain tree (a Mapping of gathers in flight settles when read)
        trees.append(state.params)
    elif isinstance(state.params, InFlightParams):
        # Its shards, which the next update starts from, and the full parameters already here: a
        # ZeRO-1/2 step that gathers into its parameters (gathers_into_params) writes those of the
        # state it was given, which may hold no optimizer state to witness it (plain SGD).
        trees += [state.params.shards, state.params.ready()]
    found = []
    for tree in trees:
        leaf = _first_array(tree)
        if leaf is not None:
            found.append(leaf)
    return found


def _first_array(tree: Any) -> torch.Tensor | None:
    """The first tensor of ``tree`` with at least one dim, in optree's leaf order. Plain dicts (sorted
    keys, as optree flattens them), lists and tuples are walked here and stop at the first find, which
    costs a few microseconds where flattening a model's state takes tens; other nodes are flattened."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.ndim > 0 else None
    if tree is None or type(tree) in (int, float, bool, str):
        return None
    if type(tree) is dict:
        try:
            keys = sorted(tree)
        except TypeError:  # keys that do not compare: optree's own order
            keys = None
        if keys is not None:
            for k in keys:  # (plain loops, not generators: this runs twice a step, on two trees)
                found = _first_array(tree[k])
                if found is not None:
                    return found
            return None
    elif type(tree) in (list, tuple) or (isinstance(tree, tuple) and hasattr(tree, "_fields")):
        for value in tree:
            found = _first_array(value)
            if found is not None:
                return found
        return None
    return next((t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.ndim > 0), None)


def check_not_consumed(step: Step, state: TrainState) -> None:
    """Refuse ``state`` when an in-place update already wrote past it, whichever step reads it: the tags
    are the in-place step's, and a step that updates out of place (passed the state by mistake, or built
    to branch from it) would read the later values as well."""
    if not isinstance(state, TrainState):
        return
    for tensor in _witnesses(state):
        held = getattr(tensor, _UPDATES, None)
        if held is not None and held > state.step:
            raise ValueError(
                f"state: this TrainState (step {state.step}) was consumed by an in-place update: its tensors "
                f"already hold {held} updates (the optimizer's inplace=True writes the new state into the one "
                "it is given, as torch does). Step the state the last call returned; to step one state more "
                "than once, use the optimizer with inplace=False (the default). If you reset state.step on "
                "purpose, copy its tensors first (optree.tree_map(torch.clone, ...))."
            )


def mark_updated(step: Step, state: TrainState) -> None:
    """Tag the tensors of the state an in-place step returns with the update count they hold."""
    if not donates(step):
        return
    for tensor in _witnesses(state):
        setattr(tensor, _UPDATES, state.step)


def mark_consumed(step: Step, state: TrainState, written: list[Any]) -> None:
    """A step of ``state`` was refused after its in-place update: tag what that update wrote (and
    so ``state``'s own tensors it wrote into) as holding one update more than ``state`` says, and ``state``'s
    witnesses with them (what the update made is unknown, or partial, when it failed midway)."""
    if not donates(step):
        return
    # With ``state``'s witnesses always: an update in buckets that failed after its first bucket wrote only that
    # bucket's part, and a witness elsewhere left the half-updated state to be retried (stage 2's
    # update_in_buckets, an in-place AdamW: its moments 4.7e-2 on, no error).
    tensors = [t for tree in written for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    for tensor in [*tensors, *_witnesses(state)]:
        setattr(tensor, _UPDATES, max(getattr(tensor, _UPDATES, 0), state.step + 1))
