"""Every call of a step (and of save, full_params, ...) checks its TrainState's layout; the usual call cheaply.

A state's parameters and optimizer state must be laid out as ``Step.init`` laid them out on this rank
(held_check.py, opt_check.py): the full comparisons look up meta trees and walk them beside the state's
(the parameters' alone took about 22 us a call for the 16-parameter MLP of ``benchmarks/one_device.py``,
on a loaded CPU). The usual loop passes back the state the last call returned, or one laid out just as
it: so the step remembers, per rank, a signature of each tree it accepted (the containers' keys in
order, each tensor's shape, dtype and device) and compares the next state's with it in a few C-level
list comparisons: parameters and optimizer state together, about 15 us (SGD's momentum) and 22 us
(AdamW's two moments) for that MLP. The parameters' devices add about 1 us of CPU a call (26.2 to
27.3 us SGD, 34.8 to 36.2 us AdamW, ``check_state`` alone on a machine loaded well above its cores);
without them a parameter moved to another device alone passed and failed deep in the step (or, under
ZeRO-3, on a dict update error). The signature is read from the tensors at every
call, not assumed from their identity: the dicts the step returned are the user's to change in place,
and a tensor swapped in place (``t.data = t.data.bfloat16()``) is the same object with another dtype.
Any other state (cloned, loaded, edited) takes the full comparison once, which accepts it (its signature
is then the remembered one) or refuses it.

Where the optimizer's update cannot run on meta tensors (it reads a value) and makes its state at its
first update, the state it makes is not predicted: a fresh Step (a resumed process) knows only init's.
Until the step returned one on this rank, a state that is neither is accepted for one call, its devices
checked, and the step checks what its update made of it: a state that optimizer made keeps its layout
through an update (it is the layout the update makes), and is remembered; one whose layout the update
changed (a moment cast, replaced, or of another optimizer) is refused then, naming the leaf, before the
step returns.
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
from ..optim.expected_state import updates_after_init
from .held_check import check_held
from .opt_check import check_devices, check_opt_state, describe_change, expected_opt_states, first_non_tensor

if TYPE_CHECKING:
    from .step import Step

_LAYOUT = operator.attrgetter("shape", "dtype", "device")  # a tensor of the parameters or of the optimizer state


@dataclass
class _Accepted:
    """What this rank's check knows for one (layout, mesh): held to keep their ids from being reused."""

    layout: StateLayout
    mesh: Any
    opt_states: list[Any] | None = None  # expected_opt_states, made at the first full comparison
    update_known: bool = True  # whether they are all the optimizer state may be (opt_check.expected_opt_states)
    update_predicted: bool = False  # whether they include what one update makes (or the optimizer makes none)
    returned: Any = None  # where they are not: the signature of the optimizer state the step returned last
    returned_like: Any = None  # and that state as meta tensors (None: none returned yet)
    params: Any = None  # the signature of the last accepted parameters (None: none yet)
    params_device: torch.device | None = None  # and their device (held_check.check_held)
    opt_state: Any = None
    pending: Any = None  # (id, signature, likes) of a state accepted for one call, checked after it (note_returned)


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
            known.params_device = check_held(params, step.expected_held(layout, mesh), known.params_device)
            known.params = signed
    signed = signature(state.opt_state)
    if signed is None or signed != known.opt_state:
        if signed is not None and signed == known.returned:  # the step's own, or laid out as it
            known.opt_state = signed
            return
        if known.opt_states is None:  # init's: what one update makes is predicted only where it does not match
            known.opt_states, _ = expected_opt_states(step.optimizer, step.expected_update_tree(layout, mesh), False)
            known.update_predicted = not updates_after_init(step.optimizer)
        like = [] if known.returned_like is None else [known.returned_like]
        devices = _param_devices(params)
        try:
            try:
                check_opt_state(state.opt_state, known.opt_states + like, devices, known.update_known)
            except (TypeError, ValueError):
                if known.update_predicted:
                    raise
                known.update_predicted = True  # (on meta tensors: it imports sympy, see expected_state.py)
                known.opt_states, known.update_known = expected_opt_states(
                    step.optimizer, step.expected_update_tree(layout, mesh))
                if not known.update_known:
                    memo.follows_returns = True
                check_opt_state(state.opt_state, known.opt_states + like, devices, known.update_known)
        except (TypeError, ValueError):
            if signed is None and not known.update_known:  # not a tree of tensors: nothing to check it by
                raise TypeError(
                    f"{first_non_tensor(state.opt_state)}: this optimizer's update cannot run on meta tensors, so "
                    "the step checks a state it has not returned by what its update makes of it, which needs a tree "
                    "of tensors (dicts, lists, tuples and NamedTuples of them; keep numbers in 0-d tensors)"
                ) from None
            if known.update_known or known.returned_like is not None:
                raise  # predicted, or the step returned this optimizer's state on this rank: refused before the update
            # Not predicted (see the module's docstring): checked against what this call's update makes of it.
            check_devices(state.opt_state, devices)
            known.pending = (id(state.opt_state), signed, optree.tree_map(_like, state.opt_state))
            return
        known.opt_state = signed


