"""Sequence parallel's guard: outside its Regions, a block may only compute position by position.

Inside a sequence-parallel block each rank holds its slice of the sequence (dim 1) between the
Regions, and that is right only for code that computes each position on its own (norms,
dropout, residual sums, Linear layers, activations). Anything that mixes positions (attention,
a convolution over time, a cumulative sum) would see only this rank's positions and train
silently wrong, so it must sit in a Region (whose input gathers the whole sequence) or be
refused.

The first time a block runs for an input shape (the Plan's prediction on fake tensors, or the
first step, before any update), a TorchFunctionMode follows the tensors that hold a slice of the
sequence: the block's hidden states, and what position-wise ops make of them. The collectives
say what they make (``collective``): an all-gather of the sequence (a Region or a Colwise
entering) a whole tensor, a reduce-scatter (a Rowwise leaving) a slice. Any op outside the
position-wise ones below that takes a slice is refused, naming the innermost module of the block
that runs it. The rule for each op is exact for dims 0 (batch) and 1 (sequence): an op passes
only if it leaves both where they are and computes each (batch, position) from that position
alone; dims 0 and 1 folded into one (``x.view(-1, d)``, as Hugging Face's Conv1D does) are
followed as rows until a reshape unfolds them.

What it cannot see: positions computed from a slice's length as plain ints (``torch.arange(
x.size(1))`` inside a block counts 0..T/N-1 on every rank); code between the blocks that is
not part of one (glue in a model's forward that runs on the split residual stream); functions
that bypass ``__torch_function__`` (a C extension called directly); and a block that computes
otherwise on a later call with the same input shape (it is followed once per shape).
"""

from __future__ import annotations

import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ...engine.model.token_wise import computes_each_token_alone, implementation_named
from .count_fields import MULTI_QUERY, config_field
from .match import HEAD_COUNTS, is_head_count


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Each computes every element from the elements at the same place (after broadcasting).
ELEMENTWISE = _words("""
    abs absolute add addcdiv addcmul atan2 bitwise_and bitwise_not bitwise_or bitwise_xor ceil
    clamp clamp_max clamp_min clip copysign cos cosh div divide eq erf erfc exp exp2 expm1
    float_power floor floor_divide fmax fmin fmod frac ge greater greater_equal gt hypot
    isfinite isinf isnan le less less_equal lerp log log10 log1p log2 logical_and logical_not
    logical_or logical_xor logit lt masked_fill maximum minimum mul multiply nan_to_num ne neg
    negative not_equal pow reciprocal remainder round rsqrt sigmoid sign sin sinh sqrt square sub
    subtract tan tanh true_divide trunc where xlogy
    celu elu gelu hardsigmoid hardswish hardtanh leaky_relu logsigmoid mish relu relu6 selu silu
    softplus softsign tanhshrink threshold
    bfloat16 bool byte char clone contiguous cpu cuda detach double float half int long requires_grad short to type
    type_as
    dropout alpha_dropout bernoulli normal uniform fill zero copy
    empty_like full_like ones_like rand_like randn_like zeros_like
    __abs__ __add__ __and__ __div__ __eq__ __floordiv__ __ge__ __gt__ __iadd__ __iand__
    __idiv__ __imul__ __invert__ __ior__ __isub__ __itruediv__ __ixor__ __le__ __lt__ __mod__
    __mul__ __ne__ __neg__ __or__ __pow__ __radd__ __rand__ __rdiv__ __rfloordiv__ __rmod__
    __rmul__ __ror__ __rpow__ __rsub__ __rtruediv__ __rxor__ __sub__ __truediv__ __xor__
""")

# Each keeps the element order (row-major): with dims 0 and 1 of the same sizes, every
# (batch, position) keeps its elements.
RESHAPES = _words("""
    broadcast_to expand expand_as flatten reshape reshape_as squeeze unflatten unsqueeze view
    view_as
""")

