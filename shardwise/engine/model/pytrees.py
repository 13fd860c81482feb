"""Layer outputs as pytrees: Hugging Face ``ModelOutput`` and dataclasses flatten in optree.

The engine finds the tensors a layer passes on with ``optree.tree_leaves`` and
rebuilds inputs with ``optree.tree_map``, both in optree's default (global)
namespace. optree flattens tuples, lists, dicts, OrderedDicts and named tuples
by itself, but a ``ModelOutput`` (an OrderedDict subclass that is also a
dataclass) or any other dataclass is one opaque leaf: a loss on ``out.logits``
would then reach no tensor the engine knows about, and nothing would train.

:func:`register_output_types` registers, in optree's global namespace, the
classes of the ``ModelOutput`` and dataclass instances it meets in a layer's
output (``functionalize``'s layers call it on every output), so they flatten
into their tensors and ``tree_map`` rebuilds a real instance: the loss still
gets a ``ModelOutput`` and ``out.logits`` / ``out["logits"]`` work. This is what
transformers itself does for ``torch.utils._pytree``.

What counts as safe to register:

* a ``ModelOutput``: flattened over its set fields (``keys()``, the fields that
  are not None), rebuilt with ``cls(**fields)``, as transformers does;
* a dataclass whose every field is an ``__init__`` argument, and which
  rebuilt from its fields gives back the very same field values (checked on
  the first instance met: a ``__post_init__`` that transforms its inputs would
  make ``tree_map`` change values, so such a class stays a leaf).

Registration is global (every optree user in the process sees these classes as
nodes) and happens once per class, under a lock.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import optree
from torch import Tensor

__all__ = ["GLOBAL_NAMESPACE", "float_leaves", "register_output_types", "unregistered_reason"]

# optree registers its built-in containers in a global namespace that is spelled only by this
# module-level sentinel ("" is refused as a namespace name). tests/engine/test_functionalize_hf.py
# fails if optree moves it.
GLOBAL_NAMESPACE: Any = getattr(optree.registry, "__GLOBAL_NAMESPACE")

_LOCK = threading.Lock()
_REFUSED: dict[type, str] = {}  # dataclasses left as leaves, and why


def float_leaves(tree: Any) -> list[Tensor]:
    """The floating-point (or complex) tensors of ``tree``, in pytree order."""
    return [
        t
        for t in optree.tree_leaves(tree)
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
    ]


def register_output_types(tree: Any) -> Any:
    """Register the ModelOutput / dataclass classes found in ``tree`` as optree nodes; return ``tree``.

    >>> import dataclasses, optree, torch
    >>> @dataclasses.dataclass
    ... class Out:
    ...     logits: torch.Tensor
    >>> out = register_output_types(Out(torch.ones(2)))
    >>> optree.tree_leaves(out)
    [tensor([1., 1.])]
    """
    if isinstance(tree, Tensor):  # the usual layer output: nothing to look through
        return tree
    while True:
        new = [
            leaf
            for leaf in optree.tree_leaves(tree)
            if _is_candidate(leaf) and type(leaf) not in _REFUSED
        ]
        if not new:
            return tree
        for leaf in new:
            _register(leaf)


def plain_batch(batch: Any) -> Any:
    """``batch`` with every Mapping that optree does not flatten made a plain ``dict``: where a batch or
    an example input enters (a step's call, its plan, search, functionalize's ``example_input``).

    Why: a ``transformers.BatchEncoding`` (what a tokenizer, ``tokenizer.pad`` and the data collators
    return) is a ``collections.UserDict``: a Mapping, so a dict batch of inputs, but one optree leaf,
    so the capture's input structure, the cut into shares, the batch's fingerprint and the padded-label
    scan would each see one opaque object instead of its tensors. A batch holding no such Mapping is
    returned as it is (one flatten)."""
    if not any(isinstance(leaf, Mapping) for leaf in optree.tree_leaves(batch)):
        return batch
    return optree.tree_map(lambda leaf: plain_batch(dict(leaf)) if isinstance(leaf, Mapping) else leaf, batch)


def is_model_output(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``ModelOutput`` (without importing transformers)."""
    model_output = _model_output_class()
    return model_output is not None and isinstance(value, model_output)


def unregistered_reason(value: Any) -> str | None:
    """Why ``value``'s class stays an opaque leaf, if it was refused registration."""
    return _REFUSED.get(type(value))


def _is_candidate(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _model_output_class() -> type | None:
    generic = sys.modules.get("transformers.utils.generic")  # never import transformers ourselves
    return getattr(generic, "ModelOutput", None)


def _register(instance: Any) -> None:
    cls = type(instance)
    model_output = _model_output_class()
    with _LOCK:
        if optree.register_pytree_node.get(cls) is not None or cls in _REFUSED:
            return  # another thread got here first
        flatten: Callable[[Any], tuple[list[Any], tuple[str, ...], tuple[str, ...]]]
        if model_output is not None and isinstance(instance, model_output):
            flatten, unflatten = _model_output_flatten, _rebuild(cls)
            entry: type[optree.PyTreeEntry] = optree.MappingEntry
        else:
            reason = _dataclass_refusal(instance)
            if reason is not None:
                _REFUSED[cls] = reason
                return
            flatten, unflatten = _dataclass_flatten, _rebuild(cls)
            entry = optree.GetAttrEntry
        optree.register_pytree_node(
            cls,
            flatten,
            unflatten,  # type: ignore[arg-type]
            path_entry_type=entry,
            namespace=GLOBAL_NAMESPACE,
        )


def _model_output_flatten(out: Any) -> tuple[list[Any], tuple[str, ...], tuple[str, ...]]:
    keys = tuple(out.keys())
    return [out[k] for k in keys], keys, keys


def _dataclass_flatten(obj: Any) -> tuple[list[Any], tuple[str, ...], tuple[str, ...]]:
    names = tuple(f.name for f in dataclasses.fields(obj))
    return [getattr(obj, n) for n in names], names, names


def _rebuild(cls: type) -> Callable[[tuple[str, ...], Any], Any]:
    def unflatten(names: tuple[str, ...], children: Any) -> Any:
        return cls(**dict(zip(names, children, strict=True)))

    unflatten.__qualname__ = f"rebuild_{cls.__name__}"
    return unflatten


def _dataclass_refusal(obj: Any) -> str | None:
    cls = type(obj)
    not_init = [f.name for f in dataclasses.fields(obj) if not f.init]
    if not_init:
        return f"{cls.__name__} has fields {not_init} that __init__ does not take"
    children, names, _ = _dataclass_flatten(obj)
    try:
        rebuilt = _rebuild(cls)(names, children)
    except Exception as e:
        return f"{cls.__name__}(**fields) fails ({type(e).__name__}: {e})"
    changed = [n for n, v in zip(names, children, strict=True) if getattr(rebuilt, n) is not v]
    if changed:
        return f"{cls.__name__}(**fields) does not give back fields {changed} unchanged (a __post_init__?)"
    return None
