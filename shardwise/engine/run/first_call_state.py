"""State a layer's first call sets from its input's values, refused where the step cuts the batch.

A forward may set its module's state once, from its input: an ActNorm-style lazy initialization
(``if self.scale is None: self.scale = x.detach().std(0)``), a list of batch statistics it appends to. torch's
loop sets it from the whole batch; a step that cuts the batch (data parallel and ZeRO, accumulation, a
pipeline's micro-batches, a split's shares of the batch or of the sequence) calls the layer first on a
share, and sets it from that share: each rank its own value, every micro-batch after the first reading the
first one's. The step trains another model without an error. State a call sets from its input's SHAPE (a
cache of the sequence length, Hugging Face's rotary ``max_seq_len_cached``) is the same on every share and
must pass. (forward_state.py refuses state a call changes AGAIN within a step; this is its first change.)

How the two are told apart: a probe. Before a layer's first call on each thread (where the batch is cut),
:func:`module_before` copies the module (its skeleton: registered tensors are meta and shared, plain
attributes copied). If the call changed the module's plain attributes (forward_state.python_state), the copy,
still as the module was, runs the layer's call again on an input of the same structure, shapes and dtypes
whose floating-point tensors hold other values, and whose integer ones (token ids, labels) hold others of
their own values (so an index stays in range), save those whose values follow from the shape (positions, an
arange along the last dim) and 0/1 masks, which stay; on copies of the call's parameters and buffers, with
the random generators put back after it and no collective run (a split's are predicted, moving nothing).
An attribute whose value then differs from what the real call set came from the input's values (or from
random numbers): refused, naming the layer, the attribute and the fix. Neither the user's module, the
layer's copy of it nor the step's tensors see the probe. Not judged (a gap): a layer whose module a split
rewrote (tensor parallel installs forwards that call the module itself, which a copy cannot stand in for), a
module that refuses copy.copy (a parametrized one), state first set on a later step, and state set from the
values of a bool or 0/1 mask or of positions alone.

Why not compare the ranks' values: under accumulation one rank's later micro-batches never set it again (a
lazy initialization runs once), and a pipeline's stages hold different layers; a probe sees every cut alike,
with no collective, so no rank waits on another and all refuse alike (each rank's probe sees its own
share's values differ from random ones). Cost: a copy of each layer's module skeleton on its first call on
each thread, and a walk of its attributes; a second run of the call only where its attributes changed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optree
import torch
from torch import nn

from ...collectives.mesh_context import no_mesh
from ..model.chain import Layer
from ..model.module_call import module_fn, own_hook_dicts
from ..model.predicted_state import state_holder
from ..stack import in_layer
from .forward_state import python_state, readable, same_state, watched
from .rng import default_generators, untouched

_SEED = 0x5EED  # the probe's other values: any fixed stream, so a refusal is reproducible


def module_before(layer: Layer) -> nn.Module | None:
    """A copy of this thread's module of ``layer`` as it is now (its registered tensors shared, its other
    attributes copied), to probe with after the call; None for a layer of a plain function."""
    return module_copy(layer.fn)


def module_copy(layer_fn: Any) -> nn.Module | None:
    """:func:`module_before` of a layer's function (the module it calls, through other transforms' wrappers)."""
    fn = module_fn(layer_fn)
    if fn is None:
        return None
    module = fn.replicas.get().module
    if any("forward" in vars(sub) for sub in module.modules()):
        # A split (tensor, context, expert parallel) installed forwards that call the module they were
        # installed on, not a copy: the probe cannot run such a layer on a copy, so it is not judged (a gap).
        return None
    registered = {id(t): t for t in (*module.parameters(), *module.buffers())}
    try:
        return _twin(module, registered, {})
    except (RuntimeError, TypeError, copy.Error, NotImplementedError):
        return None  # a module that refuses a copy (a parametrized one: weight_norm's): not judged (a gap)


def _twin(module: nn.Module, registered: dict[int, Any], seen: dict[int, nn.Module]) -> nn.Module:
    """``module`` copied submodule by submodule: each a shallow copy with its own parameter, buffer and
    submodule dicts (the same tensors), its attributes forward_state watches copied (a forward may change
    a list in place), the others shared (a config object: a deep copy of the whole model's skeleton cost
    90 ms for GPT-2's embed layer, this well under 1 ms)."""
    if id(module) in seen:  # a submodule under two names stays one module
        return seen[id(module)]
    twin = copy.copy(module)
    seen[id(module)] = twin
    own_hook_dicts(twin)  # (a hook the probe's call puts on the twin stays off the module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {k: None if v is None else _twin(v, registered, seen) for k, v in module._modules.items()}
    for key, value in vars(module).items():
        if watched(key, value):
            vars(twin)[key] = _copied(value, registered)
    return twin


def _copied(value: Any, registered: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or not readable(value):
            return value  # (sparse: kept as it is; a view of freed storage: forward_state.readable)
        return value.clone()
    if not isinstance(value, (list, dict, tuple, collections.deque)) and not state_holder(value):
        return value  # a number or a string: immutable
    try:
        return copy.deepcopy(value, dict(registered))
    except (TypeError, copy.Error, RuntimeError, NotImplementedError):
        # (holding a lock, say): shared, so a change in place is not seen on the first call (as before)
        return copy.copy(value)


def refuse_state_from_values(layer: Layer, call: Callable[[Any], Any], given: Any, unset: nn.Module,
                             cut: str, sizes: Mapping[str, int]) -> None:
    """Refuse when ``layer``'s first call (``call`` on ``given``) set its module's plain attributes from
    ``given``'s values; ``unset`` is :func:`module_before`'s copy, ``cut`` the batch's cut in words, ``sizes``
    the mesh's axes ({axis: ranks}) that a split's layers ask while they predict. An attribute the forward only
    writes (``self.last_attn = a.detach()``, for plotting) is refused too: whether anything reads it cannot be told
    safely (noting the reads of a further call missed reads through a back-reference to the module, through
    ``self.__dict__``, and behind a call counter, each of which trained another model)."""
    fn = module_fn(layer.fn)
    module = fn.replicas.get().module
    before, after = python_state(unset), python_state(module)
    changed = sorted(k for k in before.keys() | after.keys()
                     if k not in before or k not in after or not same_state(before[k], after[k]))
    if not changed:
        return
    try:
        with fn.replicas.probing(unset), generators_kept(given), no_collectives(sizes):
            call(_other_values(given))
    except Exception as err:
        raise ValueError(_message(layer.name, changed, cut, probed=False)) from err
    again = python_state(unset)
    from_values = [k for k in changed if (k in again) != (k in after)
                   or (k in after and not same_state(again[k], after[k]))]
    if from_values:
        raise ValueError(_message(layer.name, from_values, cut, probed=True))


@contextlib.contextmanager
def no_collectives(sizes: Mapping[str, int]) -> Iterator[None]:
    """No collective runs in the block: a split's (tensor, context, expert parallel) are predicted, shaped as
    in the run and moving nothing (as in the Plan's prediction, here on real tensors), any other raises."""
    with in_layer.predicting(sizes) if sizes else contextlib.nullcontext(), no_mesh():
        yield


def _message(name: str, attributes: list[str], cut: str, probed: bool) -> str:
    found = (
        f"layer {name!r} set its module's attributes {attributes} on its first call from its input's values "
        "(a call on other values of the same shape sets them otherwise)" if probed else
        f"layer {name!r} changed its module's attributes {attributes} on its first call, and running that call "
        "again on other values of the same shape, to tell whether they come from the input's values or its "
        "shape alone, failed (see the error above)"
    )
    return (
        f"{found}: this step cuts the batch ({cut}), so the first call sees one share of it and sets the state "
        "from that share (each rank from its own, later micro-batches reading the first one's), where torch's "
        "loop sets it from the whole batch: the step would train another model. Initialize the state before "
        "wrapping the model (call the model once on a full batch before functionalize), or make it a buffer or "
        "parameter set at init; or train without cutting the batch (one device, no accumulation or pipeline)"
    )


def _other_values(given: Any) -> Any:
    """``given`` with every floating-point tensor replaced by random values of its shape, dtype and device, and
    every integer tensor whose values are not a function of its shape (:func:`_kept_integers`) by values drawn
    from its own."""
    g = torch.Generator().manual_seed(_SEED)

    def other(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype=t.dtype, device=t.device)
        if t.dtype in _INTEGERS and not _kept_integers(t):
            return _other_integers(t, g)
        return t

    return optree.tree_map(other, given, none_is_leaf=True)


_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # bool is a mask: kept


def _kept_integers(t: torch.Tensor) -> bool:
    """Whether integer ``t`` keeps its values in the probe: positions (one arange along its last dim, every
    row alike, as ``position_ids`` and ``cache_position``), whose values follow from the shape (dynamic RoPE's
    ``position_ids.max() + 1`` is a cache of the length and must pass; rows of other offsets are not: their
    max differs between shares of the batch), and 0/1 masks (an attention mask: another could mask a whole
    row, and a lazy state is not read from a mask in practice; a gap)."""
    if t.numel() == 0:
        return True
    if t.dim() >= 1 and t.shape[-1] >= 2:
        rows = t.reshape(-1, t.shape[-1])
        if bool((rows.diff(dim=-1) == 1).all()) and bool((rows == rows[0]).all()):
            return True
    return bool(((t == 0) | (t == 1)).all())


def _other_integers(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Other values for integer ``t`` (token ids, labels, counts' indices): each element one of ``t``'s own
    values, drawn at random, so an index stays in range and a label's ignore value (-100) stays one; its min and
    max alone would let a label be -50. Where the draw gives ``t`` again (a small tensor), each value becomes the
    next larger one of its values (the largest the smallest)."""
    values = torch.unique(t.detach()).cpu()
    if values.numel() < 2:
        return t  # one value: nothing else to draw from (a constant follows from the shape)
    drawn = values[torch.randint(values.numel(), t.shape, generator=g)].to(t.device)
    if torch.equal(drawn, t):
        drawn = values.roll(-1).to(t.device)[torch.searchsorted(values.to(t.device), t)]
    return drawn


@contextlib.contextmanager
def generators_kept(given: Any) -> Iterator[None]:
    """The probe's random draws (a dropout's) leave the generators the step draws from as it found them."""
    devices = {t.device for t in optree.tree_leaves(given) if isinstance(t, torch.Tensor)}
    gens = [g for d in devices if d.type != "cpu" for g in default_generators(d)]
    states = [g.get_state() for g in gens]
    try:
        with untouched():
            yield
    finally:
        for g, s in zip(gens, states, strict=True):
            g.set_state(s)
