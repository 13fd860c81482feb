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

Forward hooks tell the module whose forward runs the call. functionalize's check sees the ops with a
TorchFunctionMode (:func:`watching`); the step's watch with a TorchDispatchMode (:func:`watching_ops`): under a
TorchFunctionMode torch hands a user's monkeypatched torch function (``F.silu = counting_silu``, calling the
original) back to the mode under the patched name, so the patch would run twice on the step's first call; a
dispatch mode sees the aten ops only and calls no Python-level function again.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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
    with _running_modules(paths, outside) as running:
        watch = _Watch(running, on_call)
        with watch:
            yield watch.found


@contextlib.contextmanager
def watching_ops(paths: dict[int, str], outside: str, on_call: Callable[[str, str], None]) -> Iterator[None]:
    """:func:`watching` at the aten level, for the step's first call: ``on_call(path, call)`` before each
    frequency-scaled aten op runs on this thread (a dispatch mode is this thread's), the call named as the
    forward wrote it (:func:`_written_as`). A user's patched torch function runs once, as without the watch."""
    with _running_modules(paths, outside) as running, _OpWatch(running, on_call):
        yield


@contextlib.contextmanager
def _running_modules(paths: dict[int, str], outside: str) -> Iterator[Callable[[], tuple[str, str]]]:
    """The innermost module of ``paths`` running on this thread, as (its path, its code in words), while the
    block runs; (``outside``, "the layer's function") where none runs."""
    thread = threading.get_ident()
    stack: list[tuple[str, str]] = []

    def pre(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == thread and id(module) in paths:
            stack.append((paths[id(module)], _code_of(type(module))))

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() == thread and id(module) in paths and stack:
            stack.pop()

    hooks = [nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post)]
    try:
        yield lambda: stack[-1] if stack else (outside, "the layer's function")
    finally:
        for h in hooks:
            h.remove()


# the aten ops that look rows up with scale_grad_by_freq (F.embedding_bag, torch.embedding_bag and
# aten.embedding_bag's overloads reach dispatch as aten._embedding_bag under autograd; without it, as
# _embedding_bag_forward_only); their backward ops (embedding_dense_backward, ...) are not the forward's calls
_ATEN_LOOKUPS = {torch.ops.aten.embedding, torch.ops.aten.embedding_bag, torch.ops.aten._embedding_bag,
                 torch.ops.aten._embedding_bag_forward_only}


def _scaled(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether aten op ``func`` (an OpOverload) scales its rows' gradients by their counts in the batch."""
    if getattr(func, "overloadpacket", None) not in _ATEN_LOOKUPS:
        return False
    names = [a.name for a in func._schema.arguments]
    if "scale_grad_by_freq" not in names:
        return False
    position = names.index("scale_grad_by_freq")
    return kwargs.get("scale_grad_by_freq", args[position] if len(args) > position else False) is True


class _OpWatch(TorchDispatchMode):
    """Hands each frequency-scaled aten op to ``on_call`` (path, call in words) before it runs."""

    def __init__(self, running: Callable[[], tuple[str, str]], on_call: Callable[[str, str], None]) -> None:
        super().__init__()
        self.running = running
        self.on_call = on_call

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _scaled(func, args, kwargs):
            path, owner = self.running()
            self.on_call(path, f"{_written_as(func)}(..., scale_grad_by_freq=True) in {owner}")
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FUNCTIONAL = F.embedding.__code__.co_filename  # F.embedding / F.embedding_bag by their code, patched or not


def _written_as(func: Any) -> str:
    """The call the forward wrote, as functionalize's TorchFunctionMode names it, told by the Python frames
    between the dispatch and the forward's own code: ``F.embedding`` / ``F.embedding_bag``'s code, an op of
    ``torch.ops`` called (``torch.ops.aten.embedding``, ``...embedding_bag.default``), else the C function the
    forward called directly (``torch.embedding``; ``torch.embedding_bag`` and ``torch._embedding_bag`` reach
    dispatch alike: the calling line's text tells them apart). Another dispatch mode inside ours (remat's
    checkpoint) passes the op on by calling it: what lies below its ``__torch_dispatch__`` is not the forward's."""
    frame: FrameType | None = sys._getframe(2)  # above __torch_dispatch__
    named = None
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_name == "__torch_dispatch__"):
        code = frame.f_code
        if code.co_name == "__torch_dispatch__":
            named = None
        elif named is None and code.co_filename == _FUNCTIONAL and code.co_name in ("embedding", "embedding_bag"):
            named = f"F.{code.co_name}"
        elif named is None and code.co_name == "__call__" and isinstance(
                called := frame.f_locals.get("self"), (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            named = f"torch.ops.{called}"
        frame = frame.f_back
    if named is not None:
        return named
    if func.overloadpacket is torch.ops.aten.embedding:
        return "torch.embedding"
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno) if frame is not None else ""
    return "torch._embedding_bag" if "._embedding_bag(" in line else "torch.embedding_bag"


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
