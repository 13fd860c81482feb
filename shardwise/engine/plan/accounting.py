"""What each layer keeps alive for its backward: measured, or predicted on meta tensors.

Each layer's forward runs once, as the executor runs it (inputs cut at layer
boundaries, gradients on), while every tensor kept for backward is shown to
an observer: autograd's saved tensors through saved-tensor hooks, and what a
layer wrapper keeps by its own means (remat's checkpoint) through
:func:`current_observer`, which such wrappers consult. Each distinct storage
counts once at its full size (a kept view keeps its whole storage). Left out
is what lives regardless: the layer's parameters and buffers, and its output
(the executor holds every output until that layer's backward; a layer's
input is counted when backward keeps it, so summing over layers counts each
boundary activation at most once). What a layer keeps of the batch itself
(the inputs' storages) is told apart by :func:`kept_parts`: micro-batches are
views of one batch, so that memory is kept once however many are in flight.

``predict_kept_for_backward`` runs the same on fake copies of the parameters,
buffers and inputs (torch's FakeTensorMode, through engine/torch_api.py): shapes,
dtypes and kernel choices flow, no arithmetic is done, and the figures equal
the measured ones (a test checks it). A layer that reads data to decide a shape (a plain
mixture-of-experts loop's ``torch.where``) cannot run on fake tensors, nor one with an op whose fake
kernel refuses what its real one runs (``fake_run_errors``): it runs on zero-filled real stand-ins
instead (engine/torch_api.py, ``real_stand_ins``), its figures those of the stand-ins' routing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import optree
import torch

from ..model import reuse as reuse_module
from ..model.chain import Chain
from ..model.split_backward import input_part, recomputes
from ..stack import in_layer
from ..torch_api import fake_run_errors, fake_tensors, is_fake, live_bytes, real_stand_ins, storage_key
from .loss_memory import LossMemory, loss_memory

Observer = Callable[[torch.Tensor], None]

_observer: contextvars.ContextVar[Observer | None] = contextvars.ContextVar("shardwise_kept_observer", default=None)


def current_observer() -> Observer | None:
    """The observer of kept tensors, for layer wrappers that keep tensors outside autograd's hooks."""
    return _observer.get()


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Show ``observer`` every tensor kept for backward by code run inside."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        observer(t)
        return t

    token = _observer.set(observer)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        _observer.reset(token)