# Each acts along the dims its arguments name, as (position of the argument, default; None:
# required, or all dims): it passes when they are all past dim 1.
ALONG = {
    **dict.fromkeys(_words("""
        all amax amin any argmax argmin count_nonzero cummax cummin cumprod cumsum
        log_softmax logcumsumexp logsumexp max mean median min nanmean nansum prod softmax std
        std_mean sum var var_mean
    """), (1, None)),
    "glu": (1, -1), "sort": (1, -1), "argsort": (1, -1), "diff": (2, -1), "topk": (2, -1),
    "norm": (2, None), "vector_norm": (2, None), "normalize": (2, 1),
    "chunk": (2, 0), "split": (2, 0), "tensor_split": (2, 0), "unbind": (1, 0),
    "narrow": (1, None), "select": (1, None), "roll": (2, None), "flip": (1, None),
    "cat": (1, 0), "concat": (1, 0), "concatenate": (1, 0), "stack": (1, 0),
    "transpose": (1, None), "swapaxes": (1, None), "swapdims": (1, None),
    "movedim": (1, None), "moveaxis": (1, None), "permute": (1, None),
}
# Each takes or puts values along its dim (argument 1) by an index: with every tensor operand of the
# same leading dims, each (batch, position) of the output reads only its own row of each.
INDEXED_ALONG = _words("gather scatter scatter_add scatter_reduce")

# The second dim argument of transpose and movedim.
SECOND_DIM = {"transpose": 2, "swapaxes": 2, "swapdims": 2, "movedim": 2, "moveaxis": 2}

# Non-tensor results that carry a tensor's values, not its metadata.
VALUES = _words("item tolist numpy __bool__ __int__ __float__ __index__ __iter__ __array__")
METADATA = (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device, torch.layout)


