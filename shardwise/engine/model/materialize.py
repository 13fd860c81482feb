"""Materialize a meta-built module's tensors one at a time, from the module's own initializers.

A model built under ``with torch.device("meta")`` has shapes and dtypes but no data. Each
parameter (or buffer) is made on its own: an empty tensor on the target device is put in its
slot of the module, the module that owns it is initialized (then each module above it, in the
order ``module.apply`` visits them: children first), and the tensor is taken out again. So a
rank makes only the tensors it holds, one unit at a time, and the user's module is left meta.

Which initializer runs on a module:

* ``init_fn(module)`` or ``init_fn(module, path)`` when given (``path``: the module's path in the
  model, ``""`` for the model): applied to the owner and every module above it, as
  ``model.apply(init_fn)`` would (torchtitan's ``init_weights`` on the model; nanoGPT's
  ``_init_weights`` with a rule for its LayerNorm and its scaled ``c_proj``, below);
* a Hugging Face model's own ``_init_weights(module)``, likewise on the owner and above (it
  re-initializes some weights from their parent: GPT-2's scaled ``c_proj``; and it computes
  buffers such as rotary frequencies and position ids);
* else the owner's ``reset_parameters()`` (torch's layers); a module without one is refused,
  naming it and asking for ``init_fn``. So is a model that defines its own ``init_weights`` or
  ``_init_weights`` (``init_fn.own_init_methods``), when its parameters are to be made: torch's
  defaults would silently replace the init its constructor runs.

What is replayed is only this: a constructor's code outside any module's initializer (nanoGPT's
``for pn, p in self.named_parameters(): if pn.endswith('c_proj.weight'): ...`` after
``self.apply(self._init_weights)``, or a ``torch.ones`` in its LayerNorm's ``__init__``) never runs
on a meta build, and nothing can see that it is missing. ``init_fn`` must say it:

    def init_fn(module, path):                         # nanoGPT's GPT.__init__, per module
        model._init_weights(module)                    # self.apply(self._init_weights)
        if isinstance(module, LayerNorm):              # its constructor's ones and zeros
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        if path.endswith("c_proj"):                    # the loop after apply()
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * config.n_layer))

(``tests/engine/test_meta_init_recipes.py`` checks it against nanoGPT's eager init.) Where the
initializer leaves a tensor unset and its owner has a ``reset_parameters()`` (torch's
``nn.LayerNorm`` under nanoGPT's ``_init_weights``), the tensor is made as the eager model has it:
``reset_parameters()`` first, as the owner's constructor ran it, then the initializer.

Every tensor's random draws are seeded from ``(seed, its path in the module)``, so its values
do not depend on which other tensors a rank makes, on the mesh or on the stack: a ZeRO-3 shard
on 512 ranks holds the values the same seed gives on one device. The values differ from the
module's eager init under ``torch.manual_seed`` (that draws every tensor from one stream); they
follow the same distributions.

An initializer that leaves part of a tensor unset would leave uninitialized memory in it: each
tensor is made twice, from two different fills, and any element that differs is refused. A tensor
found set so is made once from then on (by this ``ModuleInit``: a second ``init``, another thread
rank, a warm-up before a measured run), from the first fill.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .fx_split import FunctionalizeError
from .init_fn import InitFn, as_path_init, own_init_methods
from .module_call import kept_in_copies
from .parametrized_init import make_original, parametrized_original

Seeding = Callable[[int], contextlib.AbstractContextManager[Any]]

__all__ = ["InitFn", "ModuleInit", "has_meta_tensors", "is_transformers_model", "path_seed", "stand_in",
           "unfilled_frozen"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def path_seed(seed: int, path: str) -> int:
    """A 63-bit seed from ``seed`` and a tensor's path: stable across processes and machines
    (Python's ``hash`` of a string is not)."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def _forked_seed(seed: int) -> Iterator[None]:
    """Default seeding: the process's generators seeded for the block, restored after it."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass(eq=False)
class ModuleInit:
    """How the meta tensors of a functionalized module are made: which tensor of ``module``
    each (layer, local name) is, the initializer, and the device they are made on.

    Held by the Chain of a meta-built module (``chain.init``); ``Step.init`` asks it for the
    tensors of one layer at a time. Pickles with the module (meta tensors pickle as shapes).
    """

    # repr=False: a chain's repr (in an error message) must not print the whole model
    module: nn.Module = field(repr=False)
    paths: Mapping[tuple[str, str], str] = field(repr=False)  # (layer, local) -> path in module
    init_fn: InitFn | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    # path -> whether its owner's reset_parameters() runs first: the tensors made twice and found set by the
    # initializer, made once from then on (a second init of the model, another thread rank's, a warm-up's)
    _checked: dict[str, bool] = field(default_factory=dict, init=False, repr=False)

    def describe(self) -> str:
        """What decides the values (ranks must agree on it): the initializer and the device type."""
        how = getattr(self.init_fn, "__qualname__", repr(self.init_fn)) if self.init_fn else self._default_name()
        return f"{type(self.module).__name__} initialized by {how} on {self.device.type}"

    def _default_name(self) -> str:
        return "_init_weights" if self._holds_transformers_model() else "reset_parameters"

    def _holds_transformers_model(self) -> bool:
        """Whether the module is a transformers model or holds one (an encoder-decoder wrapped to split)."""
        return any(is_transformers_model(m) for m in self.module.modules())

    def tensors(
        self, layer: str, names: list[str], seed: int, seeding: Seeding | None = None
    ) -> dict[str, Tensor]:
        """The tensors ``names`` of ``layer``, made on ``self.device`` (see the module docstring)."""
        return {name: self.tensor(self.paths[(layer, name)], seed, seeding) for name in names}

    def tensor(self, path: str, seed: int, seeding: Seeding | None = None) -> Tensor:
        seeding = seeding or _forked_seed
        owner_path, _, name = path.rpartition(".")
        chain = _modules_down_to(self.module, owner_path)
        owner = chain[-1][1]
        slots: dict[str, Any] = owner._parameters if name in owner._parameters else owner._buffers
        with self._lock:  # thread ranks make tensors of one module: one swap at a time
            meta = slots[name]
            if meta is None or not meta.is_meta:
                raise AssertionError(f"{path} is not a meta tensor")  # ModuleInit is made for meta ones
            original = parametrized_original(self.module, path)
            if original is not None:  # weight_norm's g or v (parametrized_init.py)
                host, tensor, index = original
                where = f"{host}.{tensor}" if host else tensor
                made = make_original(self.module, host, tensor, index, self.device, seeding(path_seed(seed, where)))
                return made.to(meta.dtype).contiguous()
            checked = self._checked.get(path)
            if checked is not None:  # its initializer sets every element: one make, from the first check's fill
                return self._make(chain, path, slots, meta, seed, seeding, checked, fill=0)
            constructor_first = False
            first, second = self._make_twice(chain, path, slots, meta, seed, seeding, constructor_first)
            if not _same(first, second, meta) and self._resets_first(owner):
                # Left unset by the initializer: in the eager model it holds what the owner's
                # constructor made (torch's layers: reset_parameters()), then the initializer ran.
                constructor_first = True
                first, second = self._make_twice(chain, path, slots, meta, seed, seeding, constructor_first)
            if not _same(first, second, meta):
                raise self._unset(owner, path)
            self._checked[path] = constructor_first
        return second

    def _make_twice(
        self, chain: list[tuple[str, nn.Module]], path: str, slots: dict[str, Any], meta: Tensor, seed: int,
        seeding: Seeding, constructor_first: bool,
    ) -> tuple[Tensor, Tensor]:
        """The tensor at ``path`` made from a fill of zeros and from a fill of ones."""
        zeros, ones = (self._make(chain, path, slots, meta, seed, seeding, constructor_first, fill) for fill in (0, 1))
        return zeros, ones

    def _make(
        self, chain: list[tuple[str, nn.Module]], path: str, slots: dict[str, Any], meta: Tensor, seed: int,
        seeding: Seeding, constructor_first: bool, fill: int,
    ) -> Tensor:
        """The tensor at ``path`` made from a fill of ``fill`` (one module swap)."""
        name = path.rpartition(".")[2]
        try:
            empty = torch.full(meta.shape, fill, dtype=meta.dtype, device=self.device)
            slots[name] = nn.Parameter(empty, meta.requires_grad) if isinstance(meta, nn.Parameter) else empty
            with seeding(path_seed(seed, path)), torch.no_grad():
                if constructor_first:
                    getattr(chain[-1][1], "reset_parameters")()  # noqa: B009 - checked callable by the caller
                self._initialize(chain, path)
            return slots[name].detach()
        finally:
            slots[name] = meta

    def _resets_first(self, owner: nn.Module) -> bool:
        """Whether a tensor the initializer leaves unset is made by the owner's reset_parameters()
        first: where the initializer is not that method itself."""
        own = self.init_fn is not None or self._holds_transformers_model()
        return own and callable(getattr(owner, "reset_parameters", None))

    def _unset(self, owner: nn.Module, path: str) -> FunctionalizeError:
        how = self._default_name() if self.init_fn is None else "init_fn"
        owner_name = type(owner).__name__
        if callable(getattr(owner, "reset_parameters", None)):
            cause = (f" {owner_name}'s reset_parameters() was run first, as its constructor runs it, and "
                     "leaves them unset too." if self._resets_first(owner) else "")
            fix = (f"Pass functionalize(..., init_fn=fn) with an fn(module) or fn(module, path) that sets "
                   f"every element of {path!r} when given the {owner_name}")
        else:
            cause = (f" {owner_name} has no reset_parameters(), and what its constructor sets (such as a "
                     "torch.ones in its __init__) is not run on a model built on the meta device.")
            fix = (f"Set it in init_fn, for the {owner_name} or a module above it (e.g. "
                   f"`if isinstance(module, {owner_name}): ...`), or give {owner_name} a reset_parameters() "
                   "that sets its own parameters and buffers")
        return FunctionalizeError(
            f"initializing {path!r} ({owner_name}, {how}) left some of its elements unset (or changed its "
            f"shape or dtype), so they would hold whatever memory held before.{cause} {fix} "
            "(docs/guide.md, \"Models larger than one rank\")."
        )

    def check_can_make_parameters(self) -> None:
        """Refuse to make parameters by torch's reset_parameters() for a model that defines its own
        init method: the eager model runs that method (nanoGPT's ``self.apply(self._init_weights)``),
        a meta build would not, and would train from another init without a word."""
        if self.init_fn is not None or is_transformers_model(self.module):
            return
        # (a wrapped transformers model's own _init_weights runs below the wrapper: the wrapper's modules' count)
        inside = {id(m) for sub in self.module.modules() if is_transformers_model(sub) for m in sub.modules()}
        methods = own_init_methods(self.module, skip=inside)
        if methods:
            root = type(self.module).__name__
            raise FunctionalizeError(
                f"init: {root} was built on the meta device and defines its own initialization "
                f"({', '.join(methods)}), which init does not run by itself: each parameter would be made by "
                "its layer's reset_parameters() (torch's defaults), another init than the eager model's. "
                "Pass functionalize(..., init_fn=fn), an fn(module) or fn(module, path) (the module's path "
                "in the model) that does per module what the constructor does: e.g. "
                "init_fn=model._init_weights, plus a rule for whatever the constructor sets after "
                "self.apply(...) (nanoGPT's scaled c_proj) or in a module's __init__ "
                "(docs/guide.md, \"Models larger than one rank\"). To make them by reset_parameters() "
                "knowingly, pass init_fn=lambda module: None (a tensor an init_fn leaves unset is made "
                "by its layer's reset_parameters()). Or start from stored weights "
                "(sw.checkpoint.init_from_pretrained, init_from_state_dict or init_from_dcp)."
            )

    def _initialize(self, chain: list[tuple[str, nn.Module]], path: str) -> None:
        owner = chain[-1][1]
        if self.init_fn is not None:
            init = as_path_init(self.init_fn)
            for module_path, module in reversed(chain):
                init(module, module_path)
        elif self._holds_transformers_model():
            # As transformers' post_init (smart_apply): each module by the _init_weights of the nearest
            # transformers model at or above it (a nested one's own: an encoder-decoder's encoder; a model
            # wrapped in a module of one's own, by its own), the modules above the outermost by none.
            inits: list[Callable[[nn.Module], Any] | None] = []
            init_weights: Callable[[nn.Module], Any] | None = None
            for _, module in chain:
                if is_transformers_model(module):
                    init_weights = getattr(module, "_init_weights")  # noqa: B009 - HF's
                inits.append(init_weights)
            for (_, module), init in zip(reversed(chain), reversed(inits), strict=True):
                if init is not None:
                    init(module)
        elif callable(reset := getattr(owner, "reset_parameters", None)):
            reset()
        else:
            raise _no_initializer(owner, path)


def _same(first: Tensor, second: Tensor, meta: Tensor) -> bool:
    """Whether the two makes of ``meta`` agree, in shape and dtype too: every element was set."""
    return first.shape == meta.shape and first.dtype == meta.dtype and torch.equal(first, second)


def _no_initializer(owner: nn.Module, path: str) -> FunctionalizeError:
    """The refusal of a meta tensor whose module has no initializer, naming only ways out that work
    where it is made: a buffer by ``functionalize`` (before any weights can be loaded), a parameter
    by ``Step.init`` (which a start from stored weights replaces)."""
    name = path.rpartition(".")[2]
    owner_name = type(owner).__name__
    ways = [
        "pass functionalize(..., init_fn=fn), an fn(module) or fn(module, path) that initializes a module's "
        "own parameters and buffers (applied as model.apply(fn) would: to the module and each module above it)",
        f"give {owner_name} a reset_parameters() that sets its own parameters and buffers",
    ]
    if name in owner._parameters:
        kind, where, note = "parameter", "init", ""
        ways.append("start from stored weights instead of making them (sw.checkpoint.init_from_pretrained, "
                    "init_from_dcp or init_from_state_dict in place of step.init)")
    else:
        kind, where = "buffer", "functionalize"
        ways.append(
            f"make the buffer real where {owner_name} makes it, by giving its factory a device "
            "(torch.ones(..., device='cpu') is made on the CPU under `with torch.device('meta')`): "
            "functionalize then keeps its value"
        )
        note = (f" (Weights loaded later, as sw.checkpoint.init_from_pretrained loads them, replace a "
                f"persistent buffer's value, but functionalize must make {name!r} first.)")
    return FunctionalizeError(
        f"{where}: {kind} {path!r} is on the meta device and its module ({owner_name} at "
        f"{'.'.join(path.split('.')[:-1]) or 'the root'!r}) has no reset_parameters() to initialize it. "
        f"Either {'; or '.join(ways)}.{note}"
    )


def _modules_down_to(root: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """[("", root), ..., (path, the module at ``path``)]: each module with its path in ``root``."""
    chain = [("", root)]
    for part in path.split(".") if path else []:
        above, module = chain[-1]
        chain.append((f"{above}.{part}" if above else part, module.get_submodule(part)))
    return chain


def unfilled_frozen(chain: Any) -> list[str]:
    """The frozen parameters of a meta-built chain that still hold the split's stand-in (one zero,
    expanded: no stored value was loaded into them), as ``layer.name``."""
    if getattr(chain, "init", None) is None:
        return []
    return [f"{layer.name}.{name}" for layer in chain.layers for name, t in layer.buffers.items()
            if is_stand_in(t)]  # (its buffers are made: ModuleInit.tensor's are whole)


def is_stand_in(t: Tensor) -> bool:
    """Whether ``t`` is the split's stand-in for a meta-built frozen parameter (one zero, expanded)."""
    return t.numel() > 1 and _expanded(t)


def _expanded(t: Tensor) -> bool:
    return all(stride == 0 for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1)


def is_transformers_model(module: nn.Module) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")  # never import transformers ourselves
    base = getattr(modeling, "PreTrainedModel", None)
    return base is not None and isinstance(module, base)


def stand_in(
    module: nn.Module, buffers: Mapping[int, Tensor], device: torch.device
) -> tuple[nn.Module, dict[int, Tensor]]:
    """A copy of a meta-built ``module`` that runs: each meta parameter a zero of its shape on
    ``device`` that holds one element (expanded), each meta buffer its made value from
    ``buffers`` (by id), the real tensors shared. What the split records its calls on. Also: id
    of each stand-in tensor -> the module's own tensor it stands for."""
    memo: dict[int, Any] = {}
    origin: dict[int, Tensor] = {}
    for _, t in module.named_parameters(remove_duplicate=False):
        if id(t) not in memo:
            zero = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
            memo[id(t)] = nn.Parameter(zero, t.requires_grad) if t.is_meta else t
            origin[id(memo[id(t)])] = t
    for _, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = buffers[id(b)] if b.is_meta else b
            origin[id(memo[id(b)])] = b
    return copy.deepcopy(module, {**kept_in_copies(module), **memo}), origin
