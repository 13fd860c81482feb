"""How a Region's module cuts its Colwise outputs along their features, checked against the style.

``Colwise()`` gives each rank a contiguous 1/tp of a projection's output features. A projection
that computes several blocks side by side (q, k and v in one Linear, nanoGPT's and GPT-2's
``c_attn``; gate and up in one) is cut by its module into those blocks (``.split(n_embd, -1)``,
``.chunk(3, -1)``); on a rank's contiguous slice the parts are pieces of other blocks (all of q and
part of k at tp 2), and the model computes another attention without an error. ``Colwise(fused=N)``
cuts each of N equal blocks instead, which is right only where the module does cut N equal blocks:
not for grouped-query attention's [q | k | v] of unequal widths, nor for a projection laid out per
head (GPT-NeoX's ``query_key_value``: q, k and v of head 0, then of head 1, ...; a plain Colwise
gives a rank whole heads there).

:class:`SplitWatch` runs around a Region's first forward and follows each Colwise output (through
the ops that keep its features whole: casts, adds, leading-dim reshapes) to where the module cuts
its features:

* a plain ``Colwise()`` output cut into a number of parts the module fixes is refused: ``chunk(3)``,
  ``tensor_split(2)``, ``dsplit(2)`` (``hsplit``, ``vsplit``: tensor_split along a fixed dim),
  sections of unequal widths (``split([dim, kv, kv])``, a ``split(size)`` that leaves a remainder),
  or a cut at a width the Region divides (``local=``: ``split(split_size)``, which makes the same 3
  parts of the rank's slice as of the whole). A cut by a size the module does not divide (per-head
  ``split(head_dim)``: a rank's whole heads) passes;
* a ``Colwise(fused=N)`` output must be cut into its N blocks: ``chunk(N)``, ``split(width / N)``,
  slices at block edges (Phi-3's ``qkv[..., :query_pos]``), a view with the blocks outermost
  (``view(b, t, N, heads, -1)``), or pieces of them. Any other cut is refused, naming the sizes
  seen, and so is an output the Region's forward never cut so;
* a plain ``Colwise()`` output viewed per head is followed along its heads (head_views.py): a cut
  across them, and (outside any Region) a view by a whole head count, are refused;
* an op across a Colwise output's features before any per-head view (a reduction, a normalisation
  with no weight, a cumulative sum or a sort along them, an index, slice, pad or convolution of them,
  a contraction of two outputs' features: feature_mixing.py) computes on the rank's slice alone:
  refused at the end of the forward, so that a failure of torch's on the way (a norm's weight of the
  whole width) is explained as before. The output is followed through the ops along other dims that
  keep its features (``q.mean(1)``, ``q.softmax(1)``, ``q.max(1).values``) to such an op.

A Colwise outside any Region is watched through its layer's first call on each rank (layer_rewrite.VaryFn); inside a
sequence-parallel block a reshape of its output by the slice's length is refused there (sequence_gather.py).

A view that factors a plain Colwise's features with the blocks outermost (``view(b, t, 3, heads,
-1)``) looks like one into heads and goes unseen, as do a split size computed from a divided head
count (``split(self.n_heads * self.head_dim)``), a cut of transposed features (``chunk(2, dim=1)``
of ``q.transpose(1, 2)``), and a projection whose local head count happens to equal N (viewed per
head as N blocks). A plain Colwise sliced by ``[...]`` along its features is refused as an op by
position (feature_mixing.py), but for a strided slice (``[..., ::2]``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...engine.stack.host_calls import calls_watched
from . import head_host_calls  # noqa: F401  (registers the head counts with the engine's stand-ins)
from .feature_mixing import keeps_features, mixed, moved_features
from .head_loop_values import HeadLoopValues
from .head_numbers import HeadNumbers, Numbered, count_misuse, counts_in, is_count_read, mark_count, one_per_head
from .head_sized import HeadSized
from .head_sources import HeadSources
from .head_views import check_head_count, see_heads
from .model_frames import by_shardwise, innermost_model_line
from .product_views import HeadView
from .rank_flow import flow
from .read_refusals import head_count_message, head_number_message, head_value_message
from .sequence_gather import SequenceGather

_Found = TypeVar("_Found")

# Cuts along a dim (the features, when it is the last): the parts' widths are read off the output.
_CUTS = {
    torch.chunk: "chunk", Tensor.chunk: "chunk", torch.tensor_split: "tensor_split",
    Tensor.tensor_split: "tensor_split", torch.split: "split", Tensor.split: "split",
    torch.split_with_sizes: "split_with_sizes", Tensor.split_with_sizes: "split_with_sizes",
    torch.dsplit: "dsplit", Tensor.dsplit: "dsplit", torch.hsplit: "hsplit", Tensor.hsplit: "hsplit",
    torch.vsplit: "vsplit", Tensor.vsplit: "vsplit", torch.unsafe_chunk: "chunk", Tensor.unsafe_chunk: "chunk",
    torch.unsafe_split: "split", Tensor.unsafe_split: "split",
}
# The cuts along a fixed dim (dsplit: the third): tensor_split's along it.
_FIXED_CUT_DIM = {"dsplit": lambda n: 2, "hsplit": lambda n: 1 if n > 1 else 0, "vsplit": lambda n: 0}
# Ops that give the same values another shape: the features factored (or kept) in the output's last dims.
_RESHAPES = {torch.reshape, Tensor.reshape, Tensor.view, Tensor.unflatten, torch.unflatten}
# What carries a Colwise output on with its features whole and last: any op keeping its shape but these,
# which mix the features (a Rowwise's linear of as many features is a use, not the output again) ...
_MIXING = {
    "linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "layer_norm", "rms_norm",
    "group_norm", "softmax", "log_softmax", "cumsum", "cumprod", "flip", "roll", "sort", "conv1d",
}
# ... and these, which move only the leading dims.
_LAYOUT = {
    "view", "reshape", "flatten", "unflatten", "transpose", "permute", "movedim", "unsqueeze", "squeeze",
    "contiguous", "__getitem__", "expand", "select", "narrow",
}

# In-place ops by their Python operator (q[:, h] *= 2: __imul__ on the head's view, then __setitem__), and names that
# end in an underscore without writing values.
_AUGMENTED = {
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                            "rshift", "matmul")
}
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad_", "record_stream_"}
# Ops that gather a list of tensors in its order (the heads read one at a time, stacked back).
_GATHERS = {"stack", "cat", "concat", "concatenate", "hstack", "vstack", "dstack", "column_stack"}


@dataclass
class _Output:
    """One Colwise output and what the module did with it (shared by the tensors that carry it on)."""

    label: str
    fused: int
    width: int  # its features on this rank
    cut: bool = False  # fused: cut into its blocks
    uses: list[str] = field(default_factory=list)  # fused: the ops that took it otherwise
    # A Colwise outside any Region: the head counts its enclosing modules hold (whole: nothing divides
    # them), and the axis size; a per-head view by one of them makes heads of a slice of the head width.
    counts: dict[str, tuple[str, int]] = field(default_factory=dict)  # attribute -> (module, count)
    parts: int = 1
    # A Colwise outside any Region inside a sequence-parallel block: the sequence it gathered itself.
    sequence: SequenceGather | None = None
    merged: bool = False  # its per-head view was merged back into the rank's width (head_views.py)
    parameter: bool = False  # not a Colwise output: a PerHead parameter, this rank's heads' values on dim 0
    short: tuple[str, list[int]] | None = None  # fused: a cut into fewer parts than its blocks (the op, sizes)


@dataclass
class _Taken:
    """The heads a per-head tensor gave one at a time (SplitWatch.take_head)."""

    tensor: Tensor
    entry: _Output
    dim: int
    first: str  # the first op that took one, and its line
    write: bool = False  # heads written one at a time (q[:, h] = ...), counted apart from those read
    counts: dict[int, int] = field(default_factory=dict)  # head on this rank -> times taken


class SplitWatch(TorchFunctionMode):
    """Refuses a cut of a watched Colwise output that does not fit its style (see the module docstring). While it
    is entered, the engine's stand-ins for math's and numpy's functions stand (head_host_calls.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._host_calls: list[contextlib.ExitStack] = []  # one per entry (a stack: entries may nest)
        self.widths: set[int] = set()  # the widths the Regions divide (local=), as a rank sees them
        # A Region entered names a head count equal to the axis size: a rank holds one head of it, so a view that
        # puts a dim of size 1 before a Colwise output's features can be its per-head view (_one_head_view).
        self.one_head = False
        self.watched: dict[int, tuple[weakref.ref[Tensor], _Output]] = {}
        # The per-head views of plain Colwise outputs: the dim that holds the rank's heads.
        self.per_head: dict[int, tuple[weakref.ref[Tensor], _Output, int]] = {}
        # Transposes of followed outputs, their features moved off the last dim (k.transpose(-1, -2)).
        self.moved: dict[int, tuple[weakref.ref[Tensor], _Output, int]] = {}
        self.outputs: list[_Output] = []
        # The first op across an output's features (or, True last, across a per-head view's heads).
        self.mixed: tuple[_Output, str] | tuple[_Output, str, bool] | None = None
        # The Colwise outputs an op that failed took (their labels): what a failure's explanation names.
        self.failed_on: tuple[str, ...] = ()
        # A reshape of one (or of its per-head view) that failed in torch: the output, the op, its input's shape
        # and the sizes asked (failed_view_message says it).
        self.failed_reshape: tuple[_Output, str, list[int], list[Any]] | None = None
        # The heads taken one at a time from each per-head tensor (q[:, h]), by tensor and by read or write: a loop
        # over all of a rank's heads takes each of them equally often; anything else picked a head by its number.
        self.taken: dict[tuple[int, bool], _Taken] = {}
        # One head's views (q[:, h], q.select(1, h)): an in-place op on one writes into that head of its tensor.
        self.head_views: dict[int, tuple[weakref.ref[Tensor], _Taken]] = {}
        self.sources = HeadSources()  # the heads a value read one at a time came from: where it may be written
        self.loop_values = HeadLoopValues()  # what each head got, read one at a time: the same for each
        self.numbers = HeadNumbers()  # tensors of the rank's head numbers (an arange over its count)
        self.sized = HeadSized()  # new tensors sized by the rank's head count: what counts their places is numbers
        self.numbered_misuse: str | None = None  # the first refusal of a loop's head number as a value (finish())

    def _outputs_in(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, ...]:
        """The labels of the Colwise outputs among an op's arguments, followed in any form."""
        entries = [entry for _, entry in _tensor_args(args, kwargs, self._entry)]
        for entry_of in (self._heads_of, self._moved_of):
            entries += [entry for _, (entry, _dim) in _tensor_args(args, kwargs, entry_of)]
        return tuple(dict.fromkeys(e.label for e in entries if not e.parameter))

    def watch(
        self, t: Tensor, label: str, fused: int, counts: dict[str, tuple[str, int]] | None = None, parts: int = 1,
        sequence: SequenceGather | None = None, view: HeadView | None = None,
    ) -> None:
        """Follow Colwise output ``t``; ``view``: its forward (a Linear subclass's) viewed it per head already
        (product_views.py: for a fused one, its blocks outermost, so cut into them)."""
        width = view.width if view is not None else t.shape[-1] if t.dim() else 0
        entry = _Output(label, fused, width, counts=dict(counts or {}), parts=parts, sequence=sequence)
        self.outputs.append(entry)
        if view is not None:
            check_head_count(entry, view.counted)
            entry.cut = True  # (fused: viewed with its blocks outermost, each block's heads whole)
            self.follow_heads(t, entry, view.heads_dim)
            return
        self._follow(t, entry)

    def watch_per_head(self, t: Tensor, label: str, parts: int) -> None:
        """A PerHead parameter's slice ``t``: this rank's heads' values along dim 0, followed as a per-head
        view is (an op across its heads computes over the rank's heads alone; a cut takes some of them)."""
        if isinstance(t, Tensor) and t.dim():
            self.follow_heads(t, _Output(label, 1, t.shape[0], parts=parts, parameter=True), 0)

    def _follow(self, t: Tensor, entry: _Output) -> None:
        self.watched[id(t)] = (weakref.ref(t), entry)

    def _entry(self, t: Any) -> _Output | None:
        found = self.watched.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            self.failed_on = self._outputs_in(args, kwargs)
            first = args[0] if args else None
            found = self._entry(first) or (self._heads_of(first) or (None,))[0]
            if func in _RESHAPES and found is not None and isinstance(first, Tensor):
                sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
                self.failed_reshape = (found, _name(func), list(first.shape), list(sizes))
            raise
        if self.mixed is None and (self.watched or self.moved):
            self.mixed = mixed(_name(func), args, kwargs, self.features_of)
        if self.mixed is None and self.per_head:  # the same ops across a per-head view's heads dim
            across = mixed(_name(func), args, kwargs, self._heads_of, heads=True)
            if across is not None:
                self.mixed = (across[0], across[1].replace("features", "heads"), True)
        for t, (entry, dim) in _tensor_args(args, kwargs, self._moved_of):
            if isinstance(out, Tensor) and out.shape == t.shape and _name(func) not in _MIXING:
                self.moved[id(out)] = (weakref.ref(out), entry, dim)  # k.transpose(-1, -2) * scale
            elif isinstance(out, Tensor) and args[0] is t:
                moved = _moved_on(func, t, dim, args, out)  # moved again: transposed back, unsqueezed
                if moved is not None:
                    self.moved[id(out)] = (weakref.ref(out), entry, moved)
        for t, entry in _tensor_args(args, kwargs, self._entry):
            self._see(func, t, entry, args, kwargs, out)
        self.sources.carry(args, kwargs, out)
        if self.head_views:
            self._see_head_views(_name(func), args, kwargs, out)
        for t, (entry, dim) in _tensor_args(args, kwargs, self._heads_of):
            if entry.sequence is not None and func in _RESHAPES and isinstance(out, Tensor):
                refusal = entry.sequence.reshaped(t, out)  # a per-head view merged back by the slice's length
                if refusal is not None:
                    raise ValueError(refusal)
            see_heads(self, func, t, entry, dim, args, kwargs, out)
        if self.sources.marked():
            self.loop_values.see(_name(func), args, kwargs, self.sources)
            self._check_gathered_order(_name(func), args, kwargs)
        misused = self._head_numbers_misused(func, args, kwargs, out)
        if misused is not None and not by_shardwise(_name(func)):  # (asked here: the op's caller is above this frame)
            why, scalar = misused
            message = head_count_message if scalar else head_value_message
            refusal = message(f"the model's code at {innermost_model_line()} {why}")
            if not any(isinstance(n, Numbered) for n in counts_in(args, kwargs)):
                raise ValueError(refusal)
            # a loop's head number as a value: refused at finish(), after what the loop computed for each head
            # (head_loop_values.py names the values that differ, where the loop reads the heads)
            self.numbered_misuse = self.numbered_misuse or refusal
        self.sized.see(_name(func), args, kwargs, out, self.numbers, self._per_head)
        if _name(func) == "unbind" and isinstance(out, tuple) and args and not by_shardwise("unbind"):
            heads = self._heads_of(args[0])
            along = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if heads is not None and isinstance(along, int) and along % args[0].dim() == heads[1]:
                out = one_per_head(out, f"the heads of the per-head view of {heads[0].label!r} unbound ({len(out)})")
        if is_count_read(func, _name(func)) and args:
            heads = self._heads_of(args[0])
            if heads is not None and heads[0].fused == 1 and heads[0].parts > 1 and not by_shardwise(_name(func)):
                label = heads[0].label
                return mark_count(out, heads[1], args[0], args, lambda how: f"{how} of the per-head view of {label!r}")
        return out

    def _head_numbers_misused(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any
    ) -> tuple[str, bool] | None:
        """How a number read as the rank's head count, or a tensor of its head numbers, is used as a value, and
        whether as a scalar (head_numbers.py); None where it is not."""
        name = _name(func)
        misused = count_misuse(name, args, kwargs, self._holds_heads)
        if misused is not None:
            return misused
        numbers = self.numbers.see(name, args, kwargs, out, self._holds_heads)
        return None if numbers is None else (numbers, False)

    def _holds_heads(self, t: Any) -> bool:
        """Whether ``t`` holds the rank's heads along a dim: a per-head view, a new tensor sized by the count, or
        one computed from values read one head at a time (a stack of them): an index of it by head number names the
        rank's head in its place. Inside a Region any tensor is taken to (its probe runs the module whole and
        compares the values an index gives)."""
        in_region: int = getattr(flow, "in_region", 0)
        return bool(in_region) or self._per_head(t) or bool(self.sized.dims_of(t)) or bool(self.sources.of(t))

    def _per_head(self, t: Any) -> bool:
        return self._heads_of(t) is not None

    def _heads_of(self, t: Any) -> tuple[_Output, int] | None:
        found = self.per_head.get(id(t)) if isinstance(t, Tensor) else None
        return (found[1], found[2]) if found is not None and found[0]() is t else None

    def _moved_of(self, t: Any) -> tuple[_Output, int] | None:
        found = self.moved.get(id(t)) if isinstance(t, Tensor) else None
        return (found[1], found[2]) if found is not None and found[0]() is t else None

    def features_of(self, t: Any) -> tuple[_Output, int] | None:
        """The followed output ``t`` holds whole, and the dim holding its features; None if none."""
        entry = self._entry(t)
        return (entry, t.dim() - 1) if entry is not None else self._moved_of(t)

    def follow_merged(self, t: Tensor, entry: _Output) -> None:
        """``t`` holds this rank's heads of ``entry`` merged back into its width (head_views.py)."""
        entry.merged = True
        self._follow(t, entry)

    def follow_heads(self, t: Tensor, entry: _Output, dim: int) -> None:
        """``t`` holds this rank's heads of ``entry`` along ``dim``."""
        self.per_head[id(t)] = (weakref.ref(t), entry, dim)

    def take_head(
        self, t: Tensor, entry: _Output, dim: int, head: int, where: str, write: bool = False, view: Any = None
    ) -> None:
        """``t`` (a per-head view of ``entry``, heads on ``dim``) gave its head ``head`` alone (``where``: the op
        and the module's line), or took a write into it (``write``); finish() checks the heads taken. ``view``:
        the op's output, a view of that head alone, which an in-place op then writes into (q.select(1, h).copy_)."""
        taken = self.taken.get((id(t), write))
        if taken is None or taken.tensor is not t:  # (the tensor held: its id is not reused before finish())
            taken = self.taken[(id(t), write)] = _Taken(t, entry, dim, where, write)
        taken.counts[head] = taken.counts.get(head, 0) + 1
        if not write:
            self.sources.mark(view, t.shape[dim], head)
        if isinstance(view, Tensor) and view._is_view():
            self.head_views[id(view)] = (weakref.ref(view), _Taken(t, entry, dim, where, True, {head: 1}))

    def check_head_write(
        self, t: Tensor, entry: _Output, dim: int, head: int, where: str, values: Sequence[Any]
    ) -> None:
        """Refuse a write into head ``head`` of ``t`` of values read from its other heads (head_sources.py)."""
        others = self.sources.other_heads(values, t.shape[dim], head)
        if others:
            heads = ", ".join(map(str, others))
            raise ValueError(head_number_message(
                entry, f"it writes values read from head {heads} of {t.shape[dim]} into head {head} ({where}), "
                "another head's on a rank than on one device", t, dim,
            ))

    def _check_gathered_order(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Refuse a stack or cat of one value read from each head of a tensor, in another order than the heads'
        (``torch.stack([q[:, h] for h in reversed(range(q.size(1)))], 1)``): the rank's last head goes to its
        first place, where one device puts its last head of all (1.8% apart in the loss after one step of the
        tests' tiny attention, no error)."""
        items = args[0] if args else kwargs.get("tensors")
        if name not in _GATHERS or not isinstance(items, (list, tuple)) or len(items) < 2:
            return
        marks = [self.sources.of(t) for t in items]
        if any(len(m) != 1 for m in marks):
            return  # (a value made of several heads, or of none: judged elsewhere)
        read = [next(iter(m)) for m in marks]
        heads = read[0][0]
        order = [head for _, head in read]
        if len(items) != heads or any(n != heads for n, _ in read) or order == list(range(heads)) or (
                sorted(order) != list(range(heads))):
            return  # (each in its place; or not each head once, which finish() refuses as heads taken unequally)
        taken = next((t for t in self.taken.values() if not t.write and t.tensor.shape[t.dim] == heads), None)
        in_region: int = getattr(flow, "in_region", 0)
        if taken is None or in_region:
            return  # (inside a Region its probe runs the module whole and compares: a reorder put back passes there)
        label = taken.entry.label
        module = label.rsplit(".", 1)[0] if "." in label else label
        raise ValueError(head_number_message(
            f"tensor parallel gives each rank its own heads, {heads} of them here, 1/tp of all, and the module that "
            f"takes them ({module!r})", f"it gathers a value read from each of this rank's {heads} heads ({name} at "
            f"{innermost_model_line()}) in the order of heads {order}, not each in its own place: on one device "
            "that order puts other heads there", taken.tensor, taken.dim,
        ))

    def _head_view_of(self, t: Any) -> _Taken | None:
        found = self.head_views.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def _see_head_views(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """An in-place op on one head's view (``q[:, h].mul_(2)``, ``q.narrow(1, h, 1)[..., :2] = 0``, or its
        ``out=``) writes into that head of the tensor it viewed: counted as a write (take_head); a view of the
        view is the same head's."""
        first = args[0] if args else None
        taken = self._head_view_of(first)
        in_place = name == "__setitem__" or name in _AUGMENTED or (
            name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES
        )
        written = taken if in_place else None
        target = first if written is not None else kwargs.get("out")
        written = written or self._head_view_of(kwargs.get("out"))
        if written is not None:
            head = next(iter(written.counts))
            where = f"{name} of its head {head} at {innermost_model_line()}"
            self.check_head_write(written.tensor, written.entry, written.dim, head, where,
                                  [a for a in (*args, *kwargs.values()) if a is not target])
            self.take_head(written.tensor, written.entry, written.dim, head, where, write=True)
        if taken is not None and isinstance(out, Tensor) and out is not first and out._is_view() and (
            out._base is first._base  # type: ignore[union-attr]
        ):
            self.head_views[id(out)] = (weakref.ref(out), taken)

    def short_cut_message(self, err: BaseException) -> str | None:
        """Why the module failed (``err``, Python's own), where it cut a fused output into fewer parts than
        its blocks: at a width nothing divided, whole on every rank (GPT-2's split_size with no Region)."""
        entry = next((e for e in self.outputs if e.short is not None), None)
        if entry is None or entry.short is None:
            return None
        name, sizes = entry.short
        return (
            f"{_fused_head(entry)}, and the module cut this rank's {entry.width} features into {len(sizes)} "
            f"parts ({name}, {sizes}), then failed ({type(err).__name__}: {err}): it cuts at a width it holds "
            f"whole ({sizes[0]} features: a whole block is {entry.width * entry.parts // entry.fused}, of which "
            f"each rank holds {entry.width // entry.fused}), which nothing divided. A Region on the module that "
            "cuts it divides that width for its call: name "
            "it in local=(...) with the head counts in heads=(...) (GPT-2's attention: sw.tp.Region(heads="
            "('num_heads',), local=('split_size',)), as sw.tp.gpt2_plan() gives)"
        )

    def failed_view_message(self, err: BaseException) -> str | None:
        """Why the module failed (``err``, torch's), where a reshape of a Colwise output outside any Region (or of
        its per-head view) did: sized by a whole count or width, which nothing divides there. None otherwise."""
        if self.failed_reshape is None or self.failed_reshape[0].parts <= 1 or self.failed_reshape[0].parameter:
            return None
        entry, name, shape, sizes = self.failed_reshape
        module = next(iter(entry.counts.values()))[0] if entry.counts else (
            entry.label.rsplit(".", 1)[0] if "." in entry.label else "<the layer's module>"
        )  # (the innermost module holding a count: the one to give a Region)
        held = ", ".join(f"{where}.{attr} = {count}" for attr, (where, count) in entry.counts.items())
        counts = tuple(dict.fromkeys(entry.counts))
        region = f"sw.tp.Region(heads={counts!r})" if counts else "sw.tp.Region(heads=('<its head count>',))"
        return (
            f"tensor_parallel: Colwise() on {entry.label!r}, outside any Region, gives each rank 1/{entry.parts} of "
            f"its output features ({entry.width} of {entry.width * entry.parts} here), and the module taking them "
            f"({module!r}) reshapes them ({name} of {shape} to {sizes}) by sizes of the whole, which this rank's "
            f"slice does not fit ({type(err).__name__}: {err}): most likely a whole head count given explicitly, "
            f"beside the head width or times it{f' ({held})' if held else ''}, which nothing divides outside a "
            f"Region. Give {module!r} a Region naming its counts, {region} in the plan, which divides them by the tp "
            "size while the module runs; or size the view with the heads inferred (view(b, t, -1, head_dim), and "
            "reshape(b, t, -1) to merge them), as Hugging Face's attentions do"
        )

    def __enter__(self) -> SplitWatch:
        calls = contextlib.ExitStack()
        calls.enter_context(calls_watched())
        self._host_calls.append(calls)
        try:
            super().__enter__()
        except BaseException:
            self._host_calls.pop().close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._host_calls.pop().close()

    def finish(self) -> None:
        """The end of the first forward: no op across an output's features, and a fused output must have
        been cut into its blocks."""
        if self.mixed is not None:
            raise ValueError(_mixing_refusal(self.mixed[0], self.mixed[1], len(self.mixed) > 2))
        for entry in self.outputs:
            if entry.fused > 1 and not entry.cut:
                took = f"it went to {', '.join(dict.fromkeys(entry.uses))}" if entry.uses else "it was not cut"
                raise ValueError(
                    f"{_fused_head(entry)}, but the module never cut this rank's {entry.width} features into "
                    f"{entry.fused} parts along them ({took}). {_fused_fix(entry)}"
                )
        for taken in sorted(self.taken.values(), key=lambda taken: not taken.write):  # a write first: what it changed
            heads = taken.tensor.shape[taken.dim]
            if set(taken.counts) != set(range(heads)) or len(set(taken.counts.values())) != 1:
                did = "wrote into" if taken.write else "took"
                by_head = ", ".join(f"head {h} x{n}" for h, n in sorted(taken.counts.items()))
                raise ValueError(head_number_message(
                    taken.entry, f"it {did} heads one at a time, first {taken.first}, and of its {heads} heads on "
                    f"this rank {did} {by_head}, not each of them equally often as a loop over all of them does",
                    taken.tensor, taken.dim,
                ))
        split = any(entry.parts > 1 for entry in self.outputs)  # (at tp 1 a rank's head numbers are the whole's)
        differing = self.loop_values.differing() if split else None
        if differing is not None:
            heads, what = differing
            label = next((t.entry.label for t in self.taken.values() if t.tensor.shape[t.dim] == heads), None)
            whose = f"the module that takes the heads of {label!r}" if label is not None else "the module"
            raise ValueError(head_value_message(
                f"{whose} computes each of this rank's {heads} heads in a loop, but not alike: {what}; values "
                "computed from the loop's head number (h + 1.0, slopes[h], if h == 0), not from the head's values"
            ))
        if self.numbered_misuse is not None:
            raise ValueError(self.numbered_misuse)

    def _see(self, func: Any, t: Tensor, entry: _Output, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        if entry.sequence is not None and func in _RESHAPES and isinstance(out, Tensor):
            refusal = entry.sequence.reshaped(t, out)  # by the slice's length, read off the module's input
            if refusal is not None:
                raise ValueError(refusal)
        cut = _CUTS.get(func)
        if cut is not None:
            if args and args[0] is t and _along_features(t, args, kwargs, cut):
                self._cut(entry, "tensor_split" if cut in _FIXED_CUT_DIM else cut, [p.shape[-1] for p in out])
            elif isinstance(out, (tuple, list)):  # another dim: each part carries the features on
                for part in out:
                    if isinstance(part, Tensor) and part.dim() and part.shape[-1] == entry.width:
                        self._follow(part, entry)
            return
        if _name(func) == "glu" and args and args[0] is t and _glu_along_features(t, args, kwargs):
            self._cut(entry, "glu", [entry.width // 2] * 2)  # glu halves the features: a cut into two
            return
        if not isinstance(out, Tensor):
            if any(isinstance(o, Tensor) for o in (out if isinstance(out, (tuple, list)) else ())):
                entry.uses.append(_name(func))
                values = out[0] if isinstance(out, (tuple, list)) and isinstance(out[0], Tensor) else None
                if values is not None and values.dim() and values.shape[-1] == entry.width and (
                    values.is_floating_point() and self._along_another_dim(_name(func), args, kwargs)
                ):
                    self._follow(values, entry)  # q.max(1).values, q.sort(1).values: the features whole
            return  # a shape, a dtype: read, not used
        name = _name(func)
        if entry.fused == 1 and func in _RESHAPES:
            factors = _feature_factors(list(t.shape), list(out.shape))
            if factors is not None and _one_head_before(list(t.shape), list(out.shape), factors) and (
                self._may_hold_one_head(entry) or _inferred(func, args, kwargs, out.dim() - len(factors) - 1)
            ):
                factors = [1, *factors]  # a rank's one head of a per-head fused layout: (b, t, 1, 3, head_dim)
            if factors is not None and len(factors) >= 2:  # the features viewed per head: (..., heads, head_dim)
                check_head_count(entry, factors)
                self.follow_heads(out, entry, out.dim() - len(factors))
        if entry.fused == 1 and _one_head_view(t, out) and (
            self._may_hold_one_head(entry) or (func in _RESHAPES and _inferred(func, args, kwargs, out.dim() - 2))
        ):
            self.follow_heads(out, entry, out.dim() - 2)
            return  # a per-head view of a rank's one head: what it cuts next is the head's own dims
        if name == "unsqueeze" and out.dim() == t.dim() + 1 and kwargs.get("dim", args[1] if len(args) > 1 else 0) in (
            -1, t.dim()
        ):
            self.moved[id(out)] = (weakref.ref(out), entry, t.dim() - 1)  # q.unsqueeze(-1): features at -2
            return
        moved = moved_features(func, name, t, args, out)
        if moved is not None and moved != out.dim() - 1:
            self.moved[id(out)] = (weakref.ref(out), entry, moved)  # read by a contraction (feature_mixing.py)
            if entry.fused > 1:
                entry.uses.append(name)
            return
        if out.dim() and out.shape[-1] == entry.width and (
            (out.shape == t.shape and name not in _MIXING) or name in _LAYOUT
            or self._along_another_dim(name, args, kwargs)
        ):
            self._follow(out, entry)  # the features whole: a cast, an add, a leading-dim reshape, q.mean(1)
        elif func is Tensor.__getitem__ and entry.fused > 1:
            self._slice(entry, t, args[1] if len(args) > 1 else None)
        elif func in _RESHAPES and entry.fused > 1:
            self._factor(entry, t, out)
        elif entry.fused > 1:
            entry.uses.append(name)

    def _may_hold_one_head(self, entry: _Output) -> bool:
        """Whether a rank may hold one head of ``entry``: a Region's count equal to the axis size, or (outside
        any Region) an enclosing module's. Elsewhere a dim of size 1 before the features (``h.unsqueeze(2)``,
        ``view(b, t, 1, -1)``) is not a head, and an op over the features after it is over the rank's slice of
        them, unless the view left that dim to torch (``view(b, t, -1, head_dim)``: as many heads as there are,
        more on one device)."""
        return self.one_head or any(count == entry.parts for _, count in entry.counts.values())

    def _along_another_dim(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """A reduction, ordering or gather (feature_mixing.py's) along another dim than the features."""
        return keeps_features(name) and mixed(name, args, kwargs, self.features_of) is None

    def _cut(self, entry: _Output, name: str, sizes: list[int]) -> None:
        if len(sizes) < 2:
            return
        if entry.fused == 1:
            fixed = name in ("chunk", "tensor_split", "glu") and len(set(sizes)) == 1
            if fixed or len(set(sizes)) > 1 or self.widths.intersection(sizes):
                raise ValueError(_plain_refusal(entry, name, sizes, self.widths.intersection(sizes)))
            return
        block = entry.width // entry.fused
        edges = set(_offsets(sizes))
        if all(e % block == 0 for e in edges) or all(k * block in edges for k in range(entry.fused + 1)):
            entry.cut = True  # whole blocks, or pieces of them
            if len(sizes) < entry.fused:
                entry.short = (name, sizes)  # fewer parts than blocks: explained if the module then fails
            return
        what = f"cuts this rank's {entry.width} features at sizes {sizes} ({name})"
        raise ValueError(_fused_refusal(entry, what))

    def _slice(self, entry: _Output, t: Tensor, index: Any) -> None:
        """``t[..., a:b]``: a slice of the features at block edges takes a block (or several)."""
        bounds = _feature_slice(t, index)
        if bounds is None:
            entry.uses.append("[...]")
            return
        start, stop = bounds
        block = entry.width // entry.fused
        if start % block == 0 and stop % block == 0:
            entry.cut = True
            return
        raise ValueError(_fused_refusal(
            entry, f"slices this rank's {entry.width} features at [{start}:{stop}], across its blocks of {block}"
        ))

    def _factor(self, entry: _Output, t: Tensor, out: Tensor) -> None:
        """A reshape of the features into several dims: the blocks must be the outermost one."""
        factors = _feature_factors(list(t.shape), list(out.shape))
        if factors is None:
            entry.uses.append(f"a reshape to {list(out.shape)}")
            return
        if factors[0] == entry.fused:
            entry.cut = True
            return
        raise ValueError(
            f"{_fused_head(entry)}, but the module reshapes this rank's {entry.width} features into {factors}, "
            f"not {entry.fused} blocks outermost: its features are laid out otherwise (per head: q, k and v of "
            "each head side by side, as GPT-NeoX's query_key_value and BLOOM's are). A plain Colwise() gives each "
            "rank whole heads of such a layout: use it, with the head count in the Region's heads=(...)"
        )


def _mixing_refusal(entry: _Output, what: str, across_heads: bool = False) -> str:
    whole = f"{entry.width} of {entry.width * entry.parts}" if entry.parts > 1 else str(entry.width)
    if across_heads and entry.parameter:
        return (
            f"tensor_parallel: PerHead() on {entry.label!r} gives each rank its heads' values, 1/tp of them ("
            f"{entry.width} of {entry.width * entry.parts} here), and the module computes {what}: over this rank's "
            "heads alone, not all of them, so the model trains another model without an error. PerHead() "
            "fits a parameter each head reads its own value of (GPT-OSS's sinks, one logit per head); leave this "
            "one out of the plan, and the attention's projections too (replicated)"
        )
    if across_heads:
        return (
            f"tensor_parallel: Colwise() on {entry.label!r} gives each rank whole heads, 1/tp of them ({whole} "
            f"features here), and the module computes {what} of its per-head view: over this rank's heads alone, "
            "not all of them, so the model trains another model without an error. Compute it within each head "
            "(over head_dim), or leave this module's projections out of the plan (replicated)"
        )
    share = (
        f"Colwise(fused={entry.fused}) on {entry.label!r} gives each rank 1/tp of each of its {entry.fused} blocks "
        "of output features" if entry.fused > 1
        else f"Colwise() on {entry.label!r} gives each rank a contiguous 1/tp of its output features"
    )
    return (
        f"tensor_parallel: {share} ({whole} here), and the module computes {what}, "
        f"{'after merging its heads back' if entry.merged else 'before any per-head view'}: "
        "over this rank's slice of the features alone, not all of them, so the model trains another model without "
        "an error. If it is meant per head, compute it after viewing the output per head (view(..., -1, "
        "head_dim), as Qwen3's q_norm is): each rank holds whole heads. If it needs all the features, leave this "
        "module's projections out of the plan (replicated), or gather the output with Colwise(output='replicated') "
        f"on {entry.label!r} (what takes it then takes whole values: no Rowwise after it). Logits a head leaves "
        "split over the vocabulary are for loss_fn's sw.tp.vocab_parallel_cross_entropy (or vocab_parallel=False "
        "in the ready plans)"
    )


def _fused_refusal(entry: _Output, what: str) -> str:
    return (
        f"{_fused_head(entry)}, but the module {what}: not its {entry.fused} blocks of "
        f"{entry.width // entry.fused}. {_fused_fix(entry)}"
    )


def _fused_head(entry: _Output) -> str:
    return (
        f"tensor_parallel: Colwise(fused={entry.fused}) on {entry.label!r} gives each rank its 1/tp of each of "
        f"{entry.fused} equal blocks of the output features (q, k and v side by side, each split)"
    )


def _fused_fix(entry: _Output) -> str:
    return (
        f"fused={entry.fused} fits a projection whose module cuts {entry.fused} equal blocks apart "
        f"(chunk({entry.fused}, -1); split(width, -1) with the width named in the Region's local=(...)). Blocks of "
        "unequal widths (grouped-query attention's q, k and v in one projection) cannot be split so: compute them "
        "with separate Linear modules, each Colwise(); a projection laid out per head takes a plain Colwise()"
    )


def _plain_refusal(entry: _Output, name: str, sizes: list[int], divided: set[int]) -> str:
    why = f", at {min(divided)}, a width the Region divides: as many parts on a rank as on the whole" if divided else ""
    return (
        f"tensor_parallel: Colwise() on {entry.label!r} gives each rank a contiguous 1/tp of its output features, "
        f"and the module cuts that output into parts along them ({name}): this rank's {entry.width} features into "
        f"{sizes}{why}; on a rank the parts are pieces of other blocks (all of q and part of k, for q, k and v "
        "computed in one projection). If it computes several equal blocks side by side (q, k and v; gate and up), "
        "give it Colwise(fused=<the number of blocks>), and name the width the module cuts at in the Region's "
        "local=(...) (GPT-2's split_size); blocks of unequal widths (grouped-query attention's "
        "q, k and v) need separate Linear modules, each Colwise()"
    )


def _tensor_args(
    args: Sequence[Any], kwargs: dict[str, Any], entry_of: Callable[[Any], _Found | None]
) -> Iterable[tuple[Tensor, _Found]]:
    """The watched tensors among the arguments (and in the lists among them: torch.cat's)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            entry = entry_of(t)
            if entry is not None:
                yield t, entry


def _along_features(t: Tensor, args: Sequence[Any], kwargs: dict[str, Any], cut: str = "") -> bool:
    dim = _FIXED_CUT_DIM[cut](t.dim()) if cut in _FIXED_CUT_DIM else kwargs.get("dim", args[2] if len(args) > 2 else 0)
    return isinstance(dim, int) and t.dim() > 0 and dim % t.dim() == t.dim() - 1


def _offsets(sizes: list[int]) -> list[int]:
    edges = [0]
    for s in sizes:
        edges.append(edges[-1] + s)
    return edges


def _feature_slice(t: Tensor, index: Any) -> tuple[int, int] | None:
    """``(start, stop)`` of an index that slices the last dim only (step 1), else None."""
    items = list(index) if isinstance(index, tuple) else [index]
    if items.count(Ellipsis) == 1 and items[-1] is not Ellipsis:
        items = items[items.index(Ellipsis) + 1:]
        items = [slice(None)] * (t.dim() - len(items)) + items
    if len(items) != t.dim() or not all(isinstance(i, slice) and i == slice(None) for i in items[:-1]):
        return None
    last = items[-1]
    if not isinstance(last, slice):
        return None
    start, stop, step = last.indices(t.shape[-1])
    return (start, stop) if step == 1 and stop > start else None


def _feature_factors(before: list[int], after: list[int]) -> list[int] | None:
    """The dims a reshape made of the last dim of ``before``: the trailing dims of ``after`` whose
    product is that dim, the others holding the leading dims; None where it mixed them."""
    width, product = before[-1], 1
    for k in range(len(after) - 1, -1, -1):
        product *= after[k]
        if product == width:
            return after[k:] if math.prod(after[:k]) == math.prod(before[:-1]) else None
        if product > width:
            return None
    return None


def _inferred(func: Any, args: Sequence[Any], kwargs: dict[str, Any], dim: int) -> bool:
    """Whether a reshape (``view``, ``reshape``, ``unflatten`` of the last dim) left output dim ``dim`` to torch
    (-1): a count of what fits, which is the heads' where the other sizes are a head's."""
    if func in (Tensor.unflatten, torch.unflatten):
        sizes = kwargs.get("sizes", args[2] if len(args) > 2 else None)
        tensor = args[0] if args else None
        if not isinstance(tensor, Tensor) or not isinstance(sizes, (list, tuple)):
            return False
        dim -= tensor.dim() - 1  # its sizes start where the unflattened (last) dim was
    else:
        given = kwargs.get("shape", args[1:] if len(args) > 1 else ())
        sizes = given[0] if len(given) == 1 and isinstance(given[0], (list, tuple)) else given
    return isinstance(sizes, (list, tuple)) and 0 <= dim < len(sizes) and sizes[dim] == -1


def _one_head_before(before: list[int], after: list[int], factors: list[int]) -> bool:
    """Whether the reshape also put a dim of size 1 right before ``factors`` that ``before``'s leading dims do not
    hold: a per-head view of a rank holding one head (Persimmon's and Bloom's ``view(b, t, heads, 3, head_dim)`` at
    tp = heads), where the trailing product stops at (3, head_dim) and would read the 3 (q, k, v) as the heads."""
    lead = after[: len(after) - len(factors)]
    return len(factors) >= 2 and len(lead) == len(before) and lead[-1] == 1 and lead[:-1] == before[:-1]


def _glu_along_features(t: Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
    return isinstance(dim, int) and t.dim() > 0 and dim % t.dim() == t.dim() - 1


def _one_head_view(t: Tensor, out: Any) -> bool:
    """``out`` puts a dim of size 1 right before ``t``'s features (``view(b, s, -1, head_dim)`` of a rank
    holding one head, or ``reshape(-1, heads, head_dim)`` folding the leading dims, as Chameleon's q_norm takes
    it): a per-head view, whose features are the head's, as with any head count; followed
    as the output, its per-head cuts (a partial rotary's ``split([rot, rest])``) read as cuts of the
    projection."""
    return (isinstance(out, Tensor) and out.dim() >= 2 and out.shape[-1] == t.shape[-1] and out.shape[-2] == 1
            and math.prod(out.shape[:-2]) == math.prod(t.shape[:-1]))


def _moved_on(func: Any, t: Tensor, dim: int, args: Sequence[Any], out: Tensor) -> int | None:
    """Where ``out`` holds the features ``t`` holds in ``dim`` (not its last): an unsqueeze before them."""
    if _name(func) == "unsqueeze" and len(args) >= 2 and isinstance(args[1], int) and out.dim() == t.dim() + 1:
        at = args[1] % out.dim()
        return dim + 1 if at <= dim else dim
    return None


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))
