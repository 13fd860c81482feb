"""What the agreement check compares of the model itself, one item per layer or tensor.

A rank can build a model of the same shapes that computes something else (a ``ReLU`` for a
``GELU``, a ``Dropout(0.5)`` for a ``Dropout(0.0)``, a buffer of other values) or start from other
values (one element of one parameter): every rank then trains a mix of two models, and all report
the same loss. So ``Step.init`` compares, besides the shapes:

* each layer's structure and code (:func:`structure_items`): its parameter, tie and buffer names,
  and the module it calls as ``code_text.module_text`` says it (classes, ``forward``'s code,
  ``extra_repr``, plain attributes), or a hand-written function by its code and closure;
* every buffer's and every parameter's values, exactly (:func:`buffer_items`, :func:`value_items`:
  ``tensor_digest``, a few passes over each tensor, once, at ``init``; a meta tensor has no values
  and is compared by how it is made instead).

Each is a list of items, so that a mismatch names the first layer or tensor that differs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping

import torch

from ..model.chain import Chain, Layer
from ..model.module_call import ThreadReplicas
from .agreement import stable_text, tensor_text
from .code_text import qualified_name

# Each layer's text, made once: a layer's first check sees its modules as functionalize left them,
# and what a run changes in them later (the units' stubs of a split model record which phase ran,
# and a pipeline rank runs only its own stages') must not make ranks that built one model differ.
_TEXTS: weakref.WeakKeyDictionary[Layer, str] = weakref.WeakKeyDictionary()
_TEXTS_LOCK = threading.Lock()  # thread ranks may describe one chain at once


def structure_items(chain: Chain) -> dict[str, str]:
    """Per layer, its parameter, tie and buffer names and the code it runs (no values)."""
    items = {}
    for layer in chain:
        with _TEXTS_LOCK:
            text = _TEXTS.get(layer)
        if text is None:
            text = _layer_text(layer)
            with _TEXTS_LOCK:
                text = _TEXTS.setdefault(layer, text)
        items[f"layer {layer.name!r}"] = text
    return items


def _layer_text(layer: Layer) -> str:
    buffers = ", ".join(f"{n}{list(t.shape)} {t.dtype}" for n, t in layer.buffers.items())
    return (f"params {list(layer.param_names)}, ties {dict(layer.ties)}, buffers [{buffers}]; "
            f"{_function_text(layer.fn)}")


def _function_text(fn: object) -> str:
    # A functionalized module's layer (functionalize's and its split's layer functions) calls a
    # skeleton of the module, on thread replicas: the skeleton says what it computes. Its other
    # attributes are the call's bookkeeping (an example's recorded calls), not the computation.
    replicas = getattr(fn, "replicas", None)
    if isinstance(replicas, ThreadReplicas):
        return f"{qualified_name(type(fn))} of {stable_text(replicas.module)}"
    return stable_text(fn)


def buffer_items(chain: Chain) -> dict[str, str]:
    """Per buffer of each layer (a frozen parameter is one), its shape, dtype and exact digest; of a
    buffer the module does not persist (``register_buffer(..., persistent=False)``: perhaps scratch
    made by ``torch.empty``, whose values differ rank to rank), its shape and dtype only."""
    items = _tensor_items("buffers", ((layer.name, n, t) for layer in chain for n, t in layer.buffers.items()
                                      if n not in getattr(layer.fn, "transient", ())))
    for layer in chain:
        for n in sorted(set(layer.buffers) & set(getattr(layer.fn, "transient", ()))):
            t = layer.buffers[n]
            items[f"buffers[{layer.name!r}][{n!r}]"] = f"tensor(shape={tuple(t.shape)}, dtype={t.dtype})"
    return items


def value_items(params: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """Per parameter, its shape, dtype and exact digest ('meta' for a meta one)."""
    return _tensor_items("params", ((layer, n, t) for layer, named in params.items() for n, t in named.items()))


def _tensor_items(kind: str, tensors: Iterable[tuple[str, str, torch.Tensor]]) -> dict[str, str]:
    seen: dict[int, str] = {}  # a tensor under two names (a buffer every layer holds) is read once
    items = {}
    for layer, name, t in tensors:
        if id(t) not in seen:
            seen[id(t)] = tensor_text(t)
        items[f"{kind}[{layer!r}][{name!r}]"] = seen[id(t)]
    return items
