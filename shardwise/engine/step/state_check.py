"""Every call of a step (and of save, full_params, ...) checks its TrainState's layout; the usual call cheaply.

A state's parameters and optimizer state must be laid out as ``Step.init`` laid them out on this
rank (held_check.py, opt_check.py): the full comparisons look up meta trees and walk them beside the
state's (the parameters' alone took about 22 us a call for the 16-parameter MLP of
``benchmarks/one_device.py``, on a loaded CPU). The usual loop passes back the state the last call
returned, or one laid out just as it: so the step remembers, per rank, a signature of each tree it
accepted (the containers' keys in order, each tensor's shape and dtype) and compares the next state's
with it in a few C-level list comparisons: parameters and optimizer state together, about 15 us
(SGD's momentum) and 22 us (AdamW's two moments) for that MLP. The signature is read from the tensors
at every call, not assumed from their identity: the dicts the step returned are the user's to change
in place, and a tensor swapped in place (``t.data = t.data.bfloat16()``) is the same object with
another dtype. Any other state (cloned, loaded, edited) takes the full comparison once, which accepts
it (its signature is then the remembered one) or refuses it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch

from ..layout.in_flight import InFlightParams
from ..layout.state import TrainState
from ..layout.state_layout import StateLayout
from .held_check import check_held
from .opt_check import check_opt_state, expected_opt_states

if TYPE_CHECKING:
    from .step import Step

_LAYOUT = operator.attrgetter("shape", "dtype")


@dataclass
class _Accepted:
    """What this rank's check knows for one (layout, mesh): held to keep their ids from being reused."""

    layout: StateLayout
    mesh: Any
    opt_states: list[Any] | None = None  # expected_opt_states, made at the first full comparison
    update_known: bool = True  # whether they are all the optimizer state may be (opt_check.expected_opt_states)
    returned: Any = None  # where they are not: the signature of the optimizer state the step returned last
    returned_like: Any = None  # and that state as meta tensors (None: none returned yet)
    params: Any = None  # the signature of the last accepted parameters (None: none yet)
    opt_state: Any = None


class StateMemo(dict[Any, "_Accepted"]):
    """A Step's memo of the states it accepted, by (layout, mesh, rank): a plain dict, read with one C-level
    lookup a call, emptied when it outgrows 64 entries (each rank of a thread world, each new layout or mesh
    adds one); pickled empty, as a layout's cache."""

    follows_returns = False  # whether an optimizer's update could not run on meta tensors (see note_returned)

    def remember(self, key: Any, accepted: _Accepted) -> _Accepted:
        if len(self) >= 64:
            self.clear()
        self[key] = accepted
        return accepted

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return StateMemo, ()


def check_layout(step: Step, state: TrainState, layout: StateLayout) -> None:
    """Refuse ``state`` unless its parameters and optimizer state are laid out as ``step.init`` lays
    them out on this rank (see the module's docstring)."""
    mesh = state.mesh
    memo: StateMemo = step.state_memo
    key = id(layout) if mesh is None else (id(layout), id(mesh), mesh.rank)
    known = memo.get(key)
    if known is None or known.layout is not layout or known.mesh is not mesh:
        known = memo.remember(key, _Accepted(layout, mesh))
    params = state.params
    if not isinstance(params, InFlightParams):  # made by the previous call of the step itself
        signed = signature(params)
        if signed is None or signed != known.params:
            check_held(params, step.expected_held(layout, mesh))
            known.params = signed
    signed = signature(state.opt_state)
    if signed is None or signed != known.opt_state:
        if signed is not None and signed == known.returned:  # the step's own, or laid out as it
            known.opt_state = signed
            return
        if known.opt_states is None:
            known.opt_states, known.update_known = expected_opt_states(
                step.optimizer, step.expected_update_tree(layout, mesh))
            if not known.update_known:
                memo.follows_returns = True
        like = [] if known.returned_like is None else [known.returned_like]
        check_opt_state(state.opt_state, known.opt_states + like, known.update_known)
        known.opt_state = signed


def note_returned(step: Step, state: TrainState) -> None:
    """After a call: where the optimizer's update could not run on meta tensors (its state after the first
    update is not predicted), remember the signature of the optimizer state the step returned on this rank,
    which the next call accepts. Nothing is done otherwise (one attribute read)."""
    memo: StateMemo = step.state_memo
    if not memo.follows_returns or not isinstance(state.layout, StateLayout):
        return
    mesh = state.mesh
    known = memo.get(id(state.layout) if mesh is None else (id(state.layout), id(mesh), mesh.rank))
    if known is not None and not known.update_known:
        known.returned = signature(state.opt_state)
        known.returned_like = optree.tree_map(_as_meta, state.opt_state)


def _as_meta(leaf: Any) -> Any:
    """A tensor as a meta tensor of its shape and dtype (what the check compares); anything else as it is."""
    if isinstance(leaf, torch.Tensor):
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
    return leaf


def signature(tree: Any) -> Any:
    """An exact description of ``tree``'s containers and tensors (their shapes and dtypes), or None where
    it holds something else than tensors. The usual trees (a dict of dicts of tensors; a NamedTuple of
    tensors, None and such dicts) are read with comprehensions; any other by optree."""
    try:
        if type(tree) is dict:
            return _mapping(tree)
        if type(tree) is not tuple and isinstance(tree, tuple):  # a NamedTuple: the built-in optimizers' states
            parts = [None if x is None else _mapping(x) if type(x) is dict else _LAYOUT(x) for x in tree]
            if all(p is not _OTHER for p in parts):
                return type(tree), parts
        leaves, spec = optree.tree_flatten(tree)
        return spec, list(map(_LAYOUT, leaves))
    except AttributeError:  # a leaf that is not a tensor (an int step count)
        return None


_OTHER = object()  # a dict that is not a plain tree of tensors two levels deep
_DICT_KINDS = {dict}


def _mapping(tree: dict[Any, Any]) -> Any:
    """A dict of tensors or of dicts of tensors (the parameters and what mirrors them) as
    (its keys, each inner dict's keys, its tensors' shapes and dtypes); _OTHER for any other dict."""
    values = list(tree.values())
    kinds = set(map(type, values))
    if kinds == _DICT_KINDS:
        return tuple(tree), tuple(map(tuple, values)), list(map(_LAYOUT, [t for v in values for t in v.values()]))
    if dict in kinds or any(k is not type(None) and not hasattr(k, "shape") for k in kinds):
        return _OTHER
    return tuple(tree), None, [None if v is None else _LAYOUT(v) for v in values]

