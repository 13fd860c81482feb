"""Refusing model code that reads a split parameter outside the forward of the module that splits it.

Under tensor parallel a Colwise or Rowwise module's weight (and a Colwise bias) is this rank's slice:
the module's own forward computes with it, and the communication around that forward makes the
result the one device's. Any other code of the layer that reads the parameter gets the slice where
it meant the whole: a parent whose forward divides by ``self.mlp.up_proj.weight.norm()`` (a
normalized-weight MLP), a regularizer the model adds to its output (``sum(p.pow(2).sum() for p in
self.parameters())``), ``F.linear(x, self.up.weight)`` elsewhere, ``self.up.weight.shape[0]`` as a
width. Some of these make the replicated parameters' gradients differ between ranks (refused then,
by the step's replica check, naming no cause); others compute another model, or another loss, on
every rank alike, and nothing else notices.

:class:`WeightReads` runs around a layer's first call on each rank (the Plan's prediction, or the
first step, before any update), as the cut watch does, and on no later call (a read that only a later
call makes, a branch taken from the second step on, is not seen): every torch op on one of the layer's split
parameters is refused unless it runs inside that parameter's own module's tensor-parallel forward
(:func:`own_use`), naming the parameter, the module that splits it, the op and the line of model
code. Reading its dtype, device or number of dims is no use of the values and passes, and so does an op
shardwise's own code calls (a refusal that reads the weights' shapes to explain a failure). torch.nn's own
modules and functions are model code (``nn.MultiheadAttention`` hands its ``out_proj.weight`` to
``F.multi_head_attention_forward``, never calling ``out_proj``); the rest of torch's Python only passes the
op on (:func:`_passing_on`). A PerHead
parameter is the Region's own to read, each head its value: split_watch.py follows those.

A split module's own forward is tensor parallel's to run when it is torch's (``nn.Linear``,
``nn.Embedding``) or Hugging Face's ``Conv1D``. A subclass that overrides it (Falcon's
``FalconLinear``: ``input @ self.weight.T + self.bias``) is followed too: its weight may be cast,
transposed or scaled by a number on the way to one product with the input (``linear``, ``matmul``,
``mm``, ``addmm``, ``embedding``), and any other use (``F.linear(x, self.weight / self.weight.norm())``,
a normalized weight), its shape read too (``weight.shape[1] ** -0.5`` would be the slice's fan-in), is
refused, naming the class. A Rowwise one's forward runs without its bias (added once, after the sum, as
it is: modules.py checks on zeros that the forward adds it so), and must return that product itself:
anything it computes after it would be applied to each rank's partial sum, not to the whole. A Colwise
one's (a Linear's or an Embedding's) may add its bias and apply functions of each feature alone (``tanh``,
a scale by a number): its output is the rank's slice of the features, and ``F.normalize`` over them would
normalize the slice (:func:`check_product`). It may view them per head, its features (the rank's whole heads)
split into (heads, head_dim) by a head width it fixes, the leading dims kept (``view(*x.shape[:-1], -1,
head_dim)``, ``unflatten(-1, (-1, head_dim))``), as an attention's parent views a plain Linear's, or a fused
q, k, v product viewed with its blocks (``Colwise(fused=3)``: ``view(b, t, 3, -1, head_dim)``) or per head
(``view(b, t, -1, 3, head_dim)``), its dims then moved (``transpose``): the output is then followed along its
heads (head_views.py), gathered along them for ``output='replicated'``; a view whose head width is left to -1
(by a whole head count, ``view(b, t, self.heads, -1)``: the rank's 1/tp of the width), that gives its heads
beside a size read off the rank's width (``y.shape[-1] // self.n``), that mixes the features with other dims, or
whose blocks are not outermost where its Colwise is fused, is refused (product_views.py says which views are
right, and why). A write into a part of the product there (an in-place op on one head of its per-head view,
``y[..., :4] = 0``, ``y[:, :, 0] = 0`` into a head) takes that part by its place on the rank's slice, another part
on each rank: refused, naming the op and the line. Which code made an op, the model's or shardwise's own, is
model_frames.py's question; the words of each refusal are read_refusals.py's.

A number (to scale the weight or the product by) is Python's or a 0-d tensor computed from neither the
product, nor a split weight, nor a Rowwise's input (the rank's slice of the features: :func:`follow_input`):
a buffer (an equalized-lr or muP multiplier), a constant, a learned 0-d gain of the module (match.py sums its
gradient over the axis: each rank's is its slice's part). That sum is over the whole layer's use of the gain, so
a gain is watched as a split parameter is: an op on it (or on a number its module's forward made from it) outside
that forward is refused (``y * self.up.gain`` in the parent: the same gradient on every rank, summed it would count
tp times), naming the gain, the module, the op and the line.
``y / y.norm()`` and ``weight * x.abs().max()`` (Rowwise) are followed as computed from the rank's slice.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .head_views import check_head_write, whole_along
from .model_frames import by_shardwise, model_line, watch_file
from .product_views import CUTS, MOVES, HeadView, cut_into_blocks, cut_refused, reshaped, stacked_blocks
from .read_refusals import custom_refusal, gain_refusal, product_refusal, read_refusal

watch_file(__file__)  # this watch's frames pass an op on: its caller is the code above them (model_frames.py)


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# What an op may read of a split parameter without using its values or its (per-rank) shape.
_FREE = _words("""
    dtype device requires_grad is_leaf grad_fn layout is_floating_point is_complex is_cuda is_meta is_sparse
    is_quantized get_device element_size is_contiguous names dim ndim ndimension __hash__ data_ptr