def _dims(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int] | None:
    """The dims ``name`` acts along, from its arguments; None where it acts on all of them."""
    at, default = ALONG[name]
    if name == "permute":  # x.permute(0, 2, 1, 3), torch.permute(x, (0, 2, 1, 3))
        order = _ints(kwargs.get("dims", args[1] if len(args) == 2 else tuple(args[1:])))
        return None if order is None else [d for i, d in enumerate(order) if d % len(order) != i]
    if name == "flip" and len(args) > 2:
        value: Any = tuple(args[1:])
    else:
        named = [kwargs[k] for k in ("dim", "dims", "dim0", "source") if k in kwargs]
        value = args[at] if len(args) > at else (named[0] if named else default)
    if name in ("max", "min") and isinstance(value, Tensor):
        return []  # the elementwise maximum of two tensors
    first = _ints(value)
    if first is None or not first:
        return None
    if name in SECOND_DIM:
        second = args[SECOND_DIM[name]] if len(args) > SECOND_DIM[name] else kwargs.get(
            "dim1", kwargs.get("destination"))
        more = _ints(second)
        return None if more is None else first + more
    return first


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _keeps_positions(index: Any, ndim: int, k: int) -> bool:
    """Whether ``x[index]`` leaves the first ``k`` dims whole and in place."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (Tensor, list, bool)) for i in items):
        return False  # advanced indexing may move the dims it gathers to the front
    if items and items[0] is Ellipsis:
        rest = items[1:]
        return not any(i is Ellipsis for i in rest) and sum(i is not None for i in rest) <= ndim - k
    return len(items) >= k and all(_whole(i) for i in items[:k])


def _whole(item: Any) -> bool:
    """A slice that takes a whole dim in order: ``:``, ``0:``, ``::1`` (Hugging Face's
    ``hidden[:, slice(-0, None), :]`` for ``logits_to_keep=0``)."""
    return (
        isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1)
    )


@dataclass(frozen=True)
class Held:
    """A tensor holding this rank's slice of the sequence: dims 0 and 1 are ``seq`` (batch,
    positions), or, ``folded``, one dim 0 of their product (a Conv1D's ``x.view(-1, d)``)."""

    seq: tuple[int, int]
    folded: bool = False
    # rows every rank's gathered, one rank's after another's (seq: ranks x batch, positions): the (batch,
    # positions) each rank held, to which a reduce-scatter of them returns
    gathered_from: tuple[int, int] | None = None

    @property
    def lead(self) -> tuple[int, ...]:
        return (self.seq[0] * self.seq[1],) if self.folded else self.seq


def judge(
    func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, held: Held,
    out: Any, holds: Callable[[Tensor], bool],
) -> tuple[str | None, Held | None]:
    """Why ``func``, given ``x`` (``held``) among its arguments, does not compute position by
    position (None if it does), and what its tensor outputs hold (None: no positions)."""
    name = getattr(func, "__name__", "")
    k = len(held.lead)  # the leading dims that must stay whole and in place
    if name == "__get__":  # a property: x.shape, x.dtype, x.mT, x.data
        name = str(getattr(getattr(func, "__self__", None), "__name__", name))
        if name in ("mT", "mH"):
            return (None if x.dim() >= k + 2 else f"x.{name} swaps the sequence dim"), held
        if name in ("data", "real", "imag"):
            return None, held
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if name in VALUES:
        return f"{name}() reads its values into Python", held
    if name == "__setitem__":  # x[index] = value, in place: only into a slice, at whole positions
        if args[0] is x and _keeps_positions(args[1], x.dim(), k):
            return None, held
        return f"x[{args[1]!r}] = ... writes across positions", held
    leaves = optree.tree_leaves(out, none_is_leaf=True)
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    if not tensors:
        if all(isinstance(v, METADATA) for v in leaves):
            return None, held  # metadata: shapes, dtypes, devices
        return f"{name} returns {type(out).__name__}", held
    first = args[0] if args else None
    why: str | None = None
    if base in ELEMENTWISE:
        if any(t.dim() != x.dim() for t in tensors):
            why = f"{name} broadcasts it to more dims"
    elif base in RESHAPES:
        shape = tuple(tensors[0].shape)
        if first is not x:
            why = f"{name} reshapes another tensor to its shape"
        elif shape[:2] == held.seq:
            held = Held(held.seq)
        elif shape[:1] == (held.seq[0] * held.seq[1],):
            # dims 0 and 1 folded, in row-major order (rows gathered from every rank stay so)
            held = Held(held.seq, folded=True, gathered_from=held.gathered_from)
        else:
            why = f"{name} to {list(shape)} moves the batch or sequence dim"
    elif name.startswith("new_"):
        return None, None  # a new tensor of its dtype and device: none of its values
    elif base in ALONG:
        dims = _dims(base, args, kwargs)
        ndim = x.dim() + (1 if base == "stack" else 0)
        if dims is None:
            why = f"{name} acts on every dim, the sequence's too"
        elif any(d % ndim < k for d in dims):
            why = f"{name} acts along dim {min(d % ndim for d in dims)}"
    elif base in INDEXED_ALONG:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        indexed = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
        if not isinstance(dim, int) or isinstance(dim, bool) or dim % x.dim() < k:
            why = f"{name} acts along dim {dim}"
        elif any(t.dim() != x.dim() or tuple(t.shape[:k]) != held.lead for t in indexed):
            why = f"{name} takes an index or values of other batch or sequence dims"
    elif base in ("layer_norm", "rms_norm", "pad"):
        arg = args[1] if len(args) > 1 else kwargs.get("normalized_shape", kwargs.get("pad"))
        spans = len(arg) // (2 if base == "pad" else 1) if isinstance(arg, Sequence) else 99
        if first is not x or spans > x.dim() - k:
            why = f"{name} spans the sequence"
    elif base in ("linear", "matmul", "mm", "__matmul__", "addmm"):
        # x @ w, w not a slice: contracts x's last dim (addmm(bias, x, w): bias + x @ w)
        at = 1 if base == "addmm" else 0
        operands = [*args, kwargs.get("weight"), kwargs.get("bias")]
        w = args[at + 1] if len(args) > at + 1 else kwargs.get("weight", kwargs.get("other"))
        fits = len(args) > at and args[at] is x
        fits = fits and isinstance(w, Tensor) and (base == "linear" or w.dim() <= 2)
        if not fits or any(isinstance(o, Tensor) and o is not x and holds(o) for o in operands):
            why = f"{name} contracts over the sequence"
    elif base == "__getitem__":
        if first is not x or not _keeps_positions(args[1], x.dim(), k):
            why = f"x[{args[1]!r}] indexes the batch or sequence dim"
    else:
        return f"{name} is not a position-wise op", held
    if why is None and any(tuple(t.shape[: len(held.lead)]) != held.lead for t in tensors):
        why = f"{name} moves the batch or sequence dim"
    return why, held


class _Slices(TorchFunctionMode):
    """Follows the tensors that hold this rank's slice of the sequence through one block."""

    def __init__(self, block: str, module: nn.Module, parts: int) -> None:
        super().__init__()
        self.block, self.parts, self.quiet = block, parts, 0
        self.held: dict[int, tuple[weakref.ref[Tensor], Held]] = {}
        self.names = {id(sub): _join(block, name) for name, sub in module.named_modules()}
        self.modules = {_join(block, name): sub for name, sub in module.named_modules()}

    def hold(self, tree: Any, held: Held) -> None:
        for t in optree.tree_leaves(tree):
            if isinstance(t, Tensor):
                self.held[id(t)] = (weakref.ref(t), held)

    def holds(self, t: Tensor) -> bool:
        return self.find(t) is not None

    def find(self, t: Tensor) -> Held | None:
        entry = self.held.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        given: Any = (tuple(args), kwargs)
        for x in optree.tree_leaves(given):
            held = self.find(x) if isinstance(x, Tensor) else None
            if held is not None:
                why, made = judge(func, args, kwargs, x, held, out, self.holds)
                if why is not None:
                    raise ValueError(self.refusal(why))
                if made is not None:
                    self.hold(out, made)
                break
        return out

    def refusal(self, why: str) -> str:
        where, module = self.block, None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # the innermost module of the block running the op
            for key in ("self", "module"):
                obj = frame.f_locals.get(key)
                if id(obj) in self.names and isinstance(obj, nn.Module):
                    where, module = self.names[id(obj)], obj
                    break
            if module is not None:
                break
            frame = frame.f_back
        what = f"{where!r} ({type(module).__name__})" if module is not None else repr(where)
        blocks = re.sub(r"\.\d+$", ".*", self.block)
        mixture = self._mixture_around(where)
        if mixture is not None:  # not a mixing of positions: the guard cannot follow a token dispatch
            return (
                f"tensor_parallel(sequence_parallel=...): {what} runs on this rank's 1/{self.parts} of the "
                f"sequence (sequence-parallel block {self.block!r}, outside any Region), and {why}: it is part of "
                f"the mixture of experts {mixture!r}, whose dispatch of the tokens to their experts (one_hot, sums "
                "over the tokens, index_add) this guard cannot follow position by position. Experts whose code is "
                "known to compute each token alone and drop none run on the slice as one op (transformers' fused "
                "experts, MixtralExperts' code, with a transformers experts_implementation: engine/model/"
                f"token_wise.py); {_experts_named(self.modules.get(mixture))}, and a Region cannot hold fused "
                f"experts: leave {blocks!r} out of sequence_parallel (the plan's other modules still split over "
                "the axis)"
            )
        head = (
            f"tensor_parallel(sequence_parallel=...): {what} runs on this rank's 1/{self.parts} of "
            f"the sequence (sequence-parallel block {self.block!r}, outside any Region), and "
            f"{why}: "
            "it does not compute position by position, so it would mix only this rank's positions "
            "and train silently wrong; "
        )
        if where == self.block:
            return head + (
                f"move the code that mixes positions into a module of {where!r} and give it a "
                f"Region, or leave {where!r} out of sequence_parallel"
            )
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", where)
        undivided = _undivided_head_count(module, self.parts)
        if undivided is not None:  # a Region would be refused too: each rank computes whole heads
            attr, value = undivided
            field = config_field(module, attr, value) if module is not None else ""
            copied = f" (the model's {field})" if field else ""
            rebuilt = ", or build the model with config.multi_query=False" if field.startswith(MULTI_QUERY) else ""
            return head + (
                f"a Region cannot give it the whole sequence here: its {attr} is {value}{copied}, which the "
                f"{self.parts} ranks of the axis do not divide (each rank of a Region computes whole heads). Leave "
                f"{blocks!r} out of sequence_parallel (the plan's other modules still split over the axis){rebuilt}"
            )
        return head + (
            f"give it a Region so that it sees the whole sequence, plan[{pattern!r}] = "
            f"sw.tp.Region({_heads_hint(module)}), with its projections Colwise() and Rowwise() (as "
            "in sw.tp.tiny_gpt_plan() or sw.tp.llama_plan()), or leave "
            f"{blocks!r} out of sequence_parallel"
        )


    def _mixture_around(self, where: str) -> str | None:
        """The path of the mixture-of-experts block (its fused experts: (experts, ., .) weights, as Hugging
        Face's MoE blocks hold them) that the module at ``where`` is or is inside, within the block."""
        parts = where.split(".")
        for end in range(1, len(parts) + 1):  # the outermost: the block that holds the experts
            path = ".".join(parts[:end])
            held = self.modules.get(path)
            if held is not None and _holds_fused_experts(held):
                return path
        return None


def _experts_named(block: nn.Module | None) -> str:
    """What the refusal says of a mixture's experts: their class and implementation, not known."""
    experts = getattr(block, "experts", block)
    if isinstance(experts, nn.Module) and computes_each_token_alone(experts):
        return (f"its experts ({type(experts).__name__}) are, but this op runs outside them (its routing), where "
                "each op is followed and this one is not known to keep the tokens apart")
    implementation = implementation_named(experts)
    how = f" (experts_implementation={implementation!r})" if implementation not in (None, "eager") else ""
    return f"its experts ({type(experts).__name__}{how}) are not"


def _holds_fused_experts(module: nn.Module) -> bool:
    experts = getattr(module, "experts", module)
    weights = [getattr(experts, w, None) for w in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, Tensor) and w.dim() == 3 for w in weights)


