"""Ops that mix the rank's positions outside the attentions context_parallel installed, found and refused.

context_parallel replaces the attentions it knows (``attention.py``: by their structure; a transformers
attention calling the ``AttentionInterface`` is pointed at its split function, ``hf_interface.py``; any other
module whose class name ends in ``Attention`` is refused by name). Everything else in a layer runs on the
rank's part of the sequence, which is right only where it computes each position from that position alone.
So the first time a layer runs for an input shape (the Plan's prediction on fake tensors, or the first step),
its ops are watched:

* :class:`FollowSequence` (``sequence_dims.py``, a TorchDispatchMode; the rules per aten op are in
  ``sequence_rules.py``) tags the sequence dim of the layer's inputs and follows it through every op. Each
  rank's first call is watched layer after layer: the chain's first layer tags ``dim`` of the batch's leaves
  (which the cut cuts there), and each layer hands the dims of its outputs that hold positions to the next
  (``hand_over``: by place in the output tree, so a seq-first model's [t, batch, d] is followed on dim 0); an
  input whose producer is not known (a pipeline stage's received input) gets ``dim`` of every leaf whose
  ``dim`` has the part's length (the hidden states, input and position ids, rotary tables). An op that
  reduces, scans, sorts, pads, rolls, flips, slices, concatenates, convolves, pools or contracts along a dim
  that holds positions (``x.mean(1)``, ``F.pad(x, (0, 0, 1, -1))``,
  ``q @ (k.mT @ v)``, ``F.avg_pool1d`` over time, an eager attention's softmax), or that no rule knows given a
  tagged tensor, is refused here, naming the innermost module, the op and the fix. Ops outside it pass: any
  op on other dims, (batch, sequence) folded into rows and back, lookups by ids that hold positions, a
  router's tokens taken and put back by their positions, experts known to compute each token alone
  (``token_wise.py``), and a mean over every element that reaches the loss linearly (an auxiliary term: each
  rank averages its own part; refused under ``train_step(tokens=...)``, which weighs the ranks' losses by
  their counts). An op that computes with the values of a router's token index (``nonzero``'s positions)
  other than taking or putting rows by it is refused, and so is reading a tagged tensor's values out of
  torch (``tolist``, ``numpy``, ``item``: what is made of them again would be untagged).
* :class:`Unsplit` (a TorchFunctionMode) refuses ``scaled_dot_product_attention`` on tensors that hold
  positions, and any op on the batch's ``attention_mask``, which carries the whole sequence's mask to the
  attentions, outside transformers' mask making, the attentions and shardwise.
* Numbers read from a shape along a dim that holds positions (``h.shape[1]``, ``x.size(1)``, ``numel``: the
  part's length, not the sequence's) are marked (``part_length.py``, ``shape_reads.py``): used as a size (a
  view, a new tensor, a slice over the whole dim) they pass; as a value (``aux * t``, ``x / x.size(1)``,
  ``torch.full(.., t)``, ``torch.linspace(0, 1, t)``, ``math.sqrt(t)``, ``np.sqrt(t)``) they are refused.
  ``len(x)`` of a tensor whose dim 0 holds positions is refused (CPython returns it as a plain int), and so
  is ``int()`` of a marked number (``int(t)``, ``int(t * 0.5)``, ``np.asarray(t)``, ``np.prod([t, 2])``) or
  ``float()`` of one (``float(1 / t)``, ``np.float64(t)``) in the model's code or numpy's: what CPython makes
  of them cannot be marked, and a size needs no ``int()``. A new tensor sized by the part's length
  (``torch.ones(b, t)``, ``x.new_ones(x.shape)``), or by rows folded with it by a product with plain ints
  (``torch.ones(b * t)``: (batch, sequence), in the order written), holds positions along those dims:
  tagged, so
  ``torch.ones(t).cumsum(0)``, ``torch.ones(b * t).cumsum(0)`` or ``torch.tril(torch.ones(t, t))`` is
  refused (Mixtral's ``zeros(b * t, d)``, its experts' token rows put back by ``index_add_``, passes). A
  comparison of one in the model's code that one device, comparing the whole sequence's number, would answer
  otherwise (``if t > 1024``, ``t == 1``, ``min(t, window)``) is refused: the layer would take another branch.
  Positions counted from one (``torch.arange(t)``, ``buffer[:, :t]``, ``counted.py``) pass only through
  views, shardwise's rotary embeddings and mask making, and lookups in a position table context_parallel
  gave the layer with this rank's rows first, or in one constant along the looked-up dim.

Not watched: the installed attentions (their output holds their queries' positions), transformers' mask
making (whose mask context_parallel replaces), and shardwise's own checks (of the ids a split embedding reads,
of the positions a rotary embedding gets). What it cannot see: code that bypasses ``__torch_function__`` and
the dispatcher's Python modes (a C++ extension calling ATen directly); a number read from the part's length
that leaves Python's arithmetic for a plain one through neither ``int()`` nor ``float()`` (``range(t)``,
``str(t)``, ``math.sqrt(1 / t)``: math reads a float argument's value in C; numpy reading it inside a list or
as a size: ``np.arange(t)``), ``x.shape.numel()`` (``torch.Size`` multiplies its ints in
C and can be neither subclassed nor patched), a new tensor sized by another number computed from the length
(``torch.ones(t + 1)``, ``torch.ones(t // 2)``: its dim is not tagged), or control flow on such a plain number
(``len(range(t)) > 1024``);
positions counted from it in the Plan's prediction (fake tensors: judged at the first step) or handed to the
next layer (``position_ids`` made in the embedding's layer: each layer's marks start afresh); a value that
leaves a layer after mixing (a 0-d mean
passed to the next layer rather than to the loss: the marks beside the dims are not handed over); and a layer
that computes otherwise on a later call with the same input shapes (each is watched once per shape on each
rank's thread). Its cost: the first call of each layer per input shape, about 10 ms for a small Llama decoder
layer's 70-odd ops on a CPU thread (following the numbers read from shapes adds about 0.5 ms of it; on a later
machine, one thread, the fastest of 60 watched calls of a hidden-64 layer on [2, 16] tokens: 2.2 ms, unchanged by
seeing ``int()``, folded rows and comparisons).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import optree
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...engine.stack import in_layer
from .counted import KEEPS, Counted, constant_along, counts_the_part, keeps_values
from .host_calls import calls_watched
from .masks import is_carried
from .part_length import numbers_in, watching
from .sequence_dims import FollowSequence, current, following, handed
from .shape_reads import FIRST_ROWS, is_shape_read, judge_numbers, read_shape, sized_dims

_ATTENTION = frozenset({"scaled_dot_product_attention"})
# Tensor methods that hand a tensor's values to Python or numpy, where the positions they hold are lost from sight.
_READ_OUT = frozenset({"tolist", "numpy", "__array__", "item"})
_state = threading.local()  # .installed: how deep this thread is in an installed attention


@contextmanager
def installed_attention() -> Iterator[None]:
    """Inside the attention context_parallel installed (ring or Ulysses over the whole sequence), or shardwise's
    own exchange of a per-token batch tensor (``whole_sequence``): not watched."""
    _state.installed = getattr(_state, "installed", 0) + 1
    try:
        yield
    finally:
        _state.installed -= 1


def attention_over_the_sequence(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn(q, k, v, ...)``, an attention over the whole sequence, run as :func:`installed_attention`: its ops
    are not watched, and its output holds the positions its queries hold."""

    @functools.wraps(fn)
    def attention(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        follower = current()
        if follower is not None and not _quiet():
            _refuse_positions_elsewhere(follower, q)
        with installed_attention():
            out = fn(q, *args, **kwargs)
        if follower is not None:
            follower.like(out, q)
        return out

    return attention


def _refuse_positions_elsewhere(follower: FollowSequence, q: torch.Tensor) -> None:
    """Refuse queries ([batch, heads, seq, head_dim]) whose part's positions are on another dim than their sequence:
    the dim context_parallel cut was not the sequence there (a time-major batch, (seq, batch, ...), whose rows
    it cut, transposed to (batch, seq) by the model), and the attention would take other rows for the other
    ranks' positions."""
    dims = sorted(d for d in follower.tags_of(q) if d >= 0)
    seq = q.dim() - 2
    if dims and seq not in dims:
        follower.refuse(
            f"attends along dim {seq} of its queries {list(q.shape)}, but the part's positions are on dim {dims[0]}: "
            "the dim context_parallel cut (its dim=) holds something else than the sequence here (the rows of a "
            "time-major batch, (seq, batch, ...), moved there by the model?), so each rank's attention would take "
            "other rows for the other ranks' positions", _POSITIONS_ELSEWHERE)


@contextmanager
def watched(layer: str, axis: str, dim: int, x: Any, reads_batch: bool = False) -> Iterator[FollowSequence]:
    """The layer's first call on ``x`` watched (see the module docstring): :class:`Unsplit` for the calls
    known by name, :class:`FollowSequence` for the dims that hold the part's positions: those of the previous
    layer's output, handed over on this thread (``hand_over``); where none was (the chain's first layer, which
    reads the batch; a pipeline stage's received input), ``dim`` of the inputs whose ``dim`` is the part's length."""
    given = None if reads_batch else handed(x)
    # The part's length: a handed-over sequence dim's; else the first input's ``dim`` (a latent array of
    # another length beside the hidden states would otherwise set it, and be taken for the sequence)
    local = next((hi for tags in given or () for lo, hi in tags.values() if lo == 1), None)
    leaves = [t for t in optree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.dim() > dim]
    if local is None and leaves:
        local = int(leaves[0].shape[dim])
    unsplit = Unsplit(layer, axis)
    follower = FollowSequence(unsplit.refuse_op, _quiet, _exempt)
    follower.follow_inputs(x, dim, local, given)
    before, outer = watching(unsplit.refuse_number), getattr(_state, "counted", None)
    _state.counted = unsplit.counted
    try:
        with unsplit, following(follower), calls_watched():
            yield follower
    finally:
        watching(before)
        _state.counted = outer


def at_positions(table: torch.Tensor) -> torch.Tensor:
    """``table``, a position table context_parallel gave the watched layer with this rank's rows first: its
    first ``t`` rows (``table[:, :t]``, a lookup of ``arange(t)``) are this rank's (see ``counted.py``)."""
    counted: Counted | None = getattr(_state, "counted", None)
    if counted is not None:
        counted.table(table)
    return table


class Unsplit(TorchFunctionMode):
    """Refuses attention over the rank's part of the sequence outside the installed attentions, and ops on the
    carried attention mask; names what :class:`FollowSequence` refuses."""

    def __init__(self, layer: str, axis: str) -> None:
        super().__init__()
        self.layer, self.axis = layer, axis
        self.counted = Counted()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(_state, "installed", 0):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        follower = current()
        if follower is not None and is_shape_read(func, name):
            if name == "__len__" and 0 in follower.tags_of(args[0]) and not _quiet() and not _exempt():
                # (CPython makes what __len__ returns a plain int: the length would leave unmarked)
                self._refuse(f"reads len() of a {list(args[0].shape)} tensor whose dim 0 holds the part's positions: "
                             "it counts this rank's part of the sequence (not the whole sequence), and len() "
                             "returns a plain int that cannot be followed", _LEN_FIX, ". ")
            return read_shape(func, name, args, kwargs, follower.tags_of, self.parts)
        if name in _ATTENTION and (follower is None or any(
                follower.tags_of(t) for t in (*args[:3], *kwargs.values()))):
            self._refuse(f"calls {name} on tensors that hold the part's positions", _ATTENTION_FIX)
        if name in _READ_OUT and follower is not None and args and follower.tags_of(args[0]) and not _exempt():
            follower.refuse(f"reads the values of a {list(args[0].shape)} tensor that holds the part's positions "
                            f"out of torch (Tensor.{name}): what is computed from them, and the tensor made of them, "
                            "cannot be followed", name)
        if follower is not None and _one_hot_of_known_classes(name, args, kwargs, follower.tags_of):
            # Its range check (an aminmax over the part) only fails as one device's would: each position's row is
            # its own index's. With num_classes=-1 the classes are the part's largest index + 1: followed inside.
            out = follower.token_wise(lambda: func(*args, **kwargs), args[0], "one_hot")
        else:
            out = func(*args, **kwargs)
        # (after the call: what the dispatch-level watch refuses in it is named as the op it is)
        self._numbers(func, name, args, kwargs, out, follower.tags_of if follower else _untagged)
        sized = sized_dims(name, args, kwargs) if follower is not None and isinstance(out, torch.Tensor) else {}
        if name == "expand_as" and follower is not None and len(args) > 1:  # (grown to the shape of one holding them)
            sized = {d: r for d, r in follower.tags_of(args[1]).items() if d >= 0}
        if sized and follower is not None and not _quiet() and not _exempt():
            follower.tag(out, {**follower.tags_of(out), **sized})
        self._counted(func, name, args, kwargs, out)
        if isinstance(out, torch.Tensor) and any(is_carried(a) for a in (*args, *kwargs.values())) and not (
                _making_a_mask() or _caller().startswith("shardwise.")):  # (shardwise reading its own mask)
            self._refuse(f"computes {name} of the batch's attention_mask, which under context_parallel carries the "
                         "whole sequence's mask to the attentions (a [batch, 1, 2, seq] tensor, not the batch's "
                         "[batch, seq]), while the layer holds this rank's part of the tokens", _MASK_FIX)
        return out

    @functools.cached_property
    def parts(self) -> int | None:
        """How many parts the sequence is cut into (a shape read's ``whole`` is that many times its size); None
        outside a step (a mesh to ask)."""
        try:
            return in_layer.size(self.axis)
        except RuntimeError:
            return None

    def refuse_op(self, what: str, op: str) -> None:
        """What :class:`FollowSequence` found ``op`` (an aten op's name) to do, refused with the fix for it."""
        if op == _POSITIONS_ELSEWHERE:
            self._refuse(what, _BATCH_LAYOUT_FIX, ": another model without an error. ")
            return
        fix = _SCAN_FIX if op in _SCANS else _ATTENTION_FIX if op in _ATTENTION_LIKE else _MIXING_FIX
        self._refuse(what, fix)

    def _numbers(self, func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
                 tags_of: Callable[[Any], dict[int, tuple[int, int]]]) -> None:
        """A part's length among the arguments: passed as a size, followed as a count of positions, else refused."""
        for number, where in numbers_in(args, kwargs):
            if name == "arange":
                origin = counts_the_part(args, kwargs)
                if origin is not None:
                    self.counted.mark(out, f"torch.arange({origin})")
                    return
            why = judge_numbers(func, name, args, kwargs, where, tags_of)
            if why is not None and why.startswith(FIRST_ROWS):
                d = int(why.split()[-1])
                if (self.counted.is_table(args[0]) and d == args[0].dim() - 2) or constant_along(args[0], d):
                    continue
                self.counted.mark(out, f"the first rows of a {list(args[0].shape)} tensor up to {number.origin}")
                return
            if why is not None:
                self.refuse_number(number.origin, why)

    def _counted(self, func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Positions counted from the part's length among the arguments: kept by a view, looked up where the
        count is right, or refused (``counted.py``). Not while predicting: fake tensors hold no values to tell
        a table of zeros by (the first step's watch judges them)."""
        origin = self.counted.found(args, kwargs)
        if origin is None or _quiet() or in_layer.predicting_now() or _exempt():
            return
        # (a view of the counted tensor itself, not an index of it into another)
        kept = name in KEEPS and self.counted.origin(args[0]) is not None and not self.counted.found(args[1:], kwargs)
        if kept or keeps_values(name, args, kwargs):
            self.counted.mark(out, origin)
        elif not self.counted.right_lookup(name, args, kwargs):
            self._refuse(f"computes {name} with positions counted 0 .. t - 1 from the length of this rank's part "
                         f"({origin}), which every rank counts from 0: they are not the positions it holds",
                         _LENGTH_FIX, _AS_A_NUMBER)

    def refuse_number(self, origin: str, what: str) -> None:
        """A number read from the part's length (``origin``) used as a value (``part_length.py``), refused."""
        if not _quiet() and not _exempt():
            self._refuse(f"reads {origin}, which counts this rank's part of the sequence (not the whole sequence), "
                         f"and {what}", _LENGTH_FIX, _AS_A_NUMBER)

    def _refuse(self, what: str, fix: str, wrong: str = "") -> None:
        module = _innermost_module(sys._getframe(2))
        where = f"{type(module).__name__} in layer {self.layer!r}" if module is not None else f"layer {self.layer!r}"
        wrong = wrong or (" outside the attentions it splits, on this rank's part of the sequence only: it would mix "
                          "the part's positions alone and train another model without an error. ")
        raise ValueError(f"context_parallel(axis={self.axis!r}): {where} {what}{wrong}{fix}")


def _one_hot_of_known_classes(name: str, args: Sequence[Any], kwargs: dict[str, Any],
                              tags_of: Callable[[Any], dict[int, tuple[int, int]]]) -> bool:
    """``F.one_hot(x, num_classes)`` with the count given, of ``x`` whose dims (not values) hold positions: each
    position's row made from its own index (DBRX's router picks its experts so)."""
    if name != "one_hot" or not args or not isinstance(args[0], torch.Tensor):
        return False
    classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
    tags = tags_of(args[0])
    return isinstance(classes, int) and classes >= 0 and bool(tags) and all(d >= 0 for d in tags)


def _untagged(t: Any) -> dict[int, tuple[int, int]]:
    return {}


def _quiet() -> bool:
    return bool(getattr(_state, "installed", 0))


def _exempt() -> bool:
    """An op :class:`FollowSequence` would refuse that transformers' mask making or shardwise's own code issued
    (a check of the ids a split embedding reads, of the positions a rotary embedding is given), not the
    model's (shardwise's example models are a model's)."""
    caller = _caller()
    return caller.startswith("transformers.masking_utils") or (
        caller.startswith("shardwise.") and not caller.startswith("shardwise.testing"))


_POSITIONS_ELSEWHERE = "attention over another dim than the part's positions"  # (no aten op: refuse_op's key)
_BATCH_LAYOUT_FIX = (
    "Give the batch its rows on dim 0 and its sequence on context_parallel's dim (batch-first, not time-major), "
    "or leave context_parallel out"
)
_ATTENTION_FIX = (
    "context_parallel splits TinyGPT's CausalSelfAttention, Hugging Face's Llama-shaped attentions on sdpa, GPT-2's, "
    "and transformers attentions that call the AttentionInterface (inside its attention function only); rewrite an "
    "attention to call ring_attention / ulysses_attention, or leave context_parallel out"
)
_MASK_FIX = (
    "Only transformers' mask making and the attentions may read it: leave context_parallel out for this model "
    "(ESM's embeddings multiply by the mask)"
)
_MIXING_FIX = (
    "context_parallel exchanges positions only inside the attentions it splits; an op that mixes or moves them "
    "elsewhere (pooling over the tokens, a token shift, attention without softmax, a product, convolution or scan "
    "over time) sees this rank's part alone. Compute it inside an attention module that calls ring_attention / "
    "ulysses_attention over the whole sequence, or leave context_parallel out for this model"
)
# A running sum or product over the sequence counts only the rank's part (each part would restart it).
_SCANS = frozenset({"cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin", "logcumsumexp", "_logcumsumexp"})
# Attention's own ops (a softmax of scores, a causal mask made of the part's length, ``torch.ones(t, t).tril()``,
# an attention kernel, a convolution over time): the attention fix.
_ATTENTION_LIKE = frozenset({
    "_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax", "convolution", "_convolution",
    "tril", "triu", "tril_", "triu_",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})
_AS_A_NUMBER = ": under context_parallel it would train another model without an error. "
_LENGTH_FIX = (
    "A length read to size or reshape a tensor is right on the part; as a number it is the part's. Pass the whole "
    "sequence's length in (from the batch, or computed outside the layer), or leave context_parallel out"
)
_LEN_FIX = (
    "Read it as x.size(0) (followed: right as a size, refused as a value), or pass the whole sequence's length in "
    "(from the batch, or computed outside the layer), or leave context_parallel out"
)
_SCAN_FIX = (
    "Give the batch the position ids the model would compute (a dict batch with 'position_ids', made on the whole "
    "sequence before the step), if the model then skips its own count, or leave context_parallel out"
)


_WATCHES = frozenset({__name__, "shardwise.transforms.context_parallel.sequence_dims",
                      "shardwise.transforms.context_parallel.part_length",
                      "shardwise.transforms.context_parallel.host_calls", "shardwise.engine.stack.host_calls",
                      "shardwise.transforms.context_parallel.shape_reads",
                      "shardwise.transforms.context_parallel.sequence_rules",
                      "shardwise.transforms.context_parallel.sequence_moves",
                      "shardwise.transforms.context_parallel.sequence_tags"})
_MODE_CALLS = frozenset({"__torch_function__", "__torch_dispatch__"})


def _caller() -> str:
    """The module of the code that issued the op: past torch's own frames and the modes' dispatch (another
    transform's watch may run between)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name.split(".")[0] != "torch" and name not in _WATCHES and frame.f_code.co_name not in _MODE_CALLS:
            return name
        frame = frame.f_back
    return ""


def _making_a_mask() -> bool:
    """Whether the op is transformers' mask making (``masking_utils``: packed sequences found by a cumsum over
    the position ids): context_parallel puts the mask of the whole sequence in the place of the mask the layer
    makes from its part, so what that computes there is never read."""
    return _caller().startswith("transformers.masking_utils")


def _innermost_module(frame: FrameType | None) -> nn.Module | None:
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module):
            return obj
        frame = frame.f_back
    return None
