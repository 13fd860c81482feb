"""Which layers call an embedding op with ``scale_grad_by_freq=True`` themselves, outside an ``nn.Embedding``.

``nn.Embedding(scale_grad_by_freq=True)`` is told by its attribute (``embedding_options.grad_by_frequency``).
A forward may make the same call itself: ``F.embedding(idx, self.weight, scale_grad_by_freq=True)``,
``torch.embedding(..., scale_grad_by_freq=True)``, ``F.embedding_bag(...)``. Its backward divides each row's
gradient by how often the batch looks the row up, a statistic of the whole batch, so a step that cuts the
batch must refuse it as it refuses the module form (``whole_batch.py``: FREQUENCIES). No attribute tells such a
call: it is seen where a layer runs anyway, never by running a forward once more (a forward's Python may count
its calls):

* in functionalize's check on an example input (:func:`watching` around each layer's call): what is found is
  kept on the layer's module fn (:func:`keep`: ``frequency_calls``, the module's path in the model -> the call
  in words), read by ``whole_batch.over_whole_batch``, so the transform that cuts the batch refuses it when it
  is added;
* where no example input ran (functionalize without one, a meta-built model's unit reused from an identical
  one): at a step that cuts the batch, around each layer's first call on each rank (``engine/run/
  frequency_watch.py``), which refuses at the op itself with the same words.

A TorchFunctionMode sees every op with its arguments; forward hooks tell the module whose forward runs it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from .module_call import module_fn
from .whole_batch import called_modules

# op -> (its name in a message, the position of scale_grad_by_freq among its arguments)
_OPS: dict[Callable[..., Any], tuple[str, int]] = {
    F.embedding: ("F.embedding", 5),
    F.embedding_bag: ("F.embedding_bag", 5),
    torch.embedding: ("torch.embedding", 3),
    torch.embedding_bag: ("torch.embedding_bag", 3),
    torch._embedding_bag: ("torch._embedding_bag", 3),
}


def _aten_ops() -> dict[Any, tuple[str, int]]:
    """The aten ops themselves (``torch.ops.aten.embedding(weight, idx, -1, True)``): a TorchFunctionMode sees
    the packet or the overload called, each with scale_grad_by_freq fourth, as torch.embedding has it."""
    ops: dict[Any, tuple[str, int]] = {}
    for name in ("embedding", "embedding_bag", "_embedding_bag"):
        packet = getattr(torch.ops.aten, name)
        ops[packet] = (f"torch.ops.aten.{name}", 3)
        for overload in packet.overloads():
            ops[getattr(packet, overload)] = (f"torch.ops.aten.{name}.{overload}", 3)
    return ops


_OPS.update(_aten_ops())

# the calling module's path in the model -> the call in words ("F.embedding(..., scale_grad_by_freq=True) in
# Lookup.forward"); the model's root is named by its layer's name, as in whole_batch.called_modules
FrequencyCalls = dict[str, str]


def frequency_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """``"F.embedding(..., scale_grad_by_freq=True)"`` when ``func(*args, **kwargs)`` scales its rows'
    gradients by their counts in the batch; None otherwise."""
    known = _OPS.get(func)
    if known is None:
        return None
    name, position = known
    scaled = kwargs.get("scale_grad_by_freq", args[position] if len(args) > position else False)
    return f"{name}(..., scale_grad_by_freq=True)" if scaled is True else None


class _Watch(TorchFunctionMode):
    """Records each frequency-scaled call with the innermost module running it (``running``), and hands it
    to ``on_call`` (path, call in words) at once, before the op runs."""

    def __init__(self, running: Callable[[], tuple[str, str]],
                 on_call: Callable[[str, str], None] | None = None) -> None:
        super().__init__()
        self.running = running
        self.on_call = on_call
        self.found: FrequencyCalls = {}

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        call = frequency_call(func, args, kwargs)
        if call is not None:
            path, owner = self.running()
            self.found.setdefault(path, f"{call} in {owner}")
            if self.on_call is not None:
                self.on_call(path, self.found[path])
        return func(*args, **kwargs)


@contextlib.contextmanager
def watching(paths: dict[int, str], outside: str,
             on_call: Callable[[str, str], None] | None = None) -> Iterator[FrequencyCalls]:
    """Record, while the block runs on this thread, each frequency-scaled call by the module that makes it:
    its path from ``paths`` (id(module) -> path in the model), ``outside`` where no module of ``paths`` runs;
    ``on_call(path, call)`` is called before such an op runs (it may raise: the op then never runs)."""
    thread = threading.get_ident()
    stack: list[tuple[str, str]] = []

    def pre(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == thread and id(module) in paths:
            stack.append((paths[id(module)], _code_of(type(module))))

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() == thread and id(module) in paths and stack:
            stack.pop()

    watch = _Watch(lambda: stack[-1] if stack else (outside, "the layer's function"), on_call)
    hooks = [nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post)]
    try:
        with watch:
            yield watch.found
    finally:
        for h in hooks:
            h.remove()


def _code_of(owner: Any) -> str:
    """Whose code makes the call: ``"Lookup.forward"``; an fx segment's (a GraphModule, the model's code
    around a unit, whose class a copy does not keep): ``"the model's own forward"``."""
    if isinstance(owner, type) and issubclass(owner, fx.GraphModule):
        return "the model's own forward"
    return f"{getattr(owner, '__name__', owner)}.forward"


def layer_paths(layer: Any) -> dict[int, str]:
    """id(module) -> its path in the model, for each module ``layer`` calls on this thread."""
    return {id(module): path for path, module in called_modules([layer], this_thread=True)}


def keep(layer: Any, found: FrequencyCalls) -> None:
    """Keep ``found`` on ``layer``'s module fn, where ``over_whole_batch`` reads it."""
    fn = module_fn(layer.fn)
    if fn is not None:
        fn.frequency_calls = found
