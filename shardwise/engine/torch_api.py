"""The private torch APIs shardwise relies on, each wrapped here and checked by tests/engine/test_storage.py.

Free a tensor's memory and refill it later, unseen by autograd (what FSDP does).

A gathered parameter buffer is used by a layer's forward, whose autograd graph
keeps views of it until that layer's backward. To really free the memory in
between, the storage is resized to zero bytes, and re-allocated and refilled
with the same values right before the backward. Autograd's version counter
would take the refill for a modification of a saved tensor, so the refill
runs under torch's ``_unsafe_preserve_version_counter``: a private API, used
here and nowhere else, checked by tests/engine/test_storage.py. ``storage_key`` reads
a storage's private ``_cdata`` address, ``accumulate_backward`` calls autograd's engine as
``torch.autograd.backward`` does (``_engine_run_backward``), ``version_of`` a tensor's version
counter, ``holders`` who holds a tensor's memory (its storage's and its own reference counts),
``view_base`` the tensor a view was made from (``Tensor._base``), ``computed_dtype`` the dtype a tensor was
computed in before the casts that made it (autograd nodes' ``_input_metadata``), and ``fake_tensors``
runs code on fake tensors (``torch._subclasses.FakeTensorMode``): shapes, dtypes and kernel choices of the real
device, no data and no arithmetic, and ``real_ops`` steps out of them inside such a block
(``unset_fake_temporarily``); ``dense_where_refused`` runs again, on dense copies, an op whose kernel refuses
an expanded input (a ``TorchDispatchMode``), and ``live_bytes`` follows the bytes of the storages the ops
inside a block make, until each is freed (a ``TorchDispatchMode`` too, and weak references to storages).
``flash_attention_cpu`` and its backward are torch's CPU flash attention kernel called directly
(``aten._scaled_dot_product_flash_attention_for_cpu``), which, unlike the public
``scaled_dot_product_attention``, returns each row's log-sum-exp. ``compiled_original``,
``compiled_in_place`` and ``drop_compiled_call`` read and undo ``torch.compile`` on a module
(``OptimizedModule._orig_mod``, ``Module._compiled_call_impl``), checked by tests/engine/test_uncompiled.py.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import TorchDispatchMode

from ..collectives.function import QuickApplyFunction

try:
    _preserve_version = torch.autograd._unsafe_preserve_version_counter
except AttributeError as exc:  # pragma: no cover - only on a torch that removed it
    raise ImportError(
        "shardwise needs torch.autograd._unsafe_preserve_version_counter (present in torch 2.1 to 2.13) to "
        "free sharded parameters between forward and backward; this torch no longer has it"
    ) from exc


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def free_storage(buffer: torch.Tensor) -> None:
    """Release ``buffer``'s memory; every view of it stays valid as an object but holds no data."""
    buffer.untyped_storage().resize_(0)


def refill_storage(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """Re-allocate a freed ``buffer`` and copy ``values`` in, keeping its autograd version."""
    if buffer.storage_offset() != 0 or not buffer.is_contiguous():
        raise ValueError("refill_storage needs a contiguous buffer that starts its storage")
    with torch.no_grad(), _preserve_version(buffer):
        buffer.untyped_storage().resize_(nbytes(buffer))
        buffer.copy_(values)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``: the root, for a view of a view), or None.
    A view shares its base's version counter: a write through either shows in both."""
    return t._base


