"""The one place that touches torch's checkpoint machinery.

Everything torch-version-specific about remat lives here: non-reentrant
``torch.utils.checkpoint.checkpoint``, the experimental selective-checkpoint
API (``create_selective_checkpoint_contexts``, ``CheckpointPolicy`` and the
cache the two modes share) and saved-tensor hooks. Remat
policies stay plain predicates ``policy(op, *args, **kwargs) -> bool``;
:func:`sac_policy_fn` adapts one to torch. ``tests/transforms/remat`` checks
every assumption made here, so a torch upgrade that changes them fails loudly.

Assumptions, checked by ``tests/transforms/remat`` on the installed torch:

* non-reentrant checkpoint keeps the tensor positional arguments through
  autograd's saved-tensor machinery, so *outer* saved-tensor hooks see them
  (and can offload or measure them), while ops inside the region are packed
  by checkpoint's own hooks as placeholders that hold no memory;
* selective checkpoint asks ``policy_fn(ctx, op, *args, **kwargs)`` about
  every op in forward and caches the outputs of ops answered ``MUST_SAVE``,
  outside autograd, each wrapped in an object whose ``val`` is the tensor, in
  a ``storage`` mapping shared by the two modes that
  ``create_selective_checkpoint_contexts`` returns. That mapping comes in one
  of two forms:

  - **indexed** (torch 2.13 on): op -> dict of invocation index -> entry. The
    forward writes every op's entry (a marker for recomputed ones); a
    recomputation reads saved entries by index and overwrites each with a
    "consumed" marker;
  - **queued** (torch 2.4 to 2.12): op -> list. The forward appends saved
    entries; a recomputation takes them with ``pop(0)``.

torch thus lets a region be backpropagated only once. A zero-bubble pipeline
schedule computes input and weight gradients in two backward calls, each of
which recomputes the region; :func:`selective_contexts` therefore gives both
modes a storage that keeps every entry written in forward (the consumed marks
are ignored, the queue is replayed from its start at every recomputation).
The cache then lives as long as the region's autograd graph (until the layer's
last backward) instead of being dropped entry by entry. The same storage shows
each saved output to the engine's accounting, whichever form torch uses.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, SupportsIndex

import optree
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ...engine.model import host_random
from ...engine.plan.accounting import current_observer
from ...engine.stack.in_layer import ForwardContext
from ...engine.torch_api import storage_key as engine_storage_key
from ...engine.torch_api import written_tensors
from .names import CHECKPOINT_NAME_OP
from .own_generators import RefuseOwnGenerators, refuse_own_generator
from .policies import EverythingSaveable, NothingSaveable, OffloadToCpu

Observer = Callable[[torch.Tensor], None]
Written = dict[Any, str]  # a saved output's storage an op wrote into -> the refusal of a recomputation's read of it
Predicate = Callable[..., Any]

def storage_key(t: torch.Tensor) -> Any:
    """Identifies the memory a tensor lives in (the engine's key, which also tells meta storages apart)."""
    return engine_storage_key(t)


def _show_saved(entry: Any, observe: Observer | None) -> None:
    """Show the tensors of one cache entry (torch wraps each in an object with ``val``) to ``observe``."""
    if observe is None:
        return
    for leaf in optree.tree_leaves(entry):
        t = getattr(leaf, "val", leaf)
        if isinstance(t, torch.Tensor):
            observe(t)


class _WriteOnce(dict[Any, Any]):
    """One op's entries in the indexed form: the forward writes each once; the consumed mark is ignored. A read of
    an entry an op wrote into after it was saved (``written``) is refused (:func:`_refuse_written`)."""

    def __init__(self, observe: Observer | None, written: Written | None = None) -> None:
        super().__init__()
        self.observe, self.written = observe, written

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            _show_saved(value, self.observe)
            super().__setitem__(key, value)

    def get(self, key: Any, default: Any = None) -> Any:
        entry = super().get(key, default)
        if self.written:
            _refuse_written(entry, self.written)
        return entry


class _Replay(list[Any]):
    """One op's entries in the queued form: ``pop(0)`` reads the next one without removing it (one an op wrote into
    after it was saved refused, as :class:`_WriteOnce`)."""

    def __init__(self, observe: Observer | None, written: Written | None = None) -> None:
        super().__init__()
        self.observe, self.written = observe, written
        self.cursor = 0

    def append(self, entry: Any) -> None:
        _show_saved(entry, self.observe)
        super().append(entry)

    def pop(self, index: SupportsIndex = -1) -> Any:
        if index != 0:
            return super().pop(index)
        if self.cursor >= len(self):
            raise RuntimeError(
                f"remat: a recomputation asked for saved output {self.cursor + 1} of an op that saved "
                f"{len(self)} in forward; the layer ran differently when recomputed (data-dependent control flow?)"
            )
        entry = self[self.cursor]
        self.cursor += 1
        if self.written:
            _refuse_written(entry, self.written)
        return entry


class _Rewound:
    """Enters the recomputation mode after rewinding every queue: each recomputation reads from the start.

    (A recomputation may stop early, once it has what the backward asked for, leaving a queue part read.)
    """

    def __init__(self, mode: Any, storage: Mapping[Any, _Replay]) -> None:
        self.mode, self.storage = mode, storage

    def __enter__(self) -> Any:
        for queue in self.storage.values():
            queue.cursor = 0
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.mode.__exit__(*exc)


def storage_form() -> str:
    """``"indexed"`` or ``"queued"``: which form of cache the installed torch's selective checkpoint keeps."""
    caching, _ = create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    factory = getattr(caching.storage, "default_factory", None)
    if factory is dict:
        return "indexed"
    if factory is list:
        return "queued"
    raise RuntimeError(
        f"torch {torch.__version__}: selective checkpoint's cache is a {type(caching.storage).__name__} of "
        f"{factory!r}; remat knows a defaultdict of dict or of list. Please report this torch version."
    )


_FORM = storage_form()


def selective_contexts(
    policy_fn: Callable[..., CheckpointPolicy], observe: Observer | None = None, written: Written | None = None,
) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts(policy_fn)`` whose cache survives repeated backward calls, shows
    every output it saves to ``observe``, and refuses a recomputation's read of one ``written`` names."""
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    if _FORM == "indexed":
        indexed: defaultdict[Any, _WriteOnce] = defaultdict(lambda: _WriteOnce(observe, written))
        caching.storage = cached.storage = indexed
        return caching, cached
    queued: defaultdict[Any, _Replay] = defaultdict(lambda: _Replay(observe, written))
    caching.storage = cached.storage = queued
    return caching, _Rewound(cached, queued)


def sac_policy_fn(
    predicate: Predicate, layer: str = "", policy: Any = None, tagged: Callable[[str], None] | None = None,
    saved: set[Any] | None = None, storage: Callable[[], Mapping[Any, Any]] | None = None,
    written: Written | None = None,
) -> Callable[..., CheckpointPolicy]:
    """Adapt ``predicate(op, *args, **kwargs) -> bool`` to torch's selective-checkpoint policy_fn.

    It sees every op of the forward with its arguments, so it also refuses an op it would have
    recomputed that draws from a generator of the layer's own (``own_generators``): ``layer`` and
    ``policy`` (the one remat was given, ``predicate`` by default) name them in that error. ``tagged``
    hears the name of every ``checkpoint_name`` call it sees (which names the layer tags). ``saved``: the storages
    of the outputs saved so far (filled as they are saved; ``storage()`` the cache, by op, to name the one that saved
    it), an op writing into one of which is noted in ``written`` (by storage: the savers and the writer), and a
    recomputation reading it refused: torch checks a saved output's version counter only, which a write through an
    ``_unsafe_view`` of it does not move (nn.GRU's CPU kernel adds into the gates of the input projection it computed
    for every step at once: the backward read the changed values, 3.9% off in the gradient norm, float64, one
    device, with no error).
    """
    shown = predicate if policy is None else policy

    def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if tagged is not None and op == CHECKPOINT_NAME_OP and len(args) > 1:
            tagged(args[1])
        if saved and storage is not None and written is not None:
            into = ({_storage_or_none(t) for t in written_tensors(op, args, kwargs)} & saved) - {None}
            if into:
                # Noted, refused where a recomputation reads it (a write after the layer's last use of an output,
                # `out += x` at its end, changes nothing the backward reads: torch recomputes only up to what
                # the backward needs, and addmm's backward reads its inputs)
                savers = sorted({str(o) for o, entries in storage().items() if _holds(entries, into)})
                which = f"the output of {', '.join(savers) or 'an op'} ({op} writes into it)"
                for key in into:
                    written.setdefault(key, _mutated_message(layer, shown, [], which))
        save = predicate(op, *args, **kwargs)
        if not isinstance(save, bool):
            # Not a TypeError: torch turns a TypeError raised inside an operator like `@` into NotImplemented.
            raise ValueError(
                f"remat policy {predicate!r} returned {save!r} for {op}; "
                "a policy answers True (save) or False (recompute)"
            )
        if not save:
            refuse_own_generator(layer, shown, op, args, kwargs, selective=True)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


class _KeepForBackward(saved_tensors_hooks):
    """Saved-tensor hooks: show each saved tensor to ``observer``; optionally move it to the CPU.

    Tensors whose storage is in ``stay`` (the layer's parameters and buffers,
    which live on regardless) and tensors already on the CPU are never moved.
    """

    def __init__(self, observer: Observer | None, *, offload: bool, pin_memory: bool, stay: frozenset[Any]) -> None:
        def pack(t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if observer is not None:
                observer(t)
            if not offload or t.device.type == "cpu" or storage_key(t) in stay:
                return None, t
            pin = pin_memory and torch.cuda.is_available() and not t.is_sparse
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return t.device, host

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def run_layer(
    fn: Callable[[Any, Any], Any], tensors: Mapping[str, torch.Tensor], x: Any, policy: Predicate, layer: str = "",
    watch_generators: bool = True, host_draws: bool = True, tagged: Callable[[str], None] | None = None,
    heard_draws: Callable[[bool], None] | None = None, copy_input: bool = False,
    wrote_input: Callable[[bool], None] | None = None,
) -> Any:
    """``fn(tensors, x)`` with backward recomputing what ``policy`` does not save.

    ``everything_saveable`` runs ``fn`` as it is (torch's selective checkpoint
    with every op saved would cache more than autograd keeps), and
    ``nothing_saveable`` is plain non-reentrant checkpoint; any other
    predicate goes through selective checkpoint. The region's tensors are
    passed to checkpoint as flat positional arguments so that they are the
    saved inputs that outer hooks see. ``layer`` names the layer in errors:
    an op drawing from a generator of the layer's own is refused where it would
    be recomputed, and torch's error for a saved output changed in place says
    which layer, policy and op it was about. ``host_draws``: whether the layer
    may draw from Python's ``random`` or numpy's global generator, whose state
    its recomputations then start from as its forward did (saving and setting
    numpy's costs about 35 us each: a layer of torch's own skips it). ``heard_draws``
    hears whether the forward drew from them. ``tagged``
    hears the names of the ``checkpoint_name`` calls a selective policy is asked about. ``copy_input``: the
    region hands ``fn`` a copy of each floating tensor of ``x``, and ``wrote_input`` hears whether ``fn`` wrote
    into one in place (torchvision's VGG features: ``nn.ReLU(inplace=True)``, a layer of its own). A
    checkpoint keeps its input to recompute from, so a write into that input itself would leave the
    recomputation other values (torch refuses it in backward: "modified by an inplace operation"); into a copy
    made inside the region, made again by each recomputation, it computes what the layer computes without remat
    (tensors of one storage copied as one: ``_copied_inputs``). Without ``copy_input``, a write into ``x`` that
    ``wrote_input`` watches for is refused, naming the layer (torch's refusal would come in backward, unnamed).
    """
    observe = current_observer()  # set while the engine's accounting measures what layers keep
    offload = isinstance(policy, OffloadToCpu)
    inner = policy.policy if isinstance(policy, OffloadToCpu) else policy
    hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if offload or observe is not None:
        stay = frozenset(storage_key(t) for t in tensors.values() if isinstance(t, torch.Tensor))
        pin = policy.pin_memory if isinstance(policy, OffloadToCpu) else False
        hooks = _KeepForBackward(observe, offload=offload, pin_memory=pin, stay=stay)
    with hooks:
        if isinstance(inner, EverythingSaveable):
            return fn(dict(tensors), x)
        region_args: Any = (dict(tensors), x)
        leaves, spec = optree.tree_flatten(region_args, none_is_leaf=True)

        # Recomputed in the backward, which on CUDA runs on the device's autograd thread: there the
        # region's layers find the forward's mesh and backend (tensor parallel's collectives).
        forward_context = ForwardContext()
        plain = isinstance(inner, NothingSaveable)
        # Plain checkpoint asks no policy about the ops: a dispatch mode watches the forward for
        # own generators (under no_grad nothing is recomputed, so nothing is watched; ``Remat``
        # asks only its first forward to be watched).
        watching = plain and watch_generators and torch.is_grad_enabled()
        caches: list[Mapping[Any, Any]] = []  # selective checkpoint's cache, for the mutation error
        # torch's checkpoint replays its own generators, not Python's random or numpy's: the
        # recomputations start from the state of those the forward found, and leave them as found.
        # (Under no_grad nothing is recomputed; ``host_draws`` False: the layer cannot draw from them.)
        host = host_random.Replay() if host_draws and torch.is_grad_enabled() else None

        guarded = False  # whether this checkpoint's forward ran watched: its recomputations run as it did

        def region(*flat: Any) -> Any:
            nonlocal watching, guarded
            region_tensors, region_x = optree.tree_unflatten(spec, list(flat))
            guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if watching or guarded:
                # The forward, and its recomputations under the same mode: torch picks some ops' kernels by
                # whether a dispatch mode is on (F.ctc_loss saves 2 tensors more under one), and a recomputation
                # that saved otherwise than its forward fails in torch's checkpoint (CheckpointError).
                watching, guarded = False, True
                guard = RefuseOwnGenerators(layer, policy)
            if copy_input:
                region_x, watched = _copied_inputs(region_x)
            else:  # (a layer whose first forward wrote nothing: a later write is refused, naming it)
                watched = _floating(region_x) if wrote_input is not None else []
            versions = [c._version for c in watched]
            try:
                with guard, host.run() if host is not None else contextlib.nullcontext():
                    out = forward_context.run(lambda: fn(region_tensors, region_x))
                if wrote_input is not None:
                    wrote = [c._version for c in watched] != versions
                    wrote_input(wrote)
                    if wrote and not copy_input:
                        raise RuntimeError(_written_later_message(layer, policy))
                if host is not None and heard_draws is not None:
                    heard_draws(host.drew)  # as its first run, the forward, found (a recomputation: the same)
                return out
            except RuntimeError as error:
                if _MUTATED not in str(error):
                    raise
                raise RuntimeError(_mutated_message(layer, policy, caches)) from error

        if plain:
            return checkpoint(region, *leaves, use_reentrant=False)

        def context_fn() -> tuple[Any, Any]:
            saved: set[Any] = set()  # the storages of the outputs the policy saved, for the write check

            def seen(t: torch.Tensor) -> None:
                saved.add(_storage_or_none(t))
                if observe is not None:
                    observe(t)

            caching: Any = None
            written: Written = {}  # a saved output's storage an op wrote into: the refusal, if a recomputation reads it
            policy_fn = sac_policy_fn(inner, layer, policy, tagged, saved, lambda: caching.storage, written)
            caching, cached = selective_contexts(policy_fn, seen, written)
            caches.append(caching.storage)
            return caching, cached

        return checkpoint(region, *leaves, use_reentrant=False, context_fn=context_fn)


def _floating(x: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(x, none_is_leaf=True)
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _copied_inputs(x: Any) -> tuple[Any, list[torch.Tensor]]:
    """``x`` with each floating tensor a copy, for a layer that may write into its input, and the copies. Tensors
    of one storage (``(h, h)``, ``h`` beside a view of it) stay one: one copy of the tensor that spans the storage,
    the others views of it as they were of the original, so that a write into one shows in the others as it did.
    Where none spans it (two slices of a tensor the layer is not given), they are left as they are: a write then
    fails in backward, as without the copy, rather than be seen in one and not the other."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in _floating(x):
        groups.setdefault(storage_key(t), []).append(t)
    replaced: dict[int, torch.Tensor] = {}
    copies: list[torch.Tensor] = []
    for members in groups.values():
        whole = next((t for t in members if _spans_storage(t)), None)
        if whole is None:
            if len(members) == 1:
                replaced[id(members[0])] = members[0].clone()
                copies.append(replaced[id(members[0])])
            continue
        copy = whole.clone()
        copies.append(copy)
        for t in members:
            replaced[id(t)] = copy if t is whole else copy.as_strided(t.size(), t.stride(), t.storage_offset())
    return optree.tree_map(lambda t: replaced.get(id(t), t), x, none_is_leaf=True), copies


def _spans_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage's whole, laid out contiguously from its start (its clone is laid out alike)."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _written_later_message(layer: str, policy: Any) -> str:
    name = f"layer {layer!r}" if layer else "a layer"
    return (
        f"remat({policy!r}): {name} wrote into its input in place on this call, though its first forward did not (a "
        "write on some batches only, x.clamp_() when a value is out of range?): its checkpoint keeps that input to "
        "recompute from, and the write changed it, so the backward would recompute from other values. Write it out "
        "of place (x = x.clamp(...)), or leave the layer out of remat (remat(..., layers=[...]) without it); its "
        "next calls run on a copy of their input"
    )


# torch's error when an output selective checkpoint saved was changed before backward read it
_MUTATED = "cached during selective activation checkpoint has been mutated"


def _mutated_message(layer: str, policy: Any, caches: list[Mapping[Any, Any]], which: str = "") -> str:
    """The error for a saved output changed in place: the layer, the policy, the op, the fixes."""
    ops = sorted({str(op) for cache in caches for op, entries in cache.items() if _changed(entries)})
    which = which or (f"the output of {', '.join(ops)}" if ops else "an output")
    name = f"layer {layer!r}" if layer else "a layer"
    return (
        f"remat({policy!r}): {name} changes {which} in place after the policy saved it for backward "
        "(torch's selective checkpoint keeps the saved tensor itself, so the backward would read the "
        "changed values). Where that op is your code's, write it out of place (x = x + y for x += y, "
        "h = h.relu() for h.relu_()); where it is a torch kernel's own (nn.GRU, nn.LSTM, nn.RNN write into "
        "the gates they compute), use a policy that saves nothing of that layer's (nothing_saveable), or leave "
        "the layer out of remat (remat(..., layers=[...]) without it)"
    )


def _refuse_written(entry: Any, written: Written) -> None:
    """Refuse a recomputation's read of a saved entry that an op wrote into after it was saved."""
    for leaf in optree.tree_leaves(entry):
        val = getattr(leaf, "val", None)
        if isinstance(val, torch.Tensor):
            found = written.get(_storage_or_none(val))
            if found is not None:
                raise RuntimeError(found)


def _storage_or_none(t: torch.Tensor) -> Any:
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse) is no saved output's
        return None


def _holds(entries: Any, storages: set[Any]) -> bool:
    """Whether a cache entry holds a tensor in one of ``storages``."""
    values = entries.values() if isinstance(entries, Mapping) else entries
    leaves: list[Any] = optree.tree_leaves(list(values))  # type: ignore[arg-type]
    return any(isinstance(getattr(leaf, "val", None), torch.Tensor) and _storage_or_none(leaf.val) in storages
               for leaf in leaves)


def _changed(entries: Any) -> bool:
    """Whether a cache entry holds a tensor changed since it was saved (torch's wrappers record
    the tensor's version counter when they save it)."""
    values = entries.values() if isinstance(entries, Mapping) else entries
    leaves: list[Any] = optree.tree_leaves(list(values))  # type: ignore[arg-type]
    for leaf in leaves:
        version = getattr(leaf, "version", None)
        val = getattr(leaf, "val", None)
        if version is not None and isinstance(val, torch.Tensor) and val._version != version:
            return True
    return False
