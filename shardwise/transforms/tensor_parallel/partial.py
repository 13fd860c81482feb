"""Where the sequence-parallel region begins, the embedding's lookups travel unsummed (DTensor's Partial).

A vocabulary-split embedding (``Rowwise``) whose lookups feed the first sequence-parallel block
leaves them unsummed: each rank holds a partial sum over the whole sequence, and the first block's
input reduce-scatters it into the rank's slice (backward: an all-gather), as torch's
``RowwiseParallel(output_layouts=Shard(1))`` does, where Megatron all-reduces and then slices (twice
the bytes). The code between keeps the whole sequence's shape: Hugging Face derives the positions,
the cache positions, the causal mask and the rotary tables from ``inputs_embeds.shape[1]``, which a
sequence slice would give as the local length.

That code is the model's, not shardwise's (TinyGPT and GPT-2 add the position embedding, GPT-2
applies dropout), so a :class:`Follower` (a TorchFunctionMode over the layer's call) follows the
partial sums through it and keeps the arithmetic exact:

* reading the shape, dtype or device is free;
* an op linear in its one partial operand, whose other tensors are constants (a reshape, a copy,
  dropout, a product with a constant), gives a partial sum;
* a sum with a replicated tensor counts that tensor on index 0 only (:func:`to_partial`, whose
  gradient, like a partial sum's, is every rank's);
* anything else sums the partial over the axis first (an all-reduce, as before).

The first block reduce-scatters its input when it is a followed partial sum, else slices it. Where
the embedding sits in the layer right before the first block's (``match.py`` decides it from the
chain), that layer's output leaves as a partial sum (a whole one made partial) and the next layer
follows its input as one; any other partial value leaving a layer is summed.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...collectives.function import QuickApplyFunction
from ...engine.stack import in_layer
from .comm import gather_invariant, leave, scatter, vary
from .following import current
from .positions import ELEMENTWISE, Held, _keeps_positions, judge


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Ops that read only a tensor's metadata: free on a partial sum.
METADATA = _words("""
    size dim ndimension numel nelement stride element_size is_floating_point is_complex is_contiguous
    __len__ storage_offset get_device shape dtype device ndim requires_grad is_cuda is_meta is_leaf
    layout names is_sparse is_quantized grad_fn
""")
# Sums: every tensor operand a partial sum (a replicated one counted on index 0 only).
SUMS = _words("add sub subtract __add__ __radd__ __sub__ __rsub__ __iadd__ __isub__ cat concat concatenate stack")
# Linear in their one partial operand when every other tensor operand is a constant (needs no gradient).
LINEAR = _words("""
    mul multiply div divide true_divide __mul__ __rmul__ __imul__ __truediv__ __itruediv__ __div__ neg negative
    __neg__ dropout clone contiguous to float double half bfloat16 type_as detach
    view view_as reshape reshape_as flatten unflatten squeeze unsqueeze expand expand_as broadcast_to
    transpose permute __getitem__ narrow select chunk split unbind
""")
DIVIDES = _words("div divide true_divide __truediv__ __itruediv__ __div__")  # the partial must be the numerator
# The LINEAR ops whose partial operand may be any of their tensors; every other one is linear in its first
# operand only: ``pe.type_as(x)``, ``mask.expand_as(x)`` or ``cos.to(x)`` with ``x`` a partial sum give
# ``pe`` or ``mask`` whole on every rank (a replicated value), not a partial sum of it.
COMMUTES = _words("mul multiply __mul__ __rmul__")
CONCATS = _words("cat concat concatenate stack")  # their number arguments are dims, not addends


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: x.shape, x.dtype
        name = str(getattr(getattr(func, "__self__", None), "__name__", name))
    return name


def _mapped(
    args: Sequence[Any], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor], which: Callable[[Tensor], bool]
) -> tuple[Sequence[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with ``fn`` applied to the tensors ``which`` selects (lists of tensors too)."""

    def one(t: Any) -> Any:
        return fn(t) if isinstance(t, Tensor) and which(t) else t

    new_args = tuple(optree.tree_map(one, a, none_is_leaf=True) for a in args)
    return new_args, {k: optree.tree_map(one, v, none_is_leaf=True) for k, v in kwargs.items()}