def owns_storage(t: torch.Tensor) -> bool:
    """True when ``t`` is exactly its whole storage (so resizing the storage resizes only ``t``)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes(t)


def holders(t: torch.Tensor) -> tuple[int, int, int]:
    """Who holds ``t``'s memory: the tensors on its storage (views, detached copies, what autograd keeps
    of an op's output), the owners of ``t`` itself (an op's saved input, a gradient accumulator) and the
    Python references to it. Compared before and after some code ran, equal figures say that code
    kept nothing of ``t`` (the private ``_storage_Use_Count`` and ``Tensor._use_count``)."""
    on_storage = torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the storage object made here
    return on_storage, t._use_count(), sys.getrefcount(t)  # type: ignore[attr-defined]


def version_of(t: torch.Tensor) -> int:
    """How many in-place writes ``t``'s memory has seen (autograd's version counter, the private
    ``_version``): a layer that wrote into one of its buffers changed it."""
    return t._version


_ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


def computed_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t`` was computed in before the casts that made it (a float16 loss cast to float32 by a precision
    policy's output): the dtype of the gradient the node under its chain of ``ToCopyBackward0`` receives (the
    autograd node's private ``_input_metadata``); ``t.dtype`` where it was not cast (or has no graph)."""
    node = t.grad_fn
    dtype = t.dtype
    while node is not None and type(node).__name__ == "ToCopyBackward0" and node.next_functions:
        below = node.next_functions[0][0]
        metadata = getattr(below, "_input_metadata", None)
        if below is None or not metadata:
            break
        dtype = metadata[0].dtype
        node = below
    return dtype