def _undivided_head_count(module: nn.Module | None, parts: int) -> tuple[str, int] | None:
    """The first head count the module holds (its own attribute, as a Region's ``heads=`` reads it) that ``parts``
    ranks do not divide: Falcon's multi-query attention holds ``num_kv_heads`` 1."""
    for attr, value in (vars(module) if module is not None else {}).items():
        if is_head_count(attr) and type(value) is int and value > 0 and value % parts:
            return attr, value
    return None


def _heads_hint(module: nn.Module | None) -> str:
    """``heads=(...)`` naming the module's head counts (as match.py reads them), if it has any."""
    own = vars(module) if module is not None else {}
    config = getattr(getattr(module, "config", None), "__dict__", {})
    found = [k for k in HEAD_COUNTS if type(own.get(k)) is int] or [
        f"config.{k}" for k in HEAD_COUNTS if type(config.get(k)) is int]
    local = ", local=('split_size',)" if type(own.get("split_size")) is int else ""
    return f"heads={tuple(found)!r}{local}" if found else ""


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


_current = threading.local()  # .slices: the block being followed on this thread, if any


@contextmanager
def following(block: str, module: nn.Module, hidden: Tensor, parts: int) -> Iterator[None]:
    """Follow ``hidden`` (this rank's slice of the sequence) through ``module``'s forward,
    refusing what is not position-wise (see the module docstring)."""
    outer = getattr(_current, "slices", None)
    slices = _Slices(block, module, parts)
    slices.hold(hidden, Held((hidden.shape[0], hidden.shape[1])))
    _current.slices = slices
    try:
        with slices:
            yield
    finally:
        _current.slices = outer