""")

# Shapes: a split module's own (overridden) forward sees its slice's, as its input is (Rowwise) or its
# output will be (Colwise).
_SHAPES = _words("size shape numel nelement stride __len__")
# What an overridden forward may do to its split weight on the way to the product: keep it a weight.
_CARRY = _words("t T mT transpose to float double half bfloat16 type type_as contiguous clone")
_BY_A_NUMBER = _words("mul __mul__ __rmul__ div __truediv__ true_divide neg __neg__")
_ADDS = _words("add __add__ __radd__")
# A function of each feature alone, on an overridden Colwise forward's product (with numbers): right on a slice.
_ELEMENTWISE = _words("""
    tanh sigmoid relu gelu silu softplus exp neg __neg__ abs mul __mul__ __rmul__ div __truediv__ true_divide
    add __add__ __radd__ sub __sub__ __rsub__ to float double half bfloat16 type contiguous clone
""")
_PRODUCTS = _words("linear matmul __matmul__ __rmatmul__ mm addmm bmm embedding")
# Reshapes of an overridden Colwise forward's product: a per-head view of its features is followed (_reshaped).
_RESHAPES = _words("view reshape unflatten flatten")

# .ids: {id of a split parameter: depth} while its own module's forward runs; .custom: the ids of those
# whose module's class overrides torch's forward (followed to their product); .reads: this thread's watch.
_own = threading.local()


@contextlib.contextmanager
def own_use(module: nn.Module, custom: bool = False, fused: int = 1) -> Iterator[None]:
    """While ``module``'s tensor-parallel forward runs, its own parameters are its to read; ``custom``: its
    class overrides torch's forward, whose use of them is followed (see the module docstring); ``fused``: the
    blocks its Colwise(fused=N) splits each of (what a per-head view of its product must put outermost)."""
    if getattr(_own, "reads", None) is None:  # no watch runs (a layer's later calls): nothing to tell it
        yield
        return
    ids: dict[int, int] | None = getattr(_own, "ids", None)
    if ids is None:
        ids = _own.ids = {}
    mine = [id(t) for t in module._parameters.values() if isinstance(t, Tensor)]
    for i in mine:
        ids[i] = ids.get(i, 0) + 1
    outer: frozenset[int] = getattr(_own, "custom", frozenset())
    _own.custom = outer | frozenset(mine) if custom else outer - frozenset(mine)
    reads: WeightReads = _own.reads
    # What an overridden forward computes from its product is followed from that forward alone: a number
    # the layer computed before it (from another module's output) is no function of this product.
    followed, refused_view, width_read, outer_fused = reads.followed, reads.refused_view, reads.width_read, reads.fused
    outer_owner = reads.owner
    if custom:
        reads.followed, reads.refused_view, reads.width_read, reads.fused = ({}, {}, {}, {}, {}), None, False, fused
        reads.owner = type(module).__name__
    try:
        yield
    finally:
        reads.followed, reads.refused_view, reads.width_read = followed, refused_view, width_read
        reads.fused, reads.owner = outer_fused, outer_owner
        _own.custom = outer
        for i in mine:
            ids[i] -= 1
            if not ids[i]:
                del ids[i]


def reads_watched() -> bool:
    """Whether a watch runs: the layer's first call on this rank, when its one-time checks are done."""
    return getattr(_own, "reads", None) is not None


