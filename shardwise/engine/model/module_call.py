"""Call a module with given tensors in place of its parameters and buffers, cheaply.

``torch.func.functional_call`` walks the module's named parameters and buffers on
every call (to untie aliases, check keys and swap), about 20 us per call on a small
module: in a pipeline of many small layers and micro-batches that is a visible
share of the step. :class:`ModuleCall` does that walk once, remembering for each
qualified name the submodule and the slot of its ``_parameters`` / ``_buffers``
dict (the private containers ``functional_call`` itself swaps through), and then
only swaps the tensors in and out around ``module(x)``. The module's code runs
unchanged on the same tensors, so the result is bitwise ``functional_call``'s.

Semantics are ``functional_call(module, tensors, (x,), strict=True,
tie_weights=True)``: ``tensors`` must name every parameter and buffer once (an
alias of a tied tensor under its first name only) and the given tensor is used
under every alias. Any other key set goes to ``functional_call`` itself, which
handles it or raises its own error. A module that does not keep a tensor in those
dicts (one reparametrized with a property, say) is not handled here and always
takes ``functional_call``. tests/engine/test_module_call.py fails loudly if torch
changes where modules keep their tensors.

A few leaf modules whose ``forward`` is one functional call (``nn.Linear``: ``F.linear(input,
self.weight, self.bias)``, and the activations, dropout and ``LayerNorm`` in :data:`DIRECT`) are
called through that function on the given tensors instead, when nothing would make
``module(x)`` do more than call ``forward`` (no hooks on it or global ones, not compiled, not
traced): the same function on the same tensors, so the same bits, without the swap and
``Module.__call__`` (about a third of a small layer's call). A subclass always takes the swap.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules import module as _torch_module

from shardwise.collectives.backends.current import on_rank_thread
from shardwise.engine.model.fused_attention import holds_fused_attention, without_fused_attention
from shardwise.engine.model.hf_collecting import forget_capturing_hooks, is_capturing_hook
from shardwise.engine.model.predicted_state import no_fake_state_left, predicting_on_fake_tensors
from shardwise.engine.model.rope_state import (
    cache_lengths,
    is_dynamic_rope,
    keep_rebound,
    refuse_moved_cache,
    rewritten_each_call,
    swap_in_kept,
)

_Slot = tuple[dict[str, Any], str, str]  # (the submodule's _parameters or _buffers, attribute, key in tensors)
_Direct = Any  # (module, tensors, input) -> output: its forward's one call on the given tensors

# Exactly each module's forward (torch/nn/modules), on ``tensors`` in place of its parameters;
# tests/engine/test_module_call.py checks each against module(x), values and gradients.
DIRECT: dict[type[nn.Module], _Direct] = {
    nn.Linear: lambda m, t, x: F.linear(x, t["weight"], t.get("bias")),
    nn.GELU: lambda m, t, x: F.gelu(x, approximate=m.approximate),
    nn.ReLU: lambda m, t, x: F.relu(x, inplace=m.inplace),
    nn.SiLU: lambda m, t, x: F.silu(x, inplace=m.inplace),
    nn.Tanh: lambda m, t, x: torch.tanh(x),
    nn.Dropout: lambda m, t, x: F.dropout(x, m.p, m.training, m.inplace),
    nn.LayerNorm: lambda m, t, x: F.layer_norm(x, m.normalized_shape, t.get("weight"), t.get("bias"), m.eps),
}


# Each class's forward as torch defines it: a class whose forward was patched takes the swap.
_FORWARDS = {cls: cls.forward for cls in DIRECT}

# The DIRECT types whose forward draws no random numbers: a stage that runs only these, directly,
# needs no seeding of the random streams (run/executor.py skips it for such a stage).
DRAWS_NOTHING = frozenset(DIRECT) - {nn.Dropout}

# (module, its tensors, its DIRECT call): ``module(x)`` as the one call ``fn(module, tensors, x)``
Quiet = tuple[nn.Module, dict[str, Tensor], _Direct]


def calls_forward_alone(module: nn.Module) -> bool:
    """Whether ``module(x)`` would only call its class's own ``forward(x)`` (Module._wrapped_call_impl
    and _call_impl's fast path): no hooks of its own or global ones, not compiled, not traced, no
    forward set on the instance (a transform's, as tensor_parallel installs; or what ``module(x)``
    calls on the way) or patched into the class."""
    g, own = _torch_module, module.__dict__
    return not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
        or g._global_backward_pre_hooks or module._compiled_call_impl is not None or torch._C._get_tracing_state()
        or "forward" in own or "_call_impl" in own or "_wrapped_call_impl" in own
        or type(module).forward is not _FORWARDS[type(module)]
    )


class ModuleCall:
    """``functional_call(module, tensors, (x,), strict=True)``, with the name walk done once.

    With a ``prefix``, every key of ``tensors`` is the module's own name with that prefix (the
    names a submodule's tensors have in its root module)."""

    def __init__(self, module: nn.Module, prefix: str = "") -> None:
        self.module = module
        self.prefix = prefix  # what every key of ``tensors`` starts with (a submodule's path + ".")
        self._slots, self._keys = _slots_of(module, prefix)
        # The buffers' slots: a forward that rebinds one (``self.buf = self.buf + 1``) is refused, as the
        # swap back would drop the new tensor (torch's loop keeps it).
        owners = {id(sub._buffers): sub for sub in module.modules()}
        self._buffer_slots = [
            slot for slot in self._slots or ()
            if id(slot[0]) in owners and not _rebinds_from_input(owners[id(slot[0])], slot[1])
        ]
        # A dynamic rotary embedding's ``inv_freq`` slots, whose rebound tensor the module keeps (rope_state.py).
        self._rope_slots = [
            (owners[id(slot[0])], *slot) for slot in self._slots or ()
            if id(slot[0]) in owners and _rebinds_from_input(owners[id(slot[0])], slot[1])
        ]
        # A longrope rotary embedding's ``inv_freq``, which every call overwrites in place before reading it:
        # each call is given a copy of its own to write (rope_state.rewritten_each_call).
        self._scratch = frozenset(prefix + (f"{path}." if path else "") + name
                                  for path, sub in module.named_modules() for name in rewritten_each_call(sub))
        if self._scratch:
            self._buffer_slots = [s for s in self._buffer_slots if s[2] not in self._scratch]
        # Without slots (functional_call's path) a rebound inv_freq cannot be kept: refused if one moves.
        self._rope_modules = [sub for sub in module.modules() if is_dynamic_rope(sub)] if self._slots is None else []
        # Its forward's one call (DIRECT), for a module of exactly such a type named without a prefix.
        self._direct: _Direct | None = DIRECT.get(type(module)) if not prefix else None
        # Whether call_arguments adds use_cache=False to a call on a tensor, read once (a call on a
        # tensor is otherwise module(x)).
        self.takes_use_cache = "use_cache" in _forward_parameters(module)
        # torch's attention modules inside: their fused inference path off at each call (fused_attention.py).
        self._unfused = holds_fused_attention(module)
        # The tensors the last call put back into the slots (the module's own, meta between calls): another one
        # found there at the next call was set between the calls (a backward hook's ``self.buf = self.buf + v``).
        self._left: list[Any] | None = None

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        return self.call(tensors, (x,), {})

    def quiet(self, tensors: dict[str, Tensor]) -> Quiet | None:
        """``module(x)`` on ``tensors`` as its forward's one call, if that call draws no random
        numbers (:data:`DRAWS_NOTHING`): ``(module, tensors, fn)``, to run as ``fn(module, tensors, x)``
        on a tensor ``x`` whenever :func:`calls_forward_alone` holds (the caller asks before each
        call: a hook may come at any time). None for any other module, or other keys."""
        if self._direct is None or type(self.module) not in DRAWS_NOTHING or tensors.keys() != self._keys:
            return None
        return self.module, tensors, self._direct

    def call(self, tensors: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` with ``tensors`` swapped in (on fake tensors, leaving none in the
        module's attributes: predicted_state.py)."""
        if predicting_on_fake_tensors():
            with no_fake_state_left(self.module):
                return self._call(tensors, args, kwargs)
        return self._call(tensors, args, kwargs)

    def _call(self, tensors: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._slots is None or tensors.keys() != self._keys:
            n = len(self.prefix)
            unprefixed = {k[n:] if k.startswith(self.prefix) else k: t.clone() if k in self._scratch else t
                          for k, t in tensors.items()}
            rope = self._rope_modules if self._slots is None else [o for o, *_ in self._rope_slots]
            lengths = cache_lengths(rope)
            out = functional_call(self.module, unprefixed, args, kwargs, strict=True)
            refuse_moved_cache(rope, lengths)
            return out
        direct = self._direct
        if direct is not None and not kwargs and len(args) == 1 and isinstance(args[0], Tensor) \
                and calls_forward_alone(self.module):
            return direct(self.module, tensors, args[0])
        slots = self._slots
        originals = [container[attr] for container, attr, _ in slots]
        left = self._left
        if left is not None:  # what the last call put back: another tensor there was set between the calls
            for (_, _, key), now, was in zip(slots, originals, left, strict=True):
                if now is not was:
                    raise ValueError(set_between_calls(type(self.module).__name__, key, self.prefix))
        try:
            for container, attr, key in slots:
                container[attr] = tensors[key]
            if self._scratch:
                for container, attr, key in slots:
                    if key in self._scratch:
                        container[attr] = tensors[key].clone()
            if self._rope_slots:
                swap_in_kept(self._rope_slots)
            if self._unfused:
                with without_fused_attention():
                    out = self.module(*args, **kwargs)
            else:
                out = self.module(*args, **kwargs)
            rebound = [key for container, attr, key in self._buffer_slots if container.get(attr) is not tensors[key]] \
                if self._buffer_slots else None
        finally:
            # Also when forward ends by an exception: a layer that runs a model up to its first unit (the
            # embed layer) stops it there by raising, after its rotary embedding ran.
            if self._rope_slots:
                keep_rebound(self._rope_slots, tensors)
            for (container, attr, _), original in zip(slots, originals, strict=True):
                container[attr] = original
            self._left = originals
        if rebound:
            raise ValueError(rebound_message(type(self.module).__name__, rebound, self.prefix))
        return out


def _rebinds_from_input(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner`` is a Hugging Face rotary embedding with dynamic RoPE, whose forward rebinds
    ``inv_freq`` to a function of the input's length (``dynamic_rope_update``): not refused, but kept
    in the module for its later calls as torch keeps it (rope_state.py)."""
    return attr.endswith("inv_freq") and is_dynamic_rope(owner)


def set_between_calls(module: str, key: str, prefix: str = "") -> str:
    """Why a call is refused whose module had a tensor set to another between its calls."""
    name = key[len(prefix):] if key.startswith(prefix) else key
    return (
        f"{module}'s tensor {name!r} was set to another tensor between two calls of its layer (self.{name} = ... "
        "in a backward hook, or a hook its forward registered: a gradient statistic kept in the module). After "
        "the layer's call the step's copy of the module holds meta stand-ins, so the new value is lost and this "
        "forward would read the old one, where torch's loop reads the new. Keep the statistic outside the module "
        "(a tensor of your own the hook closes over), or compute it from the gradients after the step."
    )


def rebound_message(module: str, rebound: list[str], prefix: str = "") -> str:
    """Why a forward of ``module`` (its class) that set its buffers ``rebound`` to other tensors is
    refused, and what to do."""
    names = [k[len(prefix):] if k.startswith(prefix) else k for k in rebound]
    return (
        f"{module} set its buffers {names} to other tensors during forward (self.<name> = ... or "
        "register_buffer): a pure layer gets its buffers anew on every call, so the new tensor would be "
        "dropped after this call, where torch's loop keeps it for the next; compute the value from the "
        "input on every call (a local variable), keep it outside the model, make it a parameter, or "
        "leave the module in eval mode"
    )


def _slots_of(module: nn.Module, prefix: str) -> tuple[list[_Slot] | None, frozenset[str]]:
    """Every (container, attribute, key) to swap, or None if a tensor is not kept in a container."""
    first_name: dict[int, str] = {}  # id(tensor) -> the name functional_call's caller gives it
    slots: list[_Slot] = []
    for kind, named in (
        ("_parameters", module.named_parameters(remove_duplicate=False)),
        ("_buffers", module.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            owner_path, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            container = getattr(owner, kind, None)
            if not isinstance(container, dict) or container.get(attr) is not tensor:
                return None, frozenset()
            key = first_name.setdefault(id(tensor), prefix + name)
            slots.append((container, attr, key))
    return slots, frozenset(first_name.values())



def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure whose parameters and buffers are meta tensors of the same
    shapes and dtypes: what a layer keeps of the module it calls, since every call swaps the real
    tensors in (``ModuleCall`` is strict, so a meta tensor left in place fails loudly, never
    silently). Tied tensors stay tied (one meta tensor under each alias). Tensors kept as plain
    attributes, not registered, are copied as they are: forward reads them."""
    memo: dict[int, Any] = {}
    for _, t in module.named_parameters(remove_duplicate=False):
        if id(t) not in memo:
            memo[id(t)] = nn.Parameter(t.detach().to("meta"), requires_grad=t.requires_grad)
    for _, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = b.detach().to("meta")
    return copy_structure(module, memo)


def kept_in_copies(module: nn.Module, defaults_only: bool = False) -> dict[int, Any]:
    """A deepcopy memo entry for every ``torch.Generator`` that a submodule of ``module`` holds
    (as an attribute, or inside a list, tuple or dict attribute), mapping it to itself; with
    ``defaults_only``, for torch's default generators only.

    A layer's generator attribute IS that generator: ``torch.default_generator`` is the stream
    the step seeds for every compute (and remat replays), and re-seeding one's own generator
    must reach the layer. ``copy.deepcopy`` would give each copy a private generator instead
    (torch generators support deepcopy), so every copy of a module shares its generators. But
    the replica of each rank thread (``ThreadReplicas``) copies a generator of the user's own, as
    each rank process has its own: two rank threads drawing from one stream, unlocked, would draw
    in whichever order the threads ran (the default generators are seeded and locked per compute)."""
    kept: dict[int, Any] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Generator):
            if not defaults_only or _is_default_generator(value):
                kept[id(value)] = value
        elif depth < 3 and isinstance(value, list | tuple):
            for v in value:
                visit(v, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    for sub in module.modules():
        for name, value in vars(sub).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                visit(value, 0)
    return kept


def _is_default_generator(gen: torch.Generator) -> bool:
    if gen is torch.default_generator:
        return True
    device_module = getattr(torch, gen.device.type, None)  # torch.cuda, torch.xpu, ...
    return any(gen is d for d in getattr(device_module, "default_generators", ()))


def copy_structure(module: nn.Module, tensors: dict[int, Any], own_generators: bool = True) -> nn.Module:
    """A deep copy of ``module`` with its registered tensors replaced as ``tensors`` says (by id),
    its generators shared (:func:`kept_in_copies`; with ``own_generators=False``, the default ones
    only: a rank thread's replica).

    A module holding an object that cannot be deep-copied (a lock, a file, a process group) is
    copied module by module instead: each submodule a shallow copy with its own parameter,
    buffer and submodule dicts (what a call swaps tensors in and out of), its other attributes
    shared with the original."""
    try:
        return copy.deepcopy(module, {**kept_in_copies(module, defaults_only=not own_generators), **tensors})
    except (TypeError, copy.Error, RuntimeError, NotImplementedError):
        return _shallow_tree(module, tensors, {})


def _shallow_tree(module: nn.Module, tensors: dict[int, Any], seen: dict[int, nn.Module]) -> nn.Module:
    if id(module) in seen:  # a submodule under two names stays one module
        return seen[id(module)]
    twin = copy.copy(module)
    seen[id(module)] = twin

    def swap(t: Any) -> Any:
        return tensors.get(id(t), t) if t is not None else None

    twin._parameters = {k: swap(v) for k, v in module._parameters.items()}
    twin._buffers = {k: swap(v) for k, v in module._buffers.items()}
    twin._modules = {
        k: None if v is None else _shallow_tree(v, tensors, seen) for k, v in module._modules.items()
    }
    return twin


class ThreadReplicas:
    """A :class:`ModuleCall` per thread over a :func:`skeleton` of ``module``: the skeleton for
    the thread that made this (unless a rank thread made it), and for every other thread a deep copy of it.

    The skeleton holds no parameter data, so a chain owns no second copy of the model and the
    user's module can be deleted (or kept, and trained, or changed: the chain never reads it).
    ``functional_call`` swaps tensors into the module for the duration of a call, which is not
    safe when threads (the threads backend runs ranks as threads) call one module at once, hence
    a copy per thread. Pickles as the skeleton alone.

    A thread copies the skeleton at its first call, so no thread may be calling the skeleton then:
    a call leaves its tensors (a step's real ones, or the fake ones of its first call's prediction)
    and other state in the module until it returns, and a copy made meanwhile keeps them (a later call
    on a tensor the copy does not swap reads them: another rank's values, silently, or a meta tensor).
    The thread that made this is not a rank when the layers are built before ``launch``; when a rank
    thread made it (a transform applied inside each rank's function, whose rebuilt chain the other
    ranks' identical transforms reuse: engine/stack/compose.py), it calls a copy like every other rank
    and the skeleton is never called.
    """

    def __init__(self, module: nn.Module, prefix: str = "") -> None:
        self.module = skeleton(module)
        self.prefix = prefix
        self._init_local()

    def _init_local(self) -> None:
        # None: no thread calls the skeleton itself (see the class docstring).
        self._owner: int | None = None if on_rank_thread() else threading.get_ident()
        self._local = threading.local()
        self._call: ModuleCall | None = None
        self._hooks = _hook_ids(self.module)  # the model's own, which every copy keeps

    def get(self) -> ModuleCall:
        """This thread's ModuleCall."""
        if threading.get_ident() == self._owner:
            if self._call is None:
                self._call = ModuleCall(self.module, self.prefix)
            return self._call
        call = getattr(self._local, "call", None)
        if call is None:
            named = [
                *self.module.named_parameters(remove_duplicate=False),
                *self.module.named_buffers(remove_duplicate=False),
            ]
            replica = copy_structure(self.module, {id(t): t for _, t in named}, own_generators=False)
            _drop_hooks_since(replica, self._hooks)
            call = self._local.call = ModuleCall(replica, self.prefix)
        return call

    @contextlib.contextmanager
    def probing(self, module: nn.Module) -> Iterator[None]:
        """In the block, this thread's calls run ``module`` (a copy of this thread's module as it was before
        a call: run/first_call_state.py) on copies of the tensors they are given, so neither the module a
        step calls nor its parameters and buffers see the run."""
        probe = _ProbeCall(module, self.prefix)
        if threading.get_ident() == self._owner:
            kept, self._call = self._call, probe
            try:
                yield
            finally:
                self._call = kept
            return
        was = getattr(self._local, "call", None)
        self._local.call = probe
        try:
            yield
        finally:
            self._local.call = was

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module, self.prefix = state["module"], state["prefix"]
        self._init_local()


class _ProbeCall(ModuleCall):
    """A ModuleCall that swaps in copies of the tensors it is given (a write into one stays in the copy)."""

    def call(self, tensors: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super().call({k: t.detach().clone() for k, t in tensors.items()}, args, kwargs)

    def quiet(self, tensors: dict[str, Tensor]) -> Quiet | None:
        return None  # every call takes call(), which copies the tensors


# A module's hook dicts, and the dicts keyed by the same hook ids that say how each is called.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _hook_ids(module: nn.Module) -> list[frozenset[int]]:
    """The ids of the hooks on each of ``module``'s modules (in ``modules()`` order)."""
    return [frozenset(k for name in _HOOKS for k in getattr(sub, name, {})) for sub in module.modules()]


def own_hook_dicts(module: nn.Module) -> None:
    """Give ``module`` (itself, not its children) hook dicts of its own, holding the hooks it has: a shallow copy
    of a module shares them, and a hook put on the copy (transformers' output capturing, at a copy's first call)
    would be on the original too."""
    for name in (*_HOOKS, *_HOOK_FLAGS):
        hooks = getattr(module, name, None)
        if hooks is not None:
            setattr(module, name, type(hooks)(hooks))


def _drop_hooks_since(replica: nn.Module, kept: list[frozenset[int]]) -> None:
    """Remove from a thread's copy the hooks its original did not hold when it was made (``kept``): another
    thread's, on its own module while this one copied it (the sequence-first check's pre-hooks, which hear
    only their thread): each would have cost the copy a call per forward, for good. The copy gets dicts of its
    own (a copy made module by module shared them: a hook put on it later was on the original too). transformers'
    output-capturing hooks, put on at the model's first call (hf_collecting.py), are dropped too where they came
    after, and the copy's model marked as without them, so that its own first call puts them on its layers: kept
    marked, its calls captured no hidden state (``out.hidden_states`` empty on every rank thread)."""
    dropped_capturing = False
    for sub, ids in zip(replica.modules(), kept, strict=True):
        for name in (*_HOOKS, *_HOOK_FLAGS):
            hooks = getattr(sub, name, None)
            if hooks is not None:
                if name in _HOOKS:
                    dropped_capturing |= any(is_capturing_hook(v) for k, v in hooks.items() if k not in ids)
                setattr(sub, name, type(hooks)((k, v) for k, v in hooks.items() if k in ids))
    if dropped_capturing:  # transformers' output capturing, put on at the model's first call: again on the copy's
        forget_capturing_hooks(replica)


def call_arguments(module: nn.Module, x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a layer calls ``module`` on its input ``x``: ``module(**x)`` for a dict whose keys are
    all arguments of ``forward`` (an HF-style batch: ``input_ids``, ``attention_mask``,
    ``labels``), or some of them and the rest taken by its ``**kwargs`` (see :func:`_takes`),
    else ``module(x)``. A forward that takes ``use_cache`` (Hugging Face models), or a Hugging Face
    model's that passes its ``**kwargs`` on, gets ``use_cache=False`` unless ``x`` sets it: a pure layer
    keeps no key/value cache."""
    signature = _forward_parameters(module)
    if isinstance(x, Mapping) and x and all(isinstance(k, str) for k in x) and _takes(signature, x):
        args: tuple[Any, ...] = ()
        kwargs = dict(x)
    else:
        args, kwargs = (x,), {}
    if "use_cache" not in kwargs and ("use_cache" in signature or _cache_through_kwargs(module, signature)):
        kwargs["use_cache"] = False
    return args, kwargs


def _cache_through_kwargs(module: nn.Module, signature: Mapping[str, inspect.Parameter]) -> bool:
    """A Hugging Face model whose forward hands ``**kwargs`` to its inner model instead of naming
    ``use_cache`` (GraniteMoE's causal LM): the inner model turns the cache on from the config. Read
    once per module (the embed and head layers ask every step; the config's text part costs ~10 us)."""
    found = _CACHE_THROUGH_KWARGS.get(module)
    if found is None:
        found = _CACHE_THROUGH_KWARGS[module] = _reads_cache_through_kwargs(module, signature)
    return found


_CACHE_THROUGH_KWARGS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _reads_cache_through_kwargs(module: nn.Module, signature: Mapping[str, inspect.Parameter]) -> bool:
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    pretrained = any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)
    if not (takes_kwargs and pretrained):
        return False
    config: Any = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # LLaVA's: text_config
    return any(getattr(c, "use_cache", False) is True for c in (config, text))


# Every layer call asks this; inspect.signature takes tens of microseconds, about 5% of a small
# MLP's pipelined step when asked per call, so it is read once per module.
_FORWARD_PARAMETERS: weakref.WeakKeyDictionary[nn.Module, Mapping[str, inspect.Parameter]] = (
    weakref.WeakKeyDictionary()
)


def _forward_parameters(module: nn.Module) -> Mapping[str, inspect.Parameter]:
    found = _FORWARD_PARAMETERS.get(module)
    if found is None:
        try:
            found = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):  # a builtin or C forward: no keywords to offer
            found = {}
        _FORWARD_PARAMETERS[module] = found
    return found


def _takes(parameters: Mapping[str, inspect.Parameter], x: Mapping[str, Any]) -> bool:
    """Whether ``forward`` takes the dict ``x`` as keyword arguments rather than as one argument.

    Every key a named parameter: keywords. A forward with no positional parameter (``forward(self,
    **batch)``): keywords, the only way it takes them. None: the dict itself. Some: where forward's first
    argument is required and the dict does not name it (``forward(batch, mask=None)`` given
    ``{"x", "mask"}``), the dict is that argument, as ``module(batch)`` passes it; else a forward
    with ``**kwargs`` (Hugging Face's ``**kwargs: Unpack[TransformersKwargs]`` takes
    ``return_dict``, ``shift_labels``, ...) takes keywords. A forward of several named parameters
    without ``**kwargs`` given a dict naming its first and other keys too is refused:
    ``module(**x)`` would fail and ``module(x)`` would put the batch in its first argument."""
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [k for k in x if k in parameters and parameters[k].kind in keywords]
    if len(named) == len(x):
        return True
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                        inspect.Parameter.VAR_POSITIONAL)
    if not any(p.kind in positional_kinds for p in parameters.values()):
        return True  # forward(self, **batch) (or keyword-only arguments): it can only take keywords
    if not named:
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = next((p for p in parameters.values() if p.kind in positional), None)
    if first is not None and first.default is inspect.Parameter.empty and first.name not in x:
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    if sum(p.kind in keywords or p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters.values()) < 2:
        return False  # forward(x) given {"x": ..., "y": ...}: the dict is its one argument
    unknown = sorted(k for k in x if k not in named)
    raise TypeError(
        f"the batch is a dict with keys {sorted(x)}, some naming arguments of forward {named} and "
        f"some not {unknown}, and forward takes no **kwargs, so it can be neither spread into keyword "
        f"arguments nor passed whole: remove {unknown} from the batch (or rename them to forward's "
        f"arguments {[k for k, p in parameters.items() if p.kind in keywords]})"
    )


def module_fn(fn: Any) -> Any:
    """The module fn (the one holding ``replicas``: the module it calls) inside a layer's ``fn``,
    following the ``fn`` attribute of the split wrappers around it (a split rewritten before another
    wraps the module fn the later one looks for); None when there is none."""
    for _ in range(8):
        if hasattr(fn, "replicas"):
            return fn
        fn = getattr(fn, "fn", None)
        if fn is None:
            return None
    return None