@contextmanager
def unfollowed() -> Iterator[None]:
    """shardwise's own work on the block's tensors (a collective, a read of the autograd graph): not
    one of the block's ops, so not followed."""
    slices: _Slices | None = getattr(_current, "slices", None)
    if slices is None:
        yield
        return
    slices.quiet += 1
    try:
        yield
    finally:
        slices.quiet -= 1


def collective(run: Callable[[], Tensor], x: Tensor, op: str | None, dim: int) -> Tensor:
    """``run()`` (a tensor-parallel collective's Function on ``x``), and what its output holds:
    a gather of the sequence makes it whole, a scatter of it a slice, anything else keeps what
    ``x`` was."""
    slices: _Slices | None = getattr(_current, "slices", None)
    if slices is None:
        return run()
    held = slices.find(x)
    if dim == 0 and op in ("all_gather", "psum_scatter"):
        return _collective_of_rows(slices, run, x, held, op)
    with unfollowed():
        out = run()
    moves_sequence = dim == 1 and op in ("all_gather", "psum_scatter", "slice")
    if moves_sequence and op != "all_gather":
        slices.hold(out, Held((out.shape[0], out.shape[1])))
    elif not moves_sequence and held is not None:
        slices.hold(out, held)
    return out


def _collective_of_rows(slices: _Slices, run: Callable[[], Tensor], x: Tensor, held: Held | None, op: str) -> Tensor:
    """A gather or scatter of tokens folded into rows (comm.py's ``sequence_dim``). The gather's input must be
    this rank's tokens as rows; its output holds every rank's rows, one rank's after another's: not the one
    device's order of the tokens (batch-major), so it is followed on as rows, each computed alone, until the
    scatter hands each rank its own rows back."""
    if held is None or not held.folded or (op == "psum_scatter") != (held.gathered_from is not None):
        what = ("holds no slice of the sequence" if held is None else
                "holds its slice as (batch, sequence, ...)" if not held.folded else
                "holds every rank's rows already" if op == "all_gather" else "holds only this rank's rows")
        raise ValueError(slices.refusal(f"a value of shape {list(x.shape)} that {what} is "
                                        f"{'gathered' if op == 'all_gather' else 'reduce-scattered'} along its rows"))
    with unfollowed():
        out = run()
    if op == "all_gather":
        slices.hold(out, Held((slices.parts * held.seq[0], held.seq[1]), folded=True, gathered_from=held.seq))
    else:
        assert held.gathered_from is not None
        slices.hold(out, Held(held.gathered_from, folded=True))
    return out