def accumulate_backward(
    outputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """``torch.autograd.backward(outputs, seeds, inputs=inputs)``: the gradients into ``inputs``' ``.grad``.

    Where every seed has its output's shape and dtype and no tensor overrides torch functions, the
    engine is called as ``backward`` calls it (torch's private ``_engine_run_backward``) without its
    per-call argument handling: ``_make_grads``' symbolic shape checks cost more than a small
    layer's backward, and the executor runs one backward per layer. The same engine runs on the
    same arguments, so the gradients are the same bits. Anything else goes through ``backward``.
    """
    if (
        _ENGINE_RUN_BACKWARD is None
        or not outputs
        or not inputs
        or any(o.shape != g.shape or o.dtype != g.dtype for o, g in zip(outputs, seeds, strict=True))
        or has_torch_function((*outputs, *inputs))
    ):
        torch.autograd.backward(list(outputs), list(seeds), inputs=list(inputs))
        return
    _ENGINE_RUN_BACKWARD(
        tuple(outputs), tuple(seeds), False, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True
    )


def storage_key(t: torch.Tensor) -> int:
    """Identifies the memory a tensor lives in: views and detached copies share it. The storage
    implementation's address (``_cdata``, private) is used because meta tensors all have data
    pointer 0 while each still has a storage of its own. Asked with torch's function modes and
    subclasses off (``torch._C.DisableTorchFunction``, private): a question about memory, not an op
    on the values, which a mode would otherwise see as one (tensor parallel's reduced-form follower
    sums a partial value before an op it does not know)."""
    with torch._C.DisableTorchFunction():
        return t.untyped_storage()._cdata


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (made inside :func:`fake_tensors`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def data_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise where a computation reads data to decide a shape (``nonzero``, a
    mixture-of-experts' routing, ``.item()``): whoever runs a model on fake tensors catches these
    and falls back to real (stand-in) tensors. Private torch classes, named in this one place."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DataDependentOutputException, DynamicOutputShapeException)


def fake_run_errors() -> tuple[type[Exception], ...]:
    """What running a layer on fake tensors raises where the real kernels may still run it: the
    :func:`data_dependent_errors`, and a ``RuntimeError`` (``NotImplementedError`` among them) from an
    op's fake kernel, which can be stricter than the real one (torch 2.13's ``_grouped_mm``, which
    transformers' Mixtral and Qwen2-MoE call by default, takes only bfloat16 on fake tensors and float32
    too on CPU) or missing. A genuine error of the layer (shapes that do not fit) raises one of these
    too: whoever catches them runs the layer again on real stand-ins (:func:`real_stand_ins`,
    :func:`run_on_stand_ins`) and lets what that raises through, so such an error still reaches the
    user, raised by the real kernel."""
    return (*data_dependent_errors(), RuntimeError)


@contextlib.contextmanager
def fake_tensors(meta_device: torch.device | str = "cpu") -> Iterator[Callable[[Any], Any]]:
    """Inside the block, ``fake(t)`` turns a real tensor into a fake one on the same device, and
    a meta tensor (a parameter of a meta-built model) into a fake one on ``meta_device``.

    Unlike ``device="meta"``, a fake CPU tensor dispatches to the CPU kernels' choices
    (scaled_dot_product_attention picks the same backend), so what a layer saves is the same.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as undo:
        quiet, torch_log = _QuietMetaFailures(), logging.getLogger("torch._subclasses.fake_tensor")
        torch_log.addFilter(quiet)
        undo.callback(torch_log.removeFilter, quiet)
        mode = undo.enter_context(FakeTensorMode(allow_non_fake_inputs=True))

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.is_meta:  # made inside the mode: a fake tensor, no memory
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=meta_device)
            return mode.from_tensor(t)

        yield fake


@contextlib.contextmanager
def real_ops() -> Iterator[None]:
    """Inside a :func:`fake_tensors` block, ops on real tensors alone run for real (and read their data),
    while an op with a fake tensor among its arguments still runs on fake tensors, in that tensor's mode
    (torch's ``unset_fake_temporarily``, private)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


class _QuietMetaFailures(logging.Filter):
    """Drops torch's error log of a fake kernel that raised ("failed while attempting to run meta"):
    its error reaches the caller, who runs the layer on real stand-ins (:func:`fake_run_errors`), and
    a genuine error is raised there; the log would be pages of a traceback for nothing. A filter of
    its own per block, so blocks in threads at once add and remove only theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """Zeros of ``t``'s shape, dtype and device: real or fake as the mode in force makes them."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    return _zeros_like(t).requires_grad_(t.requires_grad and t.is_floating_point())


@contextlib.contextmanager
def real_stand_ins() -> Iterator[Callable[[Any], Any]]:
    """Inside a :func:`fake_tensors` block: leave its fake mode for this block, where ``real(tree)`` gives
    every fake tensor of ``tree`` a zero-filled real stand-in, a leaf of its shape, dtype and device
    (requiring a gradient when it does); other leaves stay as they are.

    For a layer that reads data to decide a shape (:func:`data_dependent_errors`), which fake tensors
    cannot run: shapes are right; what depends on the data (which experts zeros route to) is the
    stand-ins'."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(tree: Any) -> Any:
        return optree.tree_map(lambda t: _stand_in(t) if is_fake(t) else t, tree)

    with unset_fake_temporarily():
        yield real


class _OnStandIns(QuickApplyFunction):
    """``run`` on real stand-ins of the fake ``tensors``, outside the fake mode, in forward and backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[list[torch.Tensor]], Any], box: list[Any], *tensors: torch.Tensor) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            ctx.real_in = [_stand_in(t) if is_fake(t) else t for t in tensors]
            with torch.enable_grad():
                out = run(ctx.real_in)
        leaves, spec = optree.tree_flatten(out)
        ctx.real_out = [t for t in leaves if isinstance(t, torch.Tensor)]
        box.extend([leaves, spec])
        faked = tuple(_zeros_like(t) for t in ctx.real_out)  # fake: the mode is in force again
        ctx.mark_non_differentiable(*(f for f, t in zip(faked, ctx.real_out, strict=True) if not t.requires_grad))
        return faked

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        pairs = [(o, g) for o, g in zip(ctx.real_out, grads, strict=True) if o.requires_grad and g is not None]
        wanted = [i for i, t in enumerate(ctx.real_in) if t.requires_grad]
        got: tuple[torch.Tensor | None, ...] = ()
        if pairs and wanted:
            with unset_fake_temporarily():
                got = torch.autograd.grad([o for o, _ in pairs], [ctx.real_in[i] for i in wanted],
                                          [_zeros_like(g) for _, g in pairs], retain_graph=True, allow_unused=True)
        out: list[torch.Tensor | None] = [None] * len(ctx.real_in)
        for i, g in zip(wanted, got, strict=False):
            out[i] = None if g is None else _zeros_like(g)  # fake again
        return (None, None, *out)


def run_on_stand_ins(fn: Callable[..., Any], *args: Any) -> Any:
    """Inside a :func:`fake_tensors` block: ``fn(*args)`` run on zero-filled real stand-ins of ``args``'
    fake tensors, outside the fake mode, its backward too (when a backward reaches it); the output's
    tensors come back fake, their gradients reaching ``args``' tensors. For a layer that reads data to
    decide a shape, in a prediction that also runs the backward (what a split's layers issue inside
    their compute): shapes are right, what depends on the data is the stand-ins' (see
    :func:`real_stand_ins`)."""
    leaves: list[Any]
    leaves, spec = optree.tree_flatten(list(args))  # type: ignore[arg-type]
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]

    def run(tensors: list[torch.Tensor]) -> Any:
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        return fn(*optree.tree_unflatten(spec, filled))

    box: list[Any] = []
    faked = iter(_OnStandIns.apply(run, box, *(leaves[i] for i in where)))
    out_leaves, out_spec = box
    return optree.tree_unflatten(out_spec, [next(faked) if isinstance(t, torch.Tensor) else t for t in out_leaves])


def _one_value_expanded(t: Any) -> bool:
    """Whether ``t`` is a tensor of more than one element that holds one value, expanded: every dim
    of more than one element has stride 0 (a meta-built module's stand-in parameter, a view of one)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 1
            and all(stride == 0 for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1))


@contextlib.contextmanager
def dense_where_refused() -> Iterator[None]:
    """Inside the block, an op whose kernel raises a ``RuntimeError`` on an input that is one value
    expanded runs again on a dense copy of each such input, made for that op and dropped after it.
    On fake tensors (inside :func:`fake_tensors`, whose mode this one runs above) the copy is fake
    too: no memory. If the dense run fails as well, its error is raised.

    For a meta-built module, split on stand-in parameters that are one zero each, expanded (no
    memory): some kernels refuse a stride of 0, ``torch._grouped_mm`` (Hugging Face Mixtral's and
    Qwen2-MoE's experts, by default) in its real and its fake kernel alike. Dense stand-ins for the
    whole module would cost its size (the model that does not fit); made for a refusing op they
    cost that op's inputs (one layer's weights at most), and every kernel that takes a stride of 0
    (most: a matmul, an embedding, a skeleton's copy to the meta device) runs as before, with no
    copy at all. Under autograd nothing more is kept: autograd, above this mode, saves the expanded
    input. A copy holds the same values, so an input that is not a stand-in computes what it would;
    an op that writes or returns a view of an input is not run again (a write into a copy would be
    lost). Private torch API: ``TorchDispatchMode``."""
    with _DenseWhereRefused():
        yield


class _DenseWhereRefused(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            inputs: list[Any] = optree.tree_leaves([args, kwargs])  # type: ignore[arg-type]
            if not (_computes(func) and any(_one_value_expanded(t) for t in inputs)):
                raise
        return func(*optree.tree_map(_dense, args), **optree.tree_map(_dense, kwargs))


class LiveBytes(TorchDispatchMode):
    """Inside ``with``: ``live``, the bytes of the storages that the ops run inside made (and those
    :meth:`hold` was given) and that are alive still; ``peak``, the most of them alive at once. Each storage
    counts once at its full size, from the op that made it to the moment torch frees it (a weak reference
    to it: torch keeps one Python object per live storage). On fake tensors (inside :func:`fake_tensors`,
    whose mode this one runs above) it follows what the real ops would allocate, with no memory: what
    autograd's backward makes and frees included, as it runs in the calling thread on the CPU and on the
    meta device. Private torch API: ``TorchDispatchMode``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, Any] = {}
        self._fresh_zeros: tuple[int, int] | None = None  # (storage id, bytes) of the last op's zeros, if it made some

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, if negative) as alive from now on: storages made before the block."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage from now on, until it is freed (once, however many views of it come)."""
        storage = t.untyped_storage()
        key = id(storage)
        ref = self._held.get(key)
        if ref is not None and ref() is storage:
            return
        size = storage.nbytes()

        def freed(_: Any, key: int = key, size: int = size) -> None:
            self.live -= size
            self._held.pop(key, None)

        self._held[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh, self._fresh_zeros = self._fresh_zeros, None
        if _returns_new(func):  # (a view's or an in-place op's result is a storage made before, or not ours)
            # torch's backward formulas write into zeros they just made in place on real tensors (gather's:
            # new_zeros, then scatter_add_), and out of place on a tensor subclass or under a dispatch mode, this one
            # included (areAnyTensorSubclassLike): the result replaces the zeros, freed as the formula returns, where
            # a run without a mode makes one tensor. Counted as that one (a vocabulary-parallel loss: 8 MiB over).
            replaced = (fresh[1] if fresh is not None and func in _FUNCTIONAL_INTO_ZEROS and args
                        and isinstance(args[0], torch.Tensor) and id(args[0].untyped_storage()) == fresh[0] else 0)
            self.live -= replaced
            for t in optree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.hold(t)
            self.live += replaced
            if func in _ZEROS and isinstance(out, torch.Tensor):
                self._fresh_zeros = (id(out.untyped_storage()), out.untyped_storage().nbytes())
        unreduced = _UNREDUCED.get(func)
        if unreduced is not None and (func not in _REDUCING or _reduction(func, args, kwargs or {}) != 0):
            # Its kernel makes temporaries of its input's size beside its result (an elementwise loss before it
            # reduces it), freed inside.
            largest = max(t.untyped_storage().nbytes() for t in args if isinstance(t, torch.Tensor))
            self.peak = max(self.peak, self.live + unreduced * largest)
        return out


aten = torch.ops.aten
# The ops that make zeros a backward formula then writes into, and the out-of-place forms of those writes that it
# takes on a tensor subclass (torch/csrc/autograd/FunctionsManual.cpp: gather_backward, index_select_backward,
# slice_backward and the others that ask areAnyTensorSubclassLike).
_ZEROS = frozenset({aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default})
_FUNCTIONAL_INTO_ZEROS = frozenset({
    aten.scatter_add.default, aten.scatter.src, aten.scatter.value, aten.index_add.default, aten.index_put.default,
    aten.masked_scatter.default, aten.slice_scatter.default, aten.select_scatter.default,
    aten.diagonal_scatter.default, aten.as_strided_scatter.default, aten.index_copy.default,
})

# Loss kernels that allocate temporaries of their input's size inside (their unreduced elementwise loss, under
# ``reduction`` mean or sum), how many, which a fake kernel does not show: measured on torch 2.13's CPU kernels, the
# process's peak over one call on a 32 MiB input against what this tracker saw (plan/p23_kernels.py of the
# session's notes); cross-entropy, l1, KL and the others torch composes of smaller ops are seen op by op.
_UNREDUCED = {
    torch.ops.aten.mse_loss.default: 2,
    torch.ops.aten.smooth_l1_loss.default: 2,
    torch.ops.aten.huber_loss.default: 1,
    torch.ops.aten.binary_cross_entropy.default: 1,
    torch.ops.aten.soft_margin_loss.default: 1,
    torch.ops.aten.soft_margin_loss_backward.default: 2,
}
# Of those, the ones that make them only when they reduce (``reduction`` mean or sum).
_REDUCING = frozenset(op for op in _UNREDUCED if op != torch.ops.aten.soft_margin_loss_backward.default)


def _reduction(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The ``reduction`` argument of a loss op (0 none, 1 mean, 2 sum), given or by default."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "reduction":
            if i < len(args):
                return int(args[i])
            return int(kwargs.get("reduction", argument.default_value))
    return 0


def _returns_new(func: Any) -> bool:
    """Whether an op's results are new storages: none of them aliases an input (not a view, not an in-place
    op's or an ``out=``'s). A higher-order op has no schema: its results are taken as new (once each)."""
    schema = getattr(func, "_schema", None)
    return schema is None or all(r.alias_info is None for r in schema.returns)


def live_bytes() -> LiveBytes:
    """A :class:`LiveBytes` to enter: ``with live_bytes() as seen: ...`` then ``seen.peak``."""
    return LiveBytes()


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_tensors(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op (an OpOverload, as a dispatch mode sees it) writes into: the arguments its schema
    marks written (``Tensor(a!)``: ``add_``'s self, an ``out=``). Read through ``op._schema``, torch's private
    description of the op (tests/engine/test_torch_api.py fails loudly where it changes)."""
    written = _WRITTEN.get(op)
    if written is None:
        schema = getattr(op, "_schema", None)  # (a higher-order op, flex_attention's, has none: it writes nothing)
        written = _WRITTEN[op] = () if schema is None else tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    found: list[torch.Tensor] = []
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        found.extend(t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor))
    return found


def _computes(func: Any) -> bool:
    """Whether an op makes new tensors from its inputs: not a view, not a write, not a query of
    metadata (``prim::device``); only such an op may run again on copies of its inputs."""
    schema = func._schema
    return (not schema.is_mutable and any("Tensor" in str(r.type) for r in schema.returns)
            and all(r.alias_info is None for r in schema.returns))


def _dense(t: Any) -> Any:
    if not _one_value_expanded(t):
        return t
    # Detached: this runs below autograd, and a clone through it can wait on the lock of the tensor's
    # autograd state that autograd holds around the op (seen on a fake parameter: a deadlock).
    return torch.ops.aten.clone.default(t.detach(), memory_format=torch.contiguous_format)


# The schemas the two flash-attention wrappers below are written against (torch 2.13); a test holds
# torch to them, so a torch that changes either fails there, by name, rather than in a ring attention.
FLASH_ATTENTION_CPU_SCHEMAS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
    "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
    "-> (Tensor output, Tensor logsumexp)",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, "
    "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
    "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
)


def _flash_ops() -> tuple[Any, Any] | None:
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return None
    found = (str(forward.default._schema), str(backward.default._schema))
    return (forward.default, backward.default) if found == FLASH_ATTENTION_CPU_SCHEMAS else None


_FLASH = _flash_ops()


def has_flash_attention_cpu(*tensors: torch.Tensor) -> bool:
    """Whether :func:`flash_attention_cpu` can run on ``tensors``: this torch has the kernel with the
    schema above, and they are CPU tensors of a dtype it takes (float64, float32, bfloat16, float16)."""
    return _FLASH is not None and all(
        t.device.type == "cpu" and t.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
        for t in tensors
    )


def flash_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` [batch, heads, q_len, dim] over ``k``, ``v`` [batch, kv_heads, k_len,
    dim] (kv_heads dividing heads: grouped-query), tiled, never holding the score matrix; returns the
    output and each row's log-sum-exp of its scaled scores [batch, heads, q_len] (float32 for half
    inputs). ``causal``: query ``i`` sees keys ``0 .. i`` (top-left aligned when q_len != k_len). ``mask``:
    added to the scores, in q's dtype ([batch or 1, heads or 1, q_len, k_len]: 0 seen, -inf hidden); a
    row it hides wholly gets a zero output and lse = 0."""
    assert _FLASH is not None, "check has_flash_attention_cpu first"
    out, lse = _FLASH[0](q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse


def flash_attention_cpu_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v for :func:`flash_attention_cpu`: the probabilities recomputed tile by
    tile from ``lse`` as ``exp(scale * q k^T - lse)``, and each row's ``sum(grad_out * out)`` from the
    ``out`` given (given the merged output of several blocks, each block's gradients are its share of the
    merged attention's: see ring attention's block kernel). ``mask`` as in the forward."""
    assert _FLASH is not None, "check has_flash_attention_cpu first"
    dq, dk, dv = _FLASH[1](grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return dq, dk, dv


# --- torch.compile'd modules: what functionalize runs uncompiled ---------------------------------


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``), or None if
    ``module`` is not such a wrapper. torch._dynamo is only looked up, never imported: a wrapper
    cannot exist before it is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    original = module._orig_mod
    assert isinstance(original, torch.nn.Module)
    return original


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called: ``module(x)`` then runs the compiled
    ``_compiled_call_impl`` (a compile of the module's own bound ``_call_impl``)."""
    return module._compiled_call_impl is not None


def drop_compiled_call(module: torch.nn.Module) -> None:
    """Make ``module(x)`` run eagerly again (undo ``module.compile()`` on this object)."""
    module._compiled_call_impl = None
