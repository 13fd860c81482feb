"""Running a layer on fake tensors once for all the layers identical to it.

A large model is mostly a stack of identical blocks (80 ``LlamaDecoderLayer`` of one shape in
a Llama-3-70B), and what shardwise predicts on fake tensors (functionalize's recording and
check, the pipeline's boundaries, the bytes each layer keeps for backward) is a function of a
layer's code, its tensors' shapes and dtypes and its input's: no data is read. So a layer whose
function is *the same as* one already run, on tensors and an input *like* that one's, gives an
output like that one's, and the run is skipped: the output is rebuilt from a recipe (each leaf
the input leaf it passes on, or a new fake tensor of the recorded shape, strides, dtype and
requires_grad), and whatever else the caller measured (bytes kept) is reused.

"The same function" is said by the function itself: ``fn.reuse_key()`` returns a hashable key
equal for functions that compute alike, or None. A function without one is always run; so is a
wrapper (a transform's rewrite) that does not define one, so reuse can only be lost, never be
wrong, where a transform is not written for it. Keys: ``unit_layer.UnitFn`` (the unit's module
structure, its tensors' shapes and its arguments' layout), mixed precision's cast.

"Like" is :func:`tree_signature`: the tree's structure, and per tensor leaf its shape, strides,
storage offset and size, dtype, device, requires_grad, which earlier leaf (if any) shares its
storage and whether it is one of the caller's own (the batch's) storages; per other leaf its
value. A tree with an unhashable leaf has no signature and is not reused.

Across calls: inside :func:`sharing_runs` (a plan search, which plans one model under many
layouts), :func:`memo_for` hands each purpose one memo for the whole block, so a layer rewritten
alike under two layouts (tensor parallel's blocks at the same degree, with ZeRO-1 or ZeRO-3 around
them) runs once for both. The caller's key must then say everything else its run depends on (the
predicted axes' sizes, the loss); a shared memo keeps each stored function alive, so that an
identity in its key (a config compared by ``id``) cannot be taken by another object while the
entry lives.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import optree
import torch
from torch import Tensor, nn

from ..torch_api import storage_key

T = TypeVar("T")

__all__ = ["LayerMemo", "memo_for", "module_signature", "results_for", "reuse_key", "reusing_forwards",
           "sharing_runs", "tree_signature"]

# What a module's plain attributes may hold and still count as the same computation: its place in
# a stack (Hugging Face blocks keep ``layer_idx`` for the key/value cache, which a pure layer turns
# off). Any other attribute that differs (a sliding window, a layer type) makes modules differ.
_POSITION_ATTRIBUTES = frozenset({"layer_idx"})


def reuse_key(fn: Callable[..., Any]) -> Hashable | None:
    """``fn.reuse_key()``, or None when ``fn`` does not say what it computes."""
    method = getattr(fn, "reuse_key", None)
    return method() if callable(method) else None


def module_signature(module: nn.Module) -> Hashable | None:
    """A key equal for modules that compute alike on alike inputs: per submodule its path, class
    and plain attributes (``layer_idx`` aside), and per tensor its name, shape, dtype and
    requires_grad; None if an attribute's value cannot be compared (not hashable)."""
    parts: list[Any] = []
    for path, sub in module.named_modules(remove_duplicate=False):
        attributes: list[tuple[Any, ...]] = []
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_") or k in _POSITION_ATTRIBUTES or isinstance(v, (nn.Module, Tensor)):
                continue
            if k == "training" or isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
                attributes.append((k, v))
            elif _hashable(v):
                # the type by name: some (a builtin function's, GELUActivation's ``act = F.gelu``) do not pickle,
                # and the key travels with the step to process ranks
                attributes.append((k, f"{type(v).__module__}.{type(v).__qualname__}", v))
            else:  # a config object, say: compared by identity (blocks of one model share it)
                attributes.append((k, "id", id(v)))
        tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad)
                   for n, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]]
        parts.append((path, type(sub), tuple(attributes), tuple(tensors)))
    return tuple(parts)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def tree_signature(tree: Any, own: frozenset[int] = frozenset()) -> Hashable | None:
    """What decides a fake run's shapes on ``tree`` (see the module docstring); ``own``: storage
    keys the caller tells apart (the batch's). None if a leaf is neither a tensor nor hashable."""
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    first: dict[int, int] = {}
    out: list[Any] = [spec]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            key = storage_key(leaf)
            out.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.untyped_storage().nbytes(),
                        leaf.dtype, leaf.device, leaf.requires_grad, first.setdefault(key, i), key in own))
        elif _hashable(leaf):
            out.append(("value", type(leaf), leaf))
        else:
            return None
    return tuple(out)


@dataclass(frozen=True)
class _Recipe:
    """How to rebuild an output: its structure, and per leaf the input leaf it is (an index), a
    new tensor's (shape, strides, dtype, device, requires_grad), or a plain value."""

    spec: optree.PyTreeSpec
    leaves: tuple[tuple[str, Any], ...]

    def rebuild(self, x: Any) -> Any:
        inputs = optree.tree_leaves(x, none_is_leaf=True)
        out = []
        for kind, what in self.leaves:
            if kind == "input":
                out.append(inputs[what])
            elif kind == "new":
                shape, stride, dtype, device, grad = what
                out.append(torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad))
            else:
                out.append(what)
        return optree.tree_unflatten(self.spec, out)