def _cut(tree: Any) -> Any:
    """Detach every tensor (a layer boundary); those that required grad (depend on a parameter)
    become leaves that do, as the executor's stage inputs (RoPE's cos and sin do not)."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(t.requires_grad)

    return optree.tree_map(cut, tree)


class KeptParts(NamedTuple):
    """Per layer, the bytes it keeps of its own (``own``) and the storages of the batch it keeps
    (``batch``: storage -> bytes, keys shared by every layer of one call); with ``split=True``, what a
    zero-bubble input pass records of it for the weight pass (``recorded``: the gradients reaching
    its weights' branches, held from I to W; ``model/split_backward.py``)."""

    own: dict[str, int]
    batch: dict[str, dict[int, int]]
    stand_ins: tuple[str, ...] = ()  # the layers that ran on real stand-ins (they read data to decide a shape)
    recorded: Mapping[str, int] = MappingProxyType({})
    loss: LossMemory | None = None  # with ``loss=``: what the loss holds of the chain's output (loss_memory.py)
    # With ``backward=True``, on fake tensors, per layer: the most its backward holds at once beyond what it
    # keeps (the gradients it makes on the way, a recomputation's activations), its weights' gradients left
    # out (``_backward_peak``; below 0 where they are made after what it kept was freed).
    in_backward: Mapping[str, int] = MappingProxyType({})
    # The layers whose backward could not run on fake tensors (it reads a value): their ``in_backward`` is 0.
    backward_unknown: tuple[str, ...] = ()
    # With ``backward=True``, per layer but the last (whose kept output is in ``own``): (the bytes of its output
    # that it keeps itself, a ReLU's result, held to its backward; the bytes of its input that it keeps and that
    # the layer before keeps as its output too). ``own`` leaves a layer's outputs out: where the next layer keeps
    # them they are counted there, from its forward to its backward, which the ReLU's result outlives. Then the
    # bytes of its output's gradient (its output's leaves that need one), which its backward reads.
    kept_outputs: Mapping[str, tuple[int, int, int]] = MappingProxyType({})
    # With ``split=True``, per layer: the part of ``recorded`` that is its output's gradient itself (a weight's
    # branch leaving at the output, or behind ops that pass the gradient on as it is: a residual add), which the
    # backward's figures count at the input pass already (the loss's, a stage's ``in_backward``).
    recorded_output: Mapping[str, int] = MappingProxyType({})

    def totals(self) -> dict[str, int]:
        return {name: n + sum(self.batch[name].values()) for name, n in self.own.items()}


def kept_parts(
    chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], inputs: Any, *, reuse: bool = False,
    split: bool = False, batch_values: Mapping[int, torch.Tensor] | None = None,
    loss: tuple[Callable[[Any, Any], Any], Any] | None = None, backward: bool = False,
) -> KeptParts:
    """:func:`kept_for_backward`, with what each layer keeps of the batch's own storages apart.

    ``reuse`` (on fake tensors only): a layer identical to one run before, on tensors and an input
    like its, is not run again; its figures and output are that one's (``engine/model/reuse.py``:
    a Llama's 80 blocks run once). ``split``: also each layer's ``recorded`` bytes (a zero-bubble
    schedule's), from an input pass run on its graph (a layer whose input needs no gradient has
    none: its stage's weight pass is a whole backward). ``batch_values``: by ``id`` of a fake leaf of
    ``inputs``, the batch's real tensor, which a layer that reads data (and so runs on real stand-ins) reads
    instead of zeros (a forward that trims the batch to its longest row, ``int(mask.sum(1).max())``, read 0
    of a zero mask and failed, where the step runs). ``loss``: ``(loss_fn, targets)``, run on the chain's output
    for what the loss holds of it (``loss_memory.py``; on fake tensors only). ``backward``: each layer's
    ``in_backward`` too, from a run of its backward (on fake tensors only)."""
    own: dict[str, int] = {}
    recorded: dict[str, int] = {}
    recorded_output: dict[str, int] = {}
    in_backward: dict[str, int] = {}
    backward_unknown: list[str] = []
    kept_outputs: dict[str, tuple[int, int, int]] = {}
    before_kept: set[int] = set()  # the storages of the layer before's output that it keeps itself
    of_batch: dict[str, dict[int, int]] = {}
    batch = {storage_key(t) for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, inputs)
    # The batch's real values, by the detached leaves (each kept beside its value: an id alone could be another
    # tensor's once that leaf is freed, a later layer's input taken for the batch).
    given = {id(d): (d, batch_values[id(t)]) for t, d in zip(
        optree.tree_leaves(inputs), optree.tree_leaves(x), strict=True) if batch_values and id(t) in batch_values}
    # Shared by the plans of one search (reuse.sharing_runs): keyed also by ``split`` and the predicted
    # axes' sizes, the batch's storages told apart per call.
    memo = reuse_module.memo_for("accounting.kept_parts") if reuse else None
    own_batch = frozenset(batch)
    around = (split, backward, tuple(sorted((in_layer.predicting_sizes() or {}).items())))
    stand_ins: list[str] = []
    # With the loss: what the last layer keeps of its own output for its backward (a remat policy's cached
    # matmul, a final sigmoid's result) is its own to that backward; the loss holds the rest of it only while
    # it runs (the executor drops the output then). Any other layer's output the executor holds anyway.
    last = chain.names[-1] if loss is not None else None
    outputs_kept: dict[int, int] = {}
    for layer in chain:
        local = {k: v.detach().requires_grad_(True) for k, v in chain.layer_params(params, layer.name).items()}
        base = None if memo is None else memo.key(layer.fn, {**local, **layer.buffers}, x, layer.name, own_batch)
        key = None if base is None or layer.name == last else (base, around)
        found = None if memo is None or key is None else memo.lookup(key, x)
        if found is not None:  # a layer like one run before, on an input like its: it keeps alike
            y, (own[layer.name], kept_inputs, (recorded[layer.name], recorded_output[layer.name]), its_backward,
                (out_leaves, in_leaves)) = found
            if backward:
                in_backward[layer.name] = its_backward
                x_leaves, y_leaves = optree.tree_leaves(x, none_is_leaf=True), optree.tree_leaves(y, none_is_leaf=True)
                kept_outputs[layer.name] = (
                    sum({storage_key(y_leaves[i]): n for i, n in out_leaves.items()}.values()),
                    sum({storage_key(x_leaves[i]): n for i, n in in_leaves.items()
                         if storage_key(x_leaves[i]) in before_kept}.values()),
                    _grad_bytes(y))
                before_kept = {storage_key(y_leaves[i]) for i in out_leaves}
            leaves = optree.tree_leaves(x, none_is_leaf=True)
            of_batch[layer.name] = {storage_key(leaves[i]): n for i, n in kept_inputs.items()}
            x = _cut(y)
            continue
        kept: list[torch.Tensor] = []
        try:
            with torch.enable_grad(), observing(kept.append):
                y = layer(local, x)
        except fake_run_errors():
            if not any(is_fake(t) for t in [*local.values(), *optree.tree_leaves(x)]):
                raise
            kept, memo_ok = [], False
            stand_ins.append(layer.name)
            # It reads data to decide a shape, or an op's fake kernel refuses it: run it on real stand-ins,
            # where a genuine error of the layer is raised again, by the real kernel.
            with real_stand_ins() as real:
                local = {k: real(v).detach().requires_grad_(True) for k, v in local.items()}
                x_real = real(optree.tree_map(lambda t: _batch_value(given, t), x))
                batch |= {storage_key(r) for t, r in zip(optree.tree_leaves(x), optree.tree_leaves(x_real), strict=True)
                          if isinstance(t, torch.Tensor) and storage_key(t) in batch}
                layer = dataclasses.replace(layer, buffers=real(dict(layer.buffers)))
                with torch.enable_grad(), observing(kept.append):
                    y = layer(local, x_real)
                recorded[layer.name], recorded_output[layer.name] = (
                    _recorded_bytes(y, x_real, local, layer.fn) if split else (0, 0))
                y = _cut(y)  # real leaves: the next layer runs on fake tensors again
        else:
            memo_ok = True
            recorded[layer.name], recorded_output[layer.name] = (
                _recorded_bytes(y, x, local, layer.fn) if split else (0, 0))
        outputs = [t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor)]
        resident = {storage_key(t) for t in [*local.values(), *layer.buffers.values()]}
        if layer.name != last:
            resident |= {storage_key(t) for t in outputs}
        sizes = {storage_key(t): t.untyped_storage().nbytes() for t in kept}
        sizes = {key: n for key, n in sizes.items() if key not in resident}
        if layer.name == last:
            outputs_kept = {storage_key(t): sizes[storage_key(t)] for t in outputs if storage_key(t) in sizes}
        own[layer.name] = sum(n for key, n in sizes.items() if key not in batch)
        of_batch[layer.name] = {key: n for key, n in sizes.items() if key in batch}
        if backward:
            all_kept = {storage_key(t): t.untyped_storage().nbytes() for t in kept}
            out_kept = {} if layer.name == last else {
                storage_key(t): all_kept[storage_key(t)] for t in outputs if storage_key(t) in all_kept}
            kept_outputs[layer.name] = (sum(out_kept.values()),
                                        sum(n for k, n in sizes.items() if k in before_kept and k not in batch),
                                        _grad_bytes(y))
            before_kept = set(out_kept)
            leaf_pattern = (_leaf_bytes(y, set(out_kept)), _leaf_bytes(x, set(sizes) - batch))
        if memo_ok and backward:  # (the last use of y's graph: its backward frees it)
            try:
                in_backward[layer.name] = _backward_peak(y, x, local, kept, set(sizes))
            except fake_run_errors():  # a backward that reads a value (a custom Function's clip by .item())
                in_backward[layer.name] = 0
                backward_unknown.append(layer.name)
        del kept
        if key is not None and memo is not None and memo_ok:
            kept_inputs = _as_input_leaves(x, of_batch[layer.name])
            if kept_inputs is not None:
                records = (recorded[layer.name], recorded_output[layer.name])
                memo.store(key, x, y, (own[layer.name], kept_inputs, records,
                                       in_backward.get(layer.name, 0), leaf_pattern if backward else ({}, {})),
                           keep=layer.fn)
        x = _cut(y)
    held_by_loss = None
    if loss is not None:
        loss_fn, targets = loss
        targets_storages = {storage_key(t) for t in optree.tree_leaves(targets) if isinstance(t, torch.Tensor)}
        held_by_loss = loss_memory(loss_fn, x, targets, batch | targets_storages | set(outputs_kept))
    return KeptParts(own, of_batch, tuple(stand_ins), recorded, held_by_loss, in_backward, tuple(backward_unknown),
                     kept_outputs, recorded_output)


