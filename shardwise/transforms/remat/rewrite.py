"""``remat``: rewrite a Step's chain so selected layers recompute activations in backward."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...engine.model.chain import Chain, LayerFn
from ...engine.model.module_call import DIRECT, calls_forward_alone
from ...engine.model.predicted_state import predicting_on_fake_tensors
from ...engine.model.reuse import reuse_key
from ...engine.stack.compose import REWRITE, add
from ...engine.step.step import Step
from . import policies as P
from ._torch_sac import run_layer
from .own_generators import refusing_own_host_generators
from .recompute_state import refusing_state_the_recompute_reads
from .tagged_names import TaggedNames

#: Policies by name, for ``remat(step, policy="dots_saveable")``.
POLICIES: dict[str, Any] = {
    "nothing_saveable": P.nothing_saveable,
    "everything_saveable": P.everything_saveable,
    "dots_saveable": P.dots_saveable,
    "offload_to_cpu": P.offload_to_cpu(),
}


@dataclass(frozen=True, eq=False)
class Remat:
    """A layer function run under a remat policy: ``Remat(fn, policy)(tensors, x) == fn(tensors, x)``."""

    fn: LayerFn
    policy: Any
    layer: str = ""  # its name, for errors
    # Under save_only_these_names: the names the remat's layers tag, shared by them (tagged_names.py).
    names: TaggedNames | None = field(default=None, repr=False)
    # Whether its first forward with gradients is still to come: only that one is watched for random
    # ops drawing from a generator of the layer's own (a property of its code; watching every forward
    # through a dispatch mode cost a small model's step about 10%).
    _unwatched: list[bool] = field(default_factory=lambda: [True], repr=False)
    # Whether its layer may draw from Python's random or numpy's global generator, whose state its
    # recomputation must then start from as its forward did: until its watched forward shows it drew
    # nothing (saving and comparing their state cost a 6-block GPT's remat step 2.6%, every step).
    _host_may_draw: list[bool] = field(default_factory=lambda: [True], repr=False)
    # Whether its first forward with gradients on real tensors is still to come: that one is watched for state
    # the forward leaves and its recomputation would read (recompute_state.py).
    _state_unwatched: list[bool] = field(default_factory=lambda: [True], repr=False)
    # Whether its layer writes into its input in place (None: not known until its first forward with gradients):
    # a checkpoint keeps that input to recompute from, so such a layer is handed a copy (run_layer's copy_input).
    _writes_input: list[bool | None] = field(default_factory=lambda: [None], repr=False)
    # Its backward runs its forward again: a zero-bubble weight pass takes it whole, not branch by
    # branch (engine/model/split_backward.py: each branch's pass would recompute it again).
    recomputes_in_backward: ClassVar[bool] = True

    def __call__(self, tensors: dict[str, Any], x: Any) -> Any:
        grad = torch.is_grad_enabled()
        watch = bool(self._unwatched) and grad
        names = self.names if grad else None
        tagged = None if names is None or names.checked else names.tag
        inner = self.policy.policy if isinstance(self.policy, P.OffloadToCpu) else self.policy
        host = self._host_may_draw[0] and not _torch_module_alone(self.fn)
        copy = grad and self._writes_input[0] is not False
        writes: dict[str, Any] = {"copy_input": copy, "wrote_input": self._heard_writes if grad else None}
        if isinstance(inner, P.EverythingSaveable):  # (that one recomputes nothing)
            out = run_layer(self.fn, tensors, x, self.policy, self.layer, watch_generators=False, host_draws=host,
                            tagged=tagged)
        elif not watch:
            out = self._run(tensors, x, lambda: run_layer(self.fn, tensors, x, self.policy, self.layer,
                                                          watch_generators=False, host_draws=host, tagged=tagged,
                                                          **writes))
        else:
            with refusing_own_host_generators(self.fn, self.layer, self.policy):
                out = self._run(tensors, x, lambda: run_layer(
                    self.fn, tensors, x, self.policy, self.layer, watch_generators=True, host_draws=host,
                    tagged=tagged, heard_draws=self._heard_draws, **writes))
            self._unwatched.clear()  # once a watched forward has passed: a refused one is refused again
        if names is not None:
            names.ran_layer(self.layer)
        return out

    def _run(self, tensors: dict[str, Any], x: Any, run: Any) -> Any:
        """``run()``, on the first forward with gradients on real tensors watched for state its recomputation
        would read (recompute_state.py)."""
        if not (self._state_unwatched and torch.is_grad_enabled()) or predicting_on_fake_tensors():
            return run()
        out = refusing_state_the_recompute_reads(self.fn, tensors, x, self.layer, run)
        self._state_unwatched.clear()
        return out

    def _heard_draws(self, drew: bool) -> None:
        self._host_may_draw[0] = drew

    def _heard_writes(self, wrote: bool) -> None:
        self._writes_input[0] = bool(self._writes_input[0]) or wrote  # once written, always copied

    @property
    def __wrapped__(self) -> LayerFn:
        return self.fn

    def reuse_key(self) -> Hashable | None:
        """Equal for layers that compute alike under an equal policy (engine/model/reuse.py): what
        is recomputed, saved or offloaded is the policy's choice on the same operations; None when
        the layer does not say what it computes or the policy cannot be compared (not hashable)."""
        inner = reuse_key(self.fn)
        if inner is None:
            return None
        key = (Remat, self.policy, inner)
        try:
            hash(key)
        except TypeError:
            return None
        return key


def _torch_module_alone(fn: Any) -> bool:
    """Whether ``fn`` calls one module of torch's own that :data:`module_call.DIRECT` knows (a Linear, a
    Dropout, ...) and nothing else runs with it (no hook, no patched forward): it draws from no
    generator but torch's, so its recomputation needs no host state replayed."""
    module = getattr(fn, "module", None)
    return isinstance(module, torch.nn.Module) and type(module) in DIRECT and calls_forward_alone(module)