def note_returned(step: Step, given: TrainState, state: TrainState) -> None:
    """After a call, before it returns ``state`` (made from ``given``): where the optimizer's update could not
    run on meta tensors (its state after the first update is not predicted), remember the signature of the
    optimizer state the step returned on this rank, which the next call accepts; and refuse a given state
    accepted for this call alone whose layout the update changed. Nothing is done otherwise (one attribute
    read)."""
    memo: StateMemo = step.state_memo
    if not memo.follows_returns or not isinstance(given.layout, StateLayout):
        return
    mesh = state.mesh
    # (by the given state's layout, which check_layout accepted: the returned one is another where the step
    # re-tagged it for its model, run_inputs.py)
    known = memo.get(id(given.layout) if mesh is None else (id(given.layout), id(mesh), mesh.rank))
    if known is None or known.update_known:
        return
    pending, known.pending = known.pending, None
    returned = signature(state.opt_state)
    returned_like = optree.tree_map(_like, state.opt_state)
    if pending is not None and pending[0] == id(given.opt_state) and pending[1] != returned:
        raise ValueError(
            f"{describe_change(pending[2], returned_like)}: this optimizer's update could not run on meta "
            "tensors, so the state given to this step, which is not init's, was checked against what one "
            "update made of it, and a state this optimizer made keeps its layout through an update. The "
            "step's result is not returned. Hand the step a state it returned (or a copy, pickled or not), "
            "carry one over through sw.checkpoint.save / load, or start afresh with step.init(params, mesh)"
        )
    known.returned, known.returned_like = returned, returned_like


def _like(leaf: Any) -> Any:
    """A tensor as one of its shape, dtype and device holding one element (what the check compares, without
    holding the state's memory); anything else as it is."""
    if isinstance(leaf, torch.Tensor):
        return torch.empty((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
    return leaf


def _param_devices(params: Any) -> frozenset[torch.device]:
    """The devices of this rank's parameters (an in-flight tree's shards: reading its parameters waits)."""
    tree: Any = params.shards if isinstance(params, InFlightParams) else params
    return frozenset(t.device for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def signature(tree: Any, read: Any = _LAYOUT) -> Any:
    """An exact description of ``tree``'s containers and tensors (their shapes and dtypes), or None where
    it holds something else than tensors. The usual trees (a dict of dicts of tensors; a NamedTuple of
    tensors, None and such dicts) are read with comprehensions; any other by optree."""
    try:
        if type(tree) is dict:
            made = _mapping(tree, read)
            if made is not _OTHER:  # (_OTHER is no signature: every such dict would have it)
                return made
        if type(tree) is not tuple and isinstance(tree, tuple):  # a NamedTuple: the built-in optimizers' states
            parts = [None if x is None else _mapping(x, read) if type(x) is dict else read(x) for x in tree]
            if all(p is not _OTHER for p in parts):
                return type(tree), parts
        leaves, spec = optree.tree_flatten(tree)
        return spec, list(map(read, leaves))
    except AttributeError:  # a leaf that is not a tensor (an int step count)
        return None


_OTHER = object()  # a dict that is not a plain tree of tensors two levels deep
_DICT_KINDS = {dict}


def _mapping(tree: dict[Any, Any], read: Any) -> Any:
    """A dict of tensors or of dicts of tensors (the parameters and what mirrors them) as
    (its keys, each inner dict's keys, its tensors' shapes and dtypes); _OTHER for any other dict."""
    values = list(tree.values())
    kinds = set(map(type, values))
    if kinds == _DICT_KINDS:
        try:
            return tuple(tree), tuple(map(tuple, values)), list(map(read, [t for v in values for t in v.values()]))
        except AttributeError:  # deeper, or not tensors: read by optree
            return _OTHER
    if dict in kinds or any(k is not type(None) and not hasattr(k, "shape") for k in kinds):
        return _OTHER
    return tuple(tree), None, [None if v is None else read(v) for v in values]