def _recipe(x: Any, y: Any) -> _Recipe | None:
    """``y`` as made of ``x``'s leaves and new tensors; None when a new tensor does not own its whole
    storage, or shares it with another leaf (a rebuilt one could not share it alike)."""
    inputs = {id(t): i for i, t in enumerate(optree.tree_leaves(x, none_is_leaf=True))}
    leaves, spec = optree.tree_flatten(y, none_is_leaf=True)
    storages = [storage_key(t) for t in leaves if isinstance(t, Tensor)]
    made: list[tuple[str, Any]] = []
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            made.append(("value", leaf))
        elif id(leaf) in inputs:
            made.append(("input", inputs[id(leaf)]))
        elif (leaf.storage_offset() == 0 and leaf.untyped_storage().nbytes() == leaf.numel() * leaf.element_size()
              and leaf.is_contiguous() and storages.count(storage_key(leaf)) == 1):
            made.append(("new", (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)))
        else:
            return None
    return _Recipe(spec, tuple(made))


class LayerMemo:
    """The outputs (and what a caller measured) of layers run on fake tensors, by what decides
    them: reuse them for a layer identical to one run before, on tensors and an input like its."""

    def __init__(self, own: Iterable[int] = ()) -> None:
        self.own = frozenset(own)  # storage keys told apart in inputs (the batch's)
        self._seen: dict[Hashable, tuple[_Recipe, Any]] = {}
        self._kept: list[Any] = []  # see store
        self.reused = 0  # how many runs were skipped (tests read it)

    def key(self, fn: Callable[..., Any], tensors: Mapping[str, Tensor], x: Any, layer: str = "",
            own: frozenset[int] | None = None) -> Hashable | None:
        """What decides ``fn(tensors, x)``'s shapes, or None when it cannot be told. Names of
        ``tensors`` that start with the ``layer``'s name (a unit's path) count without it: the
        blocks of a stack name their tensors by their own paths. ``own``: this call's batch storages,
        for a memo shared across calls (else the memo's)."""
        fn_key = reuse_key(fn)
        if fn_key is None:
            return None
        prefix = layer + "." if layer else ""
        params = tree_signature([(k.removeprefix(prefix), t) for k, t in tensors.items()])
        inputs = tree_signature(x, self.own if own is None else own)
        return None if params is None or inputs is None else (fn_key, params, inputs)

    def lookup(self, key: Hashable | None, x: Any) -> tuple[Any, Any] | None:
        """(output rebuilt for input ``x``, what was measured) of a run with this key, or None."""
        if key is None or key not in self._seen:
            return None
        recipe, measured = self._seen[key]
        self.reused += 1
        return recipe.rebuild(x), measured

    def store(self, key: Hashable | None, x: Any, y: Any, measured: Any = None, keep: Any = None) -> None:
        """``keep``: what the key's identities belong to (the layer's function), held while the entry
        lives in a memo shared across calls (:func:`sharing_runs`)."""
        if key is None:
            return
        recipe = _recipe(x, y)
        if recipe is not None:
            self._seen[key] = (recipe, measured)
            self._kept.append(keep)


_SHARED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "shardwise_shared_layer_memos", default=None
)


@contextlib.contextmanager
def sharing_runs() -> Iterator[None]:
    """Inside the block, :func:`memo_for` gives one memo per purpose, shared by every call (see the
    module docstring); nested blocks share the outer one's. The memos end with the block."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def memo_for(purpose: str) -> LayerMemo:
    """The memo of ``purpose`` shared inside :func:`sharing_runs`; outside, a new one (this call's)."""
    return _for(purpose, LayerMemo)


def results_for(purpose: str) -> dict[Hashable, Any]:
    """A dict of results of ``purpose`` (another fake run than a layer's: an optimizer's update) shared
    inside :func:`sharing_runs`; outside, a new one. Its keys must say all a result depends on, and
    hold what their identities belong to."""
    return _for(purpose, dict)


def _for(purpose: str, new: Callable[[], T]) -> T:
    """The block's ``purpose`` entry (made by ``new`` the first time), or a new one outside a block."""
    shared = _SHARED.get()
    if shared is None:
        return new()
    if purpose not in shared:
        shared[purpose] = new()
    return shared[purpose]


@contextlib.contextmanager
def reusing_forwards(modules: Sequence[nn.Module]) -> Iterator[LayerMemo]:
    """Inside the block (on fake tensors only: a skipped forward computes nothing), a call of one
    of ``modules`` alike to an earlier call of one of them (same :func:`module_signature`,
    arguments like the earlier ones) returns an output rebuilt as that one's instead of running:
    what functionalize's recording and check of a meta-built model do for its identical blocks."""
    memo = LayerMemo()
    replaced: list[tuple[nn.Module, Any]] = []
    try:
        for module in modules:
            signature = module_signature(module)
            if signature is None:
                continue
            replaced.append((module, module.__dict__.get("forward")))
            module.forward = _reusing(memo, signature, module.forward)
        yield memo
    finally:
        for module, own in reversed(replaced):
            if own is None:
                del module.forward
            else:
                module.forward = own


def _reusing(memo: LayerMemo, signature: Hashable, forward: Callable[..., Any]) -> Callable[..., Any]:
    def reused_or_run(*args: Any, **kwargs: Any) -> Any:
        x = (args, kwargs)
        inputs = tree_signature(x)
        key = None if inputs is None else (signature, inputs)
        found = memo.lookup(key, x)
        if found is not None:
            return found[0]
        y = forward(*args, **kwargs)
        memo.store(key, x, y)
        return y

    return reused_or_run