def per_token(run: Callable[[], Any], x: Any, where: str) -> Any:
    """``run()``, a module known to compute each token from its own row alone (HF fused experts:
    ``engine/model/token_wise.py``; expert_parallel's block forward, through its ``run_token_wise``)
    whose ops this guard cannot follow one by one (a dispatch of the tokens to their experts),
    unfollowed; its output holds what its input ``x`` holds."""
    slices: _Slices | None = getattr(_current, "slices", None)
    if slices is None:
        return run()
    with unfollowed():
        out = run()
    held = slices.find(x) if isinstance(x, Tensor) else None
    if held is None:
        return out
    # Its output, or a tuple of tensors (GPT-OSS's MLP returns its router's scores beside it): each one row
    # per token, as the input holds them or with batch and sequence folded into one dim ([tokens, experts]).
    parts = out if type(out) is tuple and out else (out,)
    if not isinstance(parts[0], Tensor) or tuple(parts[0].shape[: len(held.lead)]) != held.lead:
        first = parts[0]
        shape = list(first.shape) if isinstance(first, Tensor) else type(first).__name__
        raise ValueError(slices.refusal(f"{where} returns {shape} for tokens {list(held.lead)}"))
    slices.hold(parts[0], held)
    rows = held.seq[0] * held.seq[1]
    for i, part in enumerate(parts[1:], 1):
        if not isinstance(part, Tensor):
            raise ValueError(slices.refusal(f"{where} returns a {type(part).__name__} beside its output"))
        if tuple(part.shape[:2]) == held.seq:
            slices.hold(part, Held(held.seq))
        elif part.dim() >= 1 and part.shape[0] == rows:
            slices.hold(part, Held(held.seq, folded=True))
        else:
            raise ValueError(slices.refusal(
                f"{where} returns {list(part.shape)} (output {i}) for tokens {list(held.lead)}, not a row per token"))
    return out