def follow_input(x: Any) -> None:
    """A Rowwise's input, this rank's slice of its features: a number an overridden forward computes from it
    (``x.abs().max()``) is the slice's, no number to scale its weight by. Noted while a watch runs."""
    reads: WeightReads | None = getattr(_own, "reads", None)
    if reads is not None and isinstance(x, Tensor):
        reads.derived[id(x)] = weakref.ref(x)


def block_views_of(out: Any) -> tuple[HeadView, ...] | None:
    """The per-head views of a fused product's blocks, where a Colwise Linear subclass's forward returned them as
    a tuple (q, k, v: product_views.py); None otherwise, or where no watch runs."""
    reads: WeightReads | None = getattr(_own, "reads", None)
    return None if reads is None else reads.block_views(out)


def head_view_of(out: Any) -> HeadView | None:
    """The per-head view a Colwise Linear subclass's forward made of its product, where ``out`` is that view (its
    heads along ``heads_dim``: product_views.py); None otherwise, or where no watch runs."""
    reads: WeightReads | None = getattr(_own, "reads", None)
    return None if reads is None else reads.head_view(out)


def check_product(out: Any, label: str, module: nn.Module, rowwise: bool) -> None:
    """A split module's overridden forward must return its product with the input (a Colwise one's: plus its
    bias, or an elementwise function of that): a Colwise one's output is the rank's slice of the features, so
    only what acts on each feature alone is right on it (``F.normalize`` over them is not), and a Rowwise
    one's (run without its bias) is a partial sum, so anything after the product would act on the part, not
    the whole. Checked while a watch runs."""
    reads: WeightReads | None = getattr(_own, "reads", None)
    if reads is None or reads.holds(reads.products, out) or (not rowwise and (
        reads.holds(reads.after, out) or reads.head_view(out) is not None or reads.block_views(out) is not None
    )):
        return
    raise ValueError(product_refusal(label, module, rowwise, reads.refused_view, reads.fused))


