"""Targets shifted inside a rank's part of the sequence: the two cases context_parallel can see, refused.

A causal LM's loss pairs the logits at position t with the token at t + 1. Shifted on the whole sequence
before the step (``inputs = ids[:, :-1]``, ``targets = ids[:, 1:]``), each rank's part of the targets is
its part of the next tokens, and the loss is the whole sequence's. A loss that shifts the labels itself
(transformers' ``ForCausalLMLoss``: a causal LM's ``model.loss_function``) shifts inside each rank's part
instead: the last token of a chunk is paired with the first of the next chunk the rank holds, not its
neighbour's, and every part loses a target, without an error (a Llama of 16 tokens at cp 2: the loss off
by 2e-3 relative). Refused are the loss function (:func:`refuse_shifting_loss`, when context_parallel is
applied) and targets that are the input ids themselves (:func:`refuse_targets_equal_to_inputs`, when the
batch is cut), which only a loss that shifts can mean. A loss of one's own that shifts labels padded
with ``-100`` is seen by neither.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import nn

_FIX = (
    "Shift on the whole sequence before the step (inputs = ids[:, :-1], targets = ids[:, 1:]) and use a loss_fn "
    "that does not shift: F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()), or transformers' "
    "ForCausalLMLoss(out.logits, None, vocab_size, shift_labels=targets.contiguous())"
)

# Batch dict entries that are integers and no token ids.
_NOT_TOKENS = frozenset({"attention_mask", "position_ids", "token_type_ids"})


def refuse_shifting_loss(loss_fn: Callable[..., Any]) -> None:
    """Refuse a loss_fn that is transformers' ForCausalLMLoss (itself, a partial of it, under another
    transform's loss wrapper) or whose own code calls it (imported, a module's attribute, or a model's
    ``loss_function``) without ``shift_labels=``."""
    if "transformers" not in sys.modules:  # transformers is not loaded: the loss cannot be one of its
        return
    try:  # loaded on its first use: a loss_fn that calls it has not run yet
        loss_utils = importlib.import_module("transformers.loss.loss_utils")
    except ImportError:
        return
    shifting = getattr(loss_utils, "ForCausalLMLoss", None)
    if shifting is None:
        return
    for fn in _unwrapped(loss_fn):
        if fn is shifting:
            how = "is"
        elif _calls(fn, shifting):
            how = "calls"
        else:
            continue
        shown = next(f for f in _unwrapped(loss_fn) if not type(f).__module__.startswith("shardwise."))
        raise ValueError(
            f"context_parallel: the step's loss_fn {_name(shown)} {how} transformers' ForCausalLMLoss (a causal "
            "LM's model.loss_function), which shifts the labels by one itself: under context_parallel it would "
            "shift inside each rank's part of the sequence (a wrong target at every part's end, the boundary "
            f"targets lost, without an error). {_FIX}"
        )


def _unwrapped(fn: Any) -> Iterator[Any]:
    """``fn`` and what it wraps: a partial's function, a bound method's, ``functools.wraps``' original, and
    the loss another transform's wrapper holds as ``loss_fn`` (tensor_parallel's, router_aux_loss')."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        fn = fn.func if isinstance(fn, functools.partial) else next(
            (inner for a in ("__func__", "__wrapped__", "loss_fn") if (inner := _attribute(fn, a)) is not None), None
        )


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or None where it has none (or its lookup fails: a lazy module, a property of the user's)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _calls(fn: Any, shifting: Any) -> bool:
    """Whether ``fn``'s code names ``shifting`` (a global, a closure's cell, an attribute of a module it names,
    or the ``loss_function`` of a model it names) and passes no ``shift_labels=``: what a look at the code
    shows without running it (not what the functions it calls do)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    names = _names(code)
    if "shift_labels" in names:  # the labels come shifted (on the whole sequence): nothing shifts them again
        return False
    scope = getattr(fn, "__globals__", {})
    found = [scope[n] for n in names if n in scope]
    found += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _filled(cell)]
    seen: set[int] = set()
    for obj in found:  # grows: a module's attributes the code names (transformers.loss.loss_utils...)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):  # by getattr: a lazy module (transformers) resolves on first read
            found += [a for n in sorted(names) if not n.startswith("__") and (a := _attribute(obj, n)) is not None]
        elif isinstance(obj, nn.Module) and "loss_function" in names:
            found.append(_attribute(obj, "loss_function"))
    return any(inner is shifting for obj in found for inner in _unwrapped(obj))


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it read, with the strings among its constants (keyword
    argument names)."""
    names = {*code.co_names, *code.co_varnames}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
        elif isinstance(const, str):
            names.add(const)
        elif isinstance(const, tuple):
            names |= {c for c in const if isinstance(c, str)}
    return names


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_name(fn.func)}, ...)"
    return repr(getattr(fn, "__qualname__", None) or type(fn).__name__)


def refuse_targets_equal_to_inputs(pair: Any, dim: int) -> None:
    """Refuse a batch ``(inputs, targets)`` whose targets are an input's token ids, the same tensor or equal
    to it: the loss must then shift them, inside each rank's part. Equal targets whose every sequence holds
    one token throughout are let pass: they are also that sequence shifted on the whole."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        return
    inputs, targets = pair
    paths, leaves, _ = optree.tree_flatten_with_path(inputs, none_is_leaf=False)
    # (an input named as labels or targets, nanoGPT's `targets` for its own loss, is the targets handed to the model:
    # equal to the batch's targets it says nothing of who shifts them; the token ids it is compared with do)
    tokens = [(_path(p), x) for p, x in zip(paths, leaves, strict=True)
              if _is_ids(x) and not (p and (p[-1] in _NOT_TOKENS or _names_targets(p[-1])))]
    target_paths, target_leaves, _ = optree.tree_flatten_with_path(targets, none_is_leaf=False)
    for target_path, target in zip(target_paths, target_leaves, strict=True):
        if not _is_ids(target):
            continue
        for where, ids in tokens:
            same = target is ids
            if same or (_alike(target, ids, dim) and bool(torch.equal(target, ids))):
                raise ValueError(
                    f"context_parallel: the batch's targets{_path(target_path)} "
                    f"{'are the very tensor' if same else 'equal'} inputs{where}, so the loss must shift them by "
                    "one itself, which under context_parallel happens inside each rank's part of the sequence (a "
                    "wrong target at every part's end, the boundary targets lost, without an error). "
                    f"{_FIX}"
                )


def _names_targets(key: Any) -> bool:
    return isinstance(key, str) and ("label" in key.lower() or "target" in key.lower())


def _is_ids(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def _alike(a: torch.Tensor, b: torch.Tensor, dim: int) -> bool:
    """Same shape and dtype, holding values (not a meta or fake tensor: the Plan's), and some sequence not one
    token throughout (those equal their own shift)."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor or a.is_meta or b.is_meta:
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.dim() <= dim:
        return False
    return bool((b != b.narrow(dim, 0, 1)).any())


def _path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)
