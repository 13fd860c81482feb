"""Whether a state was made for the step's model: a checkpoint's buffers and frozen parameters come from
the step (the chain holds them, the state does not: buffers.py), its parameters from the state. Given a
state of another model of the same shapes (a teacher's state with the student's step, two runs of a
sweep), ``save`` would write one model's trained weights beside the other's frozen ones, and the
checkpoint would load without complaint into a model that computes neither.

The state's layout names the chain it was made for (``StateLayout.model``: the step's whose init or load made it,
or whose call last returned it, run_inputs.py). Another chain whose
persistent buffers and frozen parameters hold the same values writes the same checkpoint (the same
module functionalized again, whose tensors are the module's own, or a copy of it): only one whose values
differ is refused. A layout whose chain is gone, or that was pickled, names none, and is not checked.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout.state import TrainState
from ..model.chain import Chain
from ..model.materialize import is_stand_in
from .names import state_dict_names


def other_model(step: Any, state: TrainState) -> str | None:
    """Why ``state`` cannot be written with ``step``'s buffers and frozen parameters: it was made for a
    model whose values of them differ (the first such key, both values' summary); None otherwise."""
    tag = getattr(state.layout, "model", None)
    made_for = getattr(tag, "chain", None)
    chain = step.base_chain
    if not isinstance(made_for, Chain) or made_for is chain:
        return None
    ours, theirs = state_dict_names(chain).buffers, state_dict_names(made_for).buffers
    for key in sorted(set(ours) | set(theirs)):
        if key not in ours or key not in theirs:
            side = "the state's" if key in theirs else "this step's"
            return _refusal(key, f"only {side} model has it")
        mine, its = chain[ours[key][0]].buffers[ours[key][1]], made_for[theirs[key][0]].buffers[theirs[key][1]]
        if is_stand_in(mine) and not is_stand_in(its):
            return _unfilled(key)
        difference = _differs(mine, its)
        if difference:
            return _refusal(key, difference)
    return None


def _differs(mine: torch.Tensor, its: torch.Tensor) -> str | None:
    """How two tensors differ, or None where they are equal or cannot be compared (a meta stand-in)."""
    if mine is its or mine.is_meta or its.is_meta:
        return None
    if mine.shape != its.shape or mine.dtype != its.dtype:
        return f"the state's model holds a {its.dtype} {list(its.shape)}, this step's a {mine.dtype} {list(mine.shape)}"
    its = its.to(mine.device)
    same = mine == its
    if mine.is_floating_point() or mine.is_complex():
        same |= mine.isnan() & its.isnan()  # (a NaN in a buffer is the same NaN in a copy)
    if bool(same.all()):
        return None
    return f"{int((~same).sum())} of its {mine.numel()} values differ"


def _unfilled(key: str) -> str:
    return (
        f"this step's frozen (requires_grad=False) parameter {key!r} holds no values: the step was split from a "
        "model built on the meta device, whose frozen parameters are filled by the init or load that makes a "
        "state (sw.checkpoint.init_from_pretrained, init_from_state_dict, init_from_dcp, load) into its own "
        "chain, and this step made none: the state was made by another step (another functionalize of the same "
        "module). Pass the step that made the state (the one whose init or last call returned it, or a load into "
        "it)"
    )


def _refusal(key: str, difference: str) -> str:
    return (
        f"this TrainState was made for another model than this step's (by the step that made it, or last stepped "
        f"it): buffer or frozen parameter {key!r} "
        f"differs ({difference}). A checkpoint (and a state_dict) takes the buffers and frozen "
        "(requires_grad=False) parameters from the step and the trained parameters from the state, so it would "
        "hold two models' weights; pass "
        "the step that made the state (the one whose init or last call returned it, or a load into it)"
    )