class WeightReads(TorchFunctionMode):
    """Refuses an op on a split parameter outside its own module's forward (see the module docstring).

    ``split``: for each split parameter of the layer, its tensor and (its path in the model, the module
    and style that split it)."""

    def __init__(self, layer: str, split: Sequence[tuple[Tensor, str, str]],
                 gains: Sequence[tuple[Tensor, str, str]] = ()) -> None:
        super().__init__()
        self.layer = layer
        self.owner = ""  # the class of the Colwise Linear subclass whose forward runs (own_use)
        # The split modules' 0-d gains, as ``split``, and the 0-d tensors their forwards compute from them
        # (``self.gain.exp()``): whole on every rank, but their gradient is summed over the axis (_gain_use).
        self.gains: dict[int, tuple[Any, tuple[int, str, str]]] = {
            id(t): (weakref.ref(t), (id(t), path, by)) for t, path, by in gains
        }
        # id -> (the tensor, the split parameter it is or was made from: its id, path and splitter)
        self.split: dict[int, tuple[Any, tuple[int, str, str]]] = {
            id(t): (weakref.ref(t), (id(t), path, by)) for t, path, by in split
        }
        # While an overridden forward runs (own_use): its products (check_product), elementwise functions of
        # them by numbers, and anything else computed from them (a norm, a max: no number to scale them by).
        # The fourth: per-head views of those (their features split into heads, ...: product_views.py).
        # The fifth: the blocks of a fused product it cut apart (q, k, v = y.chunk(3, -1)), with their place.
        self.followed: tuple[dict[int, Any], ...] = ({}, {}, {}, {}, {})
        self.refused_view: str | None = None  # a reshape of the product no per-head view: what check_product says
        self.width_read = False  # the forward read its product's shape (the rank's width): a head width from it?
        self.fused = 1  # the blocks the overridden forward's Colwise(fused=N) splits each of

    @property
    def products(self) -> dict[int, weakref.ref[Tensor]]:
        return self.followed[0]

    @property
    def after(self) -> dict[int, weakref.ref[Tensor]]:
        return self.followed[1]

    @property
    def derived(self) -> dict[int, weakref.ref[Tensor]]:
        return self.followed[2]

    @property
    def viewed(self) -> dict[int, tuple[weakref.ref[Tensor], HeadView]]:
        return self.followed[3]

    @property
    def blocks(self) -> dict[int, tuple[weakref.ref[Tensor], int]]:
        return self.followed[4]

    def block_of(self, t: Any) -> int | None:
        """Which block of a fused product ``t`` is, where the forward cut it apart."""
        found = self.blocks.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def block_views(self, out: Any) -> tuple[HeadView, ...] | None:
        """The per-head views of its N blocks, each once, where an overridden fused forward returns them as a
        tuple (q, k, v each viewed per head); None otherwise."""
        if not isinstance(out, (tuple, list)) or len(out) != self.fused or self.fused == 1:
            return None
        views = tuple(self.head_view(t) for t in out)
        blocks = sorted(v.block for v in views if v is not None and v.block is not None)
        if len(blocks) != len(views) or blocks != list(range(self.fused)):
            return None  # (each block once, in any order: each is the rank's heads of its block)
        return views  # type: ignore[return-value]

    def head_view(self, t: Any) -> HeadView | None:
        """The per-head view an overridden Colwise forward made of its product, if ``t`` is that view."""
        found = self.viewed.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def __enter__(self) -> WeightReads:
        self.outer = getattr(_own, "reads", None)
        _own.reads = self
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _own.reads = self.outer

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        gain = self._gain_use(func, args, kwargs) if self.gains else None
        out = self._split_use(func, args, kwargs)
        if gain is not None and isinstance(out, Tensor) and out.dim() == 0 and _name(func) != "detach":
            self.gains[id(out)] = (weakref.ref(out), gain)  # a number made from the gain (with its gradient) is watched
        return out

    def _gain_use(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, str, str] | None:
        """A split module's 0-d gain (or a number its forward made from it) used by ``func``: refused outside that
        module's forward. There each rank's use meets the rank's slice, its gradient the rank's part of the
        whole's, which match.py sums over the axis for the whole layer; a use outside (``y * self.up.gain`` in
        the parent) has the same gradient on every rank, and summed too it would count tp times."""
        name = _name(func)
        if name in _FREE or name in _SHAPES:  # (a 0-d tensor's shape is the whole's)
            return None
        owned: dict[int, int] = getattr(_own, "ids", None) or {}
        found = None
        for a in (*args, *kwargs.values()):
            for t in a if type(a) in (list, tuple) else (a,):
                entry = self.gains.get(id(t)) if isinstance(t, Tensor) else None
                if entry is None or entry[0]() is not t:
                    continue
                root, path, by = found = entry[1]
                if root not in owned and not by_shardwise(name):
                    raise ValueError(gain_refusal(self.layer, path, by, name, model_line(name)))
        return found

    def _split_use(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        split = self.split
        if not any(id(a) in split or (type(a) in (list, tuple) and any(id(t) in split for t in a))
                   for a in (*args, *kwargs.values())):
            if any(self.followed) and any(
                self._followed(t) for a in (*args, *kwargs.values())
                for t in (a if type(a) in (list, tuple) else (a,))
            ):
                return self._after_product(func, args, kwargs)
            return func(*args, **kwargs)  # (most ops: the layer's activations)
        name = _name(func)
        if name in _FREE:
            return func(*args, **kwargs)
        owned: dict[int, int] = getattr(_own, "ids", None) or {}
        custom: frozenset[int] = getattr(_own, "custom", frozenset())
        made = product = False
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                entry = self.split.get(id(t)) if isinstance(t, Tensor) else None
                if entry is None or entry[0]() is not t:
                    continue
                root, path, by = entry[1]
                if root not in owned and not by_shardwise(name):
                    raise ValueError(read_refusal(self.layer, path, by, name, model_line(name)))
                if root not in custom:
                    continue
                if name in _SHAPES:
                    # The slice's shape: a number the forward may scale by (fan-in, muP), the rank's part of it.
                    if not by_shardwise(name):
                        raise ValueError(custom_refusal(path, by, name, model_line(name), shape=True))
                    continue
                if name in _CARRY or (name in _BY_A_NUMBER and all(
                    self._a_number(b) for b in (*args, *kwargs.values()) if isinstance(b, Tensor) and b is not t
                )):
                    made = True
                elif name in _PRODUCTS or (name in _ADDS and any(
                    isinstance(b, Tensor) and self._is_product(b) for b in (*args, *kwargs.values())
                )):
                    product = True  # (its own bias added to the product: a Colwise bias is sliced as its outputs)
                elif not by_shardwise(name):
                    raise ValueError(custom_refusal(path, by, name, model_line(name), scaled=name in _BY_A_NUMBER))
        out = func(*args, **kwargs)
        if isinstance(out, Tensor) and made:
            self.split[id(out)] = (weakref.ref(out), next(e for e in self._entries(args, kwargs)))
        if isinstance(out, Tensor) and product:
            self.products[id(out)] = weakref.ref(out)
        return out

    def _a_number(self, t: Tensor) -> bool:
        """A 0-d tensor the same on every rank (a buffer, a constant: equalized-lr and muP multipliers), computed
        from neither a split weight, nor the product, nor a Rowwise's input (each the rank's part of the whole)."""
        entry = self.split.get(id(t))
        return t.dim() == 0 and not self._followed(t) and (entry is None or entry[0]() is not t)

    def _whole(self, t: Any) -> bool:
        """Whether ``t`` is an overridden forward's whole product (or an elementwise function of it, a per-head
        view of it, one of its fused blocks), no part of it."""
        return self.holds(self.products, t) or self.holds(self.after, t) or self.head_view(t) is not None or (
            self.block_of(t) is not None
        )

    def _is_product(self, t: Tensor) -> bool:
        return self.holds(self.products, t)

    def _followed(self, t: Any) -> bool:
        """Whether ``t`` is an overridden forward's product, or was computed from one."""
        return any(self.holds(found, t) for found in self.followed[:3]) or self.head_view(t) is not None or (
            self.block_of(t) is not None
        )

    @staticmethod
    def holds(found: dict[int, weakref.ref[Tensor]], t: Any) -> bool:
        ref = found.get(id(t)) if isinstance(t, Tensor) else None
        return ref is not None and ref() is t

    def _after_product(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """An op on an overridden forward's product, or on what was computed from it: an elementwise function
        of it by numbers (Python's, or 0-d tensors computed from neither the product nor a split weight: a norm
        or a max of the rank's slice is no number) is noted as such, anything else as computed from it."""
        out = func(*args, **kwargs)
        name = _name(func)
        first = args[0] if args else None
        viewed_heads = self.head_view(first) if name == "__setitem__" and len(args) >= 2 else None
        if viewed_heads is not None and isinstance(first, Tensor):
            check_head_write(first, args[1], viewed_heads.heads_dim, self.owner)
        writes = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        base = first._base if writes and isinstance(first, Tensor) else None
        features = name == "__setitem__" and len(args) >= 2 and isinstance(first, Tensor) and first.dim() > 0 and (
            self.holds(self.products, first) or self.holds(self.after, first)
        )  # y[..., :4] = 0: the rank's features taken by their place
        if (base is not None and not self._whole(first) and self._whole(base)) or (
            features and isinstance(first, Tensor) and not whole_along(first, args[1], first.dim() - 1)
        ):  # y[:, :, :, 0].zero_()
            raise ValueError(
                f"tensor_parallel: a Colwise Linear subclass ({self.owner}) writes into a part of its product in its "
                f"own forward ({name} at {model_line(name)}): its product is this rank's slice of the features (its "
                "heads, 1/tp of all), and a part taken by its place there (a head's number, a feature range) is "
                "another part on each rank, another model trained without an error. Write into the whole product "
                "(an elementwise function of it), or return the product and write into it in the parent, where "
                "tensor parallel follows the heads; or leave the module out of the plan"
            )
        if name in _SHAPES:
            self.width_read = True
            return out
        if name in _RESHAPES and isinstance(out, Tensor) and isinstance(first, Tensor) and (
            self.holds(self.products, first) or self.holds(self.after, first) or self.head_view(first) is not None
            or self.block_of(first) is not None
        ):
            self._reshaped(name, first, args[1:], kwargs, out)
            return out
        if name in CUTS and isinstance(first, Tensor) and (self.holds(self.products, first) or self.holds(
            self.after, first
        )):
            if cut_into_blocks(first, args[1:], kwargs, out, self.fused):
                for k, part in enumerate(out):  # its N blocks (q, k, v): each viewed per head as a product is
                    self.blocks[id(part)] = (weakref.ref(part), k)
                return out
            refused = cut_refused(name, first, args[1:], kwargs, out, self.fused)
            self.refused_view = self.refused_view or refused
        if name == "stack" and isinstance(out, Tensor) and isinstance(first, (list, tuple)):
            stacked = stacked_blocks([self.head_view(t) for t in first], kwargs.get(
                "dim", args[1] if len(args) > 1 else 0
            ), self.fused)
            if stacked is not None:  # its blocks' per-head views stacked back, the blocks outermost
                self.viewed[id(out)] = (weakref.ref(out), stacked)
                return out
        viewed = self.head_view(first) if name in MOVES and isinstance(out, Tensor) else None
        moved = None if viewed is None or not isinstance(first, Tensor) else viewed.moved(name, first, args[1:])
        if moved is not None:  # its dims moved (a head-major q, k, v view's transpose): its heads followed
            self.viewed[id(out)] = (weakref.ref(out), moved)
            return out
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        mains = [t for t in tensors if self.holds(self.products, t) or self.holds(self.after, t)]
        views = [t for t in tensors if self.head_view(t) is not None]
        numbers = [t for t in tensors if not any(t is u for u in (*mains, *views))]
        elementwise = (
            isinstance(out, Tensor) and name in _ELEMENTWISE
            and bool(mains) != bool(views) and all(t.shape == out.shape for t in (*mains, *views))
            and all(self._a_number(o) for o in numbers)
        )
        view = self.head_view(views[0]) if views else None
        if elementwise and view is not None:
            self.viewed[id(out)] = (weakref.ref(out), view)
        elif elementwise:
            self.after[id(out)] = weakref.ref(out)
        else:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, Tensor):
                    self.derived[id(t)] = weakref.ref(t)
        return out

    def _reshaped(self, name: str, t: Tensor, rest: Sequence[Any], kwargs: dict[str, Any], out: Tensor) -> None:
        """A reshape of a Colwise product (or of its per-head view): followed as a per-head view, or as the product
        again (merged back); any other is noted for check_product's refusal (product_views.py says which)."""
        block = self.block_of(t)
        found = reshaped(name, t, self.head_view(t), rest, kwargs, out, 1 if block is not None else self.fused,
                         self.width_read)
        if block is not None and found is None:
            self.blocks[id(out)] = (weakref.ref(out), block)  # the block's features last again
        elif block is not None and isinstance(found, HeadView):
            self.viewed[id(out)] = (weakref.ref(out), replace(found, block=block))
        elif found is None:
            self.after[id(out)] = weakref.ref(out)  # the features last again (merged back, or leading dims moved)
        elif isinstance(found, HeadView):
            self.viewed[id(out)] = (weakref.ref(out), found)
        else:
            self.derived[id(out)] = weakref.ref(out)
            self.refused_view = self.refused_view or found

    def _entries(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[int, str, str]]:
        for a in (*args, *kwargs.values()):
            entry = self.split.get(id(a)) if isinstance(a, Tensor) else None
            if entry is not None and entry[0]() is a:
                yield entry[1]


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a property getter: Tensor.shape.__get__ and the like
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name or func)