def _grad_bytes(y: Any) -> int:
    """Bytes of the gradient of a layer's output: of each leaf that needs one, each storage once."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in optree.tree_leaves(y)
                if isinstance(t, torch.Tensor) and t.requires_grad}.values())


def _leaf_bytes(tree: Any, keys: set[int]) -> dict[int, int]:
    """Leaf index -> bytes, of the leaves of ``tree`` (None a leaf) whose storage is among ``keys``: what a
    layer like this one keeps of its own input or output (for a memo's later hit)."""
    return {i: t.untyped_storage().nbytes() for i, t in enumerate(optree.tree_leaves(tree, none_is_leaf=True))
            if isinstance(t, torch.Tensor) and storage_key(t) in keys}


def _batch_value(given: Mapping[int, tuple[torch.Tensor, torch.Tensor]], t: Any) -> Any:
    """The batch's real value of ``t`` (a detached leaf of the first layer's input), else ``t``."""
    entry = given.get(id(t)) if isinstance(t, torch.Tensor) else None
    return entry[1] if entry is not None and entry[0] is t else t


def _recorded_bytes(y: Any, x: Any, local: Mapping[str, torch.Tensor], fn: Any) -> tuple[int, int]:
    """Bytes of the gradients an input pass records for the weight pass on this layer's graph (each
    storage once), seeded with gradients of the outputs' shapes, and of those the seeds themselves (the
    output's gradient, recorded as it came); none for a layer that recomputes in its backward (its weight
    pass is taken whole)."""
    outputs = [t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs = [t for t in optree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad]
    weights = [t for t in local.values() if t.requires_grad]
    if not outputs or not inputs or not weights or recomputes([fn]):
        return 0, 0
    seeds = [torch.ones_like(o) for o in outputs]
    _, part = input_part(outputs, seeds, inputs, weights)
    sizes = {storage_key(g): g.untyped_storage().nbytes()
             for group in part.groups for got in group.grads for g in got or () if g is not None}
    seeded = {storage_key(t) for t in seeds}
    return sum(sizes.values()), sum(n for key, n in sizes.items() if key in seeded)


def _backward_peak(
    y: Any, x: Any, local: Mapping[str, torch.Tensor], kept: list[torch.Tensor], counted: set[int]
) -> int:
    """On fake tensors: the most a layer's backward holds at once beyond what its forward kept (``kept``, the
    storages in ``counted`` of it: the list is emptied, so that autograd frees each as its backward is done
    with it) and its outputs' gradients, seeded with gradients of the outputs' shapes: the gradients it makes
    on the way (of its intermediates, of its input), a recomputation's activations (remat's), less its
    weights' gradients, which the Plan counts as made at that backward already: below 0 where its most comes before
    they are all made, what it kept freed by then (an embedding's gradient, made last). 0 on real tensors (no memory
    is spent to predict it)."""
    outputs = [t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not all(is_fake(t) for t in outputs):
        return 0
    weights = [t for t in local.values() if t.requires_grad]
    wrt = [t for t in optree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.requires_grad] + weights
    if not wrt:
        return 0
    seeds = [torch.ones_like(o) for o in outputs]  # the outputs' gradients: the next layer's (or the loss's) making
    with live_bytes() as seen:
        for t in kept:
            if storage_key(t) in counted:
                seen.hold(t)
        kept.clear()
        start = seen.live
        grads = torch.autograd.grad(outputs, wrt, seeds, allow_unused=True)
        made = sum({storage_key(g): g.untyped_storage().nbytes() for g in grads[len(wrt) - len(weights):]
                    if g is not None}.values())
        del grads
    return seen.peak - start - made


def _as_input_leaves(x: Any, kept: Mapping[int, int]) -> dict[int, int] | None:
    """The kept batch storages as indices of ``x``'s leaves (what a layer like this one keeps of
    its own input), or None when one is not among them."""
    first: dict[int, int] = {}
    for i, t in enumerate(optree.tree_leaves(x, none_is_leaf=True)):
        if isinstance(t, torch.Tensor):
            first.setdefault(storage_key(t), i)
    if any(key not in first for key in kept):
        return None
    return {first[key]: n for key, n in kept.items()}


def kept_for_backward(
    chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], inputs: Any
) -> dict[str, int]:
    """Bytes each layer keeps alive for its backward on ``inputs``, by layer name (see the module
    docstring)."""
    return kept_parts(chain, params, inputs).totals()


def predict_kept_for_backward(
    chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], inputs: Any
) -> dict[str, int]:
    """``kept_for_backward`` on fake copies (shapes, dtypes and kernel choices only): the same figures,
    computed without touching data."""
    return predict_kept_parts(chain, params, inputs).totals()


def predict_kept_parts(
    chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], inputs: Any, *, reuse: bool = True,
    split: bool = False, loss: tuple[Callable[[Any, Any], Any], Any] | None = None, backward: bool = False,
) -> KeptParts:
    """:func:`kept_parts` on fake copies (see :func:`predict_kept_for_backward`), identical layers
    run once unless ``reuse=False``; ``split``: with each layer's ``recorded`` bytes; ``loss``:
    ``(loss_fn, targets)``, with what the loss holds (``KeptParts.loss``); ``backward``: with each layer's
    ``in_backward``."""
    # Meta parameters (a meta-built model) are predicted on the device the batch is on.
    device = next((t.device for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), "cpu")
    with fake_tensors(device) as fake:
        fake_chain = Chain(
            [dataclasses.replace(layer, buffers={k: fake(v) for k, v in layer.buffers.items()}) for layer in chain]
        )
        fake_params = {layer: {k: fake(t) for k, t in tensors.items()} for layer, tensors in params.items()}
        fake_inputs = optree.tree_map(fake, inputs)
        values = {id(f): t for f, t in zip(optree.tree_leaves(fake_inputs), optree.tree_leaves(inputs), strict=True)
                  if isinstance(t, torch.Tensor) and not is_fake(t) and t.device.type != "meta"}
        faked_loss = None if loss is None else (loss[0], optree.tree_map(fake, loss[1]))
        return kept_parts(fake_chain, fake_params, fake_inputs, reuse=reuse, split=split, batch_values=values,
                          loss=faked_loss, backward=backward)