def _adds_a_number(base: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a sum adds a plain number (``x + 0.5``, ``torch.add(x, other=0.5)``, ``x + np.float32(1)``,
    ``x + True``), which every rank would add to its partial sum: it then takes the whole value. ``alpha=``
    scales the other operand, and a concatenation's numbers are dims."""
    if base in CONCATS:
        return False
    given = [*args, *(v for k, v in kwargs.items() if k != "alpha")]
    return any(isinstance(a, numbers.Number) for a in given)


def _inplace(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


class _Tracked:
    """Tensors by identity (a weak reference each: a dead tensor's id may be reused)."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref[Tensor]] = {}

    def add(self, tree: Any) -> None:
        for t in optree.tree_leaves(tree, none_is_leaf=True):
            if isinstance(t, Tensor):
                self.refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: object) -> bool:
        ref = self.refs.get(id(t))
        return ref is not None and ref() is t

    def __bool__(self) -> bool:
        return bool(self.refs)


class Follower(TorchFunctionMode):
    """Follows a layer's values in reduced form (see the module docstring); ``label`` names the layer."""

    def __init__(self, axis: str, reduce: torch.dtype | None, label: str) -> None:
        super().__init__()
        self.axis, self.reduce, self.label = axis, reduce, label
        self.values = _Tracked()
        self.slices: dict[int, tuple[weakref.ref[Tensor], Held]] = {}  # the last block's output, its slice
        # A slice whose sequence length was read (x.size(1), x.shape, x.numel()), and its gathered value, which
        # every later use of it takes: the length the code read is the whole sequence's.
        self.whole: dict[int, tuple[weakref.ref[Tensor], Tensor]] = {}
        self.made: dict[tuple[str, int], tuple[weakref.ref[Tensor], Tensor]] = {}  # (kind, id) -> made once
        self.quiet = 0

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.quiet or not (self.values or self.slices or self.whole):
            return func(*args, **kwargs)
        given: Any = (tuple(args), kwargs)
        leaves = [t for t in optree.tree_leaves(given) if isinstance(t, Tensor)]
        if any(self.whole_of(t) is not None for t in leaves):
            args, kwargs = _mapped(args, kwargs, self._whole_or, lambda t: self.whole_of(t) is not None)
            given = (tuple(args), kwargs)
            leaves = [t for t in optree.tree_leaves(given) if isinstance(t, Tensor)]
        values = [t for t in leaves if t in self.values]
        sliced = next((t for t in leaves if self.slice_of(t) is not None), None)
        if not values and sliced is None:
            return func(*args, **kwargs)
        name = _name(func)
        if name in METADATA:
            if sliced is not None and args and args[0] is sliced and self._reads_length(name, args, kwargs, sliced):
                return func(self._made_whole(sliced), *args[1:], **kwargs)
            return func(*args, **kwargs)
        if sliced is not None:
            return self._on_slice(func, name, args, kwargs, sliced)
        run_args, run_kwargs, partial_out = self._on_values(name, args, kwargs, leaves, values)
        out = func(*run_args, **run_kwargs)
        if partial_out and not _inplace(name) and not all(
            t.is_floating_point() or t.is_complex() for t in optree.tree_leaves(out) if isinstance(t, Tensor)
        ):  # a cast to integers or bools (x.to(torch.long), x.type_as(ids)) is not linear: it takes the sum
            whole_args, whole_kwargs = _mapped(args, kwargs, self._summed, lambda t: t in self.values)
            out = func(*whole_args, **whole_kwargs)
            partial_out = False
        if partial_out:
            self.values.add(out)
        return out

    def _on_values(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], leaves: list[Tensor], values: list[Tensor]
    ) -> tuple[Sequence[Any], dict[str, Any], bool]:
        """The arguments to run the op on, and whether its output is a partial sum."""
        base = name[:-1] if _inplace(name) and name.endswith("_") else name
        others = [t for t in leaves if t not in self.values]
        in_place_on_other = _inplace(name) and bool(args) and args[0] not in self.values
        if base in SUMS and not _adds_a_number(base, args, kwargs) and not in_place_on_other:
            # a replicated addend counted once
            return (*_mapped(args, kwargs, self._replicated, lambda t: t not in self.values), True)
        linear = base in LINEAR and len(values) == 1 and not any(t.requires_grad for t in others)
        if linear and not in_place_on_other and (base in COMMUTES or (args and args[0] is values[0])):
            return args, kwargs, True
        if (_inplace(name) or name == "__setitem__") and args and args[0] in self.values:
            # x.clamp_(...), x[:, 0] = v, x.mul_(w): the caller keeps using x itself, so x is made whole in
            # place (a copy of its sum), no longer followed, and the op then runs on it.
            whole, x = self._summed(args[0]), args[0]
            self.quiet += 1
            try:
                x.copy_(whole)
            finally:
                self.quiet -= 1
            del self.values.refs[id(x)]
        return (*_mapped(args, kwargs, self._summed, lambda t: t in self.values), False)

    def slice_of(self, t: Any) -> Held | None:
        """What ``t`` holds when it is a followed slice of the sequence (the last block's output)."""
        entry = self.slices.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def whole_of(self, t: Any) -> Tensor | None:
        """The gathered value of ``t`` when it is a slice whose sequence length was read."""
        entry = self.whole.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _whole_or(self, t: Tensor) -> Tensor:
        whole = self.whole_of(t)
        return t if whole is None else whole

    def _reads_length(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor) -> bool:
        """Whether reading ``name`` of the slice ``x`` gives a figure of its sequence length (the slice's,
        1/N of the whole): its size or shape, its number of elements, a stride, or (folded) its length."""
        held = self.slice_of(x)
        assert held is not None
        if name in ("shape", "numel", "nelement"):
            return True
        if name == "__len__":
            return held.folded
        if name in ("size", "stride"):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return not isinstance(dim, int) or dim % max(x.dim(), 1) < len(held.lead)
        return False

    def _made_whole(self, x: Tensor) -> Tensor:
        """The slice ``x`` gathered, and taken for ``x`` by every later op of this layer: code that read the
        sequence length goes on with the whole sequence, so a length it computes with is the true one
        (``pos_emb[:, :x.size(1)]`` read at the slice's length took positions 0..T/N-1 on every rank)."""
        whole = self._gathered(x)
        del self.slices[id(x)]
        self.whole[id(x)] = (weakref.ref(x), whole)
        return whole

    def hold_slice(self, tree: Any, held: Held) -> None:
        for t in optree.tree_leaves(tree, none_is_leaf=True):
            if isinstance(t, Tensor):
                self.slices[id(t)] = (weakref.ref(t), held)

    def _on_slice(self, func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor) -> Any:
        """An op on the last block's output, a slice of the sequence: run on the slice when it computes
        position by position (positions.judge), its replicated tensors' gradients summed over the axis;
        else on the whole sequence, gathered."""
        held = self.slice_of(x)
        assert held is not None
        base = name[:-1] if _inplace(name) and name.endswith("_") else name
        changes = (_inplace(name) or name == "__setitem__") and bool(args) and self.slice_of(args[0]) is not None
        if changes:  # the caller keeps using the slice itself: a gathered copy would take the change and drop it
            x = args[0]
            held = self.slice_of(x)
            assert held is not None
            return self._in_place_on_slice(func, name, base, args, kwargs, x, held)
        if not (_inplace(name) and base not in ELEMENTWISE):  # an in-place op that may not be position-wise runs whole
            run_args, run_kwargs = _mapped(
                args, kwargs, self._varied,
                lambda t: self.slice_of(t) is None and t.requires_grad and t.is_floating_point(),
            )
            why: str | None = "fails"
            made: Held | None = None
            try:
                out = func(*run_args, **run_kwargs)
            except RuntimeError:  # shapes that do not fit a slice (a tensor of the whole sequence): gathered below
                pass
            else:
                why, made = judge(func, run_args, run_kwargs, x, held, out, lambda t: self.slice_of(t) is not None)
            if why is None:
                if made is not None:
                    self.hold_slice(out, made)
                return out
        whole_args, whole_kwargs = _mapped(args, kwargs, self._gathered, lambda t: self.slice_of(t) is not None)
        return func(*whole_args, **whole_kwargs)

    def _in_place_on_slice(
        self, func: Any, name: str, base: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, held: Held
    ) -> Any:
        """An in-place op on the last block's output: run on the slice when it is position-wise, else refused."""
        why: str | None = f"{name} is not a position-wise op"
        if name == "__setitem__":
            keeps = _keeps_positions(args[1], x.dim(), len(held.lead))
            why = None if keeps else f"x[{args[1]!r}] = ... writes across positions"
        elif base in ELEMENTWISE:
            why = None
        if why is None:
            run_args, run_kwargs = _mapped(
                args[1:], kwargs, self._varied,
                lambda t: self.slice_of(t) is None and t.requires_grad and t.is_floating_point(),
            )
            try:
                out = func(args[0], *run_args, **run_kwargs)
            except RuntimeError as e:  # an operand of the whole sequence
                why = f"{name} takes a tensor of another shape ({e})"
            else:
                holds = lambda t: self.slice_of(t) is not None  # noqa: E731
                why, _ = judge(func, (args[0], *run_args), run_kwargs, x, held, out, holds)
                if why is None:
                    return out
        fix = "x = torch.where(...)" if name == "__setitem__" else f"x = x.{base}(...)"
        raise ValueError(
            f"tensor_parallel(sequence_parallel=...): layer {self.label!r} changes the last sequence-parallel "
            f"block's output in place, and {why}; that output holds this rank's slice of the sequence (it is "
            "gathered where code needs the whole sequence, but a gathered copy would take the change and drop "
            f"it), so the step would train silently wrong: write it out of place ({fix}), or leave the last "
            "block out of sequence_parallel"
        )

    def _gathered(self, t: Tensor) -> Tensor:
        """A slice made whole: all-gathered (this rank's slice of the gradient)."""
        return self._made("gather", t, lambda x: gather_invariant(x, self.axis, 1, self.label))

    def _sliced(self, t: Tensor) -> Tensor:
        """A whole value cut to this rank's slice of the sequence (its gradient all-gathered)."""
        return self._made("slice", t, lambda x: scatter(x, self.axis, 1, self.label))

    def _varied(self, t: Tensor) -> Tensor:
        """A replicated tensor used on a slice: its gradient summed over the axis."""
        return self._made("vary", t, lambda x: vary(x, self.axis, self.label, self.reduce))

    def _replicated(self, t: Tensor) -> Tensor:
        """A replicated addend of a sum with partial sums, counted on index 0 only (an integer or bool one
        too: ``x + ids`` adds the ids once, not once per rank)."""
        return to_partial(t, self.axis)

    def _made(self, kind: str, t: Tensor, make: Any) -> Tensor:
        key = (kind, id(t))
        entry = self.made.get(key)
        if entry is not None and entry[0]() is t:
            return entry[1]
        self.quiet += 1
        try:
            made = make(t)
        finally:
            self.quiet -= 1
        self.made[key] = (weakref.ref(t), made)
        return made

    def _summed(self, t: Tensor) -> Tensor:
        """A partial sum made whole: all-reduced (its gradient, every rank's, passes as it is)."""
        return self._made("sum", t, lambda x: leave(x, self.axis, None, self.label, self.reduce))

    def before_collective(self, x: Tensor, op: str | None, dim: int) -> Tensor:
        """What one of our collectives takes for ``x``: the first block's reduce-scatter takes a partial sum
        as it is and the head's all-gather a slice; any other is given the whole value."""
        if self.quiet:
            return x
        x = self._whole_or(x)
        if x in self.values and not (op == "psum_scatter" and dim == 1):
            return self._summed(x)
        if self.slice_of(x) is not None and not (op == "all_gather" and dim == 1):
            return self._gathered(x)
        return x

    def finish(self, out: Any, values_out: bool, slices_out: bool = False) -> Any:
        """The layer's output as it leaves: its first leaf a partial sum when ``values_out`` (made one if
        it is not), or a slice when ``slices_out``; every other partial sum summed, slice gathered."""
        leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        changed = False
        for i, t in enumerate(leaves):
            if not isinstance(t, Tensor):
                continue
            first = i == 0
            whole = self.whole_of(t)
            if whole is not None:  # a slice whose length was read: whole, or sliced again to leave as a slice
                leaves[i], changed = (self._sliced(whole) if first and slices_out else whole), True
            elif t in self.values and not (first and values_out):
                leaves[i], changed = self._summed(t), True
            elif first and values_out and t not in self.values and t.is_floating_point():
                leaves[i], changed = to_partial(t, self.axis), True
            elif self.slice_of(t) is not None and not (first and slices_out):
                leaves[i], changed = self._gathered(t), True
        return optree.tree_unflatten(spec, leaves) if changed else out


def holds_values(t: Any) -> bool:
    """Whether ``t`` is a partial sum the current follower follows."""
    f = current()
    return f is not None and t in f.values


def holds_slice(t: Any) -> bool:
    """Whether ``t`` is the last block's output, a slice of the sequence the current follower follows."""
    f = current()
    return f is not None and f.slice_of(t) is not None


def hold_slice(t: Tensor) -> Tensor:
    """Follow ``t``, the last block's output, as this rank's slice of the sequence (match.py decided
    that a follower runs)."""
    f = current()
    assert f is not None, "the layer of the last sequence-parallel block follows its output"
    f.hold_slice(t, Held((t.shape[0], t.shape[1])))
    return t


def hold_values(t: Tensor) -> bool:
    """Follow ``t`` as a partial sum; False when no follower runs (the caller sums it then)."""
    f = current()
    if f is None:
        return False
    f.values.add(t)
    return True


# -- a replicated value as a partial sum ---------------------------------------


def to_partial(x: Tensor, axis: str) -> Tensor:
    """A replicated value as a partial sum: itself on index 0, zeros elsewhere; backward the identity
    (a partial sum's gradient is every rank's, like a replicated value's)."""
    return _ToPartial.apply(x, axis)


class _ToPartial(QuickApplyFunction):
    @staticmethod
    def forward(x: Tensor, axis: str) -> Tensor:
        return x.clone() if in_layer.index(axis) == 0 else torch.zeros_like(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None]:
        return g, None