def remat_of(fn: Any) -> Remat | None:
    """The :class:`Remat` inside ``fn``, following ``__wrapped__`` through other transforms' wrappers."""
    seen = 0
    while fn is not None and seen < 64:
        if isinstance(fn, Remat):
            return fn
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def resolve_policy(policy: Any) -> Any:
    """A policy given by value or name; anything else is refused with the list of choices."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(
                f"remat(policy={policy!r}): unknown policy; choose one of {sorted(POLICIES)}, "
                "or pass a predicate such as save_only_these_names('attn_out')"
            )
        return POLICIES[policy]
    P.refuse_class(policy, "remat(policy=...)")
    if policy is P.save_only_these_names or policy is P.offload_to_cpu:
        raise TypeError(
            f"remat(policy={policy.__name__}): this builds a policy, call it: "
            f"policy={policy.__name__}(...)"
        )
    if not callable(policy):
        raise TypeError(
            f"remat(policy={policy!r}): unknown policy; a policy is a predicate policy(op, *args, **kwargs) -> bool "
            f"such as dots_saveable, or one of the names {sorted(POLICIES)}"
        )
    return policy


def select_layers(chain: Chain, layers: str | Sequence[str], every: int) -> list[str]:
    """Names of the layers to remat: those matching ``layers`` (fnmatch), then every ``every``-th of them."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"remat(every={every!r}): every is an int >= 1 (1: every selected layer)")
    patterns = [layers] if isinstance(layers, str) else list(layers)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"remat(layers={layers!r}): give 'all', a name pattern such as 'blocks.*', or a list of them")
    if patterns == ["all"]:
        matched = list(chain.names)
    else:
        matched = [n for n in chain.names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not matched:
        raise ValueError(
            f"remat(layers={layers!r}) matches no layer; the chain's layers are {list(chain.names)}"
        )
    return matched[::every]


@dataclass(frozen=True)
class RematSpec:
    """remat in a step's stack: the layers it runs under checkpointing, and the policy."""

    policy: Any
    layers: tuple[str, ...]

    name: ClassVar[str] = "remat"
    role: ClassVar[str] = REWRITE

    def rewrite(self, chain: Chain) -> Chain:
        chosen = set(self.layers)
        inner = self.policy.policy if isinstance(self.policy, P.OffloadToCpu) else self.policy
        names = (TaggedNames(inner.names, frozenset(chosen), self.policy)
                 if isinstance(inner, P.SaveOnlyTheseNames) else None)
        return Chain([
            dataclasses.replace(layer, fn=Remat(layer.fn, self.policy, layer.name, names))
            if layer.name in chosen else layer
            for layer in chain
        ])

    def __str__(self) -> str:
        return f"remat({self.policy_name}, layers={list(self.layers)})"

    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "__name__", None) or repr(self.policy)

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """What the Plan says of each layer this spec touches."""
        return {layer: f"remat {self.policy_name}" for layer in self.layers}


def remat(step: Step, policy: Any = P.nothing_saveable, *, layers: str | Sequence[str] = "all", every: int = 1) -> Step:
    """Run the selected layers of ``step`` under activation checkpointing with a save ``policy``.

    Each selected layer's function runs under torch's non-reentrant checkpoint
    with a selective-checkpoint policy: backward recomputes every value the
    policy does not save. ``layers`` is ``"all"``, an fnmatch pattern over
    layer names (``"blocks.*"``) or a list of them; ``every=k`` keeps every
    k-th of the matched layers, starting with the first. The result computes
    bitwise the same losses and parameters, in any order with the other
    transforms, and holds less for backward (see :func:`saved_bytes`). Apply it
    once (also with mixed_precision between: the stack refuses a second remat).
    ``policy`` is a policy value or name, not its class (``NothingSaveable()``).

    Dropout is replayed: checkpoint restores the default generators, which the
    step seeds; so are draws from Python's ``random`` and numpy's global
    generator (the recomputation starts from the state its forward found). An
    op drawing from a generator of the layer's own (torch's, or a
    ``random.Random`` / numpy generator object its module holds) is refused
    where it would be recomputed (``own_generators``), and an in-place change
    of an output a selective policy saved is refused in the backward, naming
    the layer, the policy and the op.
    """
    if not isinstance(step, Step):
        raise TypeError(f"remat(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    done = policies_of(step.base_chain)
    if done:
        raise ValueError(
            f"the chain's layers {sorted(done)} already run under remat (policy {next(iter(done.values()))!r}); "
            "remat would checkpoint them twice: build the chain without the Remat wrappers and apply remat once"
        )
    policy = resolve_policy(policy)
    chosen = select_layers(step.chain, layers, every)
    return add(step, RematSpec(policy, tuple(chosen)))


def policies_of(chain: Chain) -> Mapping[str, Any]:
    """Layer name -> the remat policy it runs under, for the layers that do."""
    return {layer.name: r.policy for layer in chain for r in [remat_of(layer.fn)] if r is not None}
