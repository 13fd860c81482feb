"""A plain Colwise output viewed per head, followed along its heads dim (split_watch.py watches it).

``Colwise()`` gives each rank whole heads, 1/tp of them, and each is computed as on one device as
long as the module treats every head on its own. Two ways it does not, and trains another model
without an error, are refused here:

* a view by the whole head count (``q.view(b, t, self.n_heads, -1)``, einops' ``rearrange(q, "b n (h
  d) -> b h n d", h=self.heads)``) of a Colwise outside any Region: nothing divided the count, so a
  rank makes that many heads of 1/tp of the head width (a Region divides the counts it names in
  ``heads=``; ``view(..., -1, head_dim)``, as Hugging Face writes it, derives the count from the
  width and is right);
* a cut of the per-head view along its heads (``torch.chunk(v, 2, dim=1)``, ``split``,
  ``tensor_split``, ``narrow``, an index or a slice of the heads): DiffLlama pairs head h with head
  h + H/2 so, and on a rank's heads the halves pair other heads. A cut into single heads
  (``split(1, dim)``, ``unbind``) keeps each head whole and passes, as do transposes, the
  grouped-query repeat (``[:, :, None].expand(...)``) and cuts within a head (a partial rotary's
  ``q[..., :rot]``);
* a head picked by its number among all the heads (``q[:, 0] = 0``, ``q + q[:, :1]``, ``q[:, -1]``,
  ``q.select(1, 0)``): head 0 on a rank is another head than head 0 of all of them. One head taken alone
  is what a per-head loop's ``q[:, h]`` does too, so the watch counts the heads each per-head tensor gives
  one at a time (``SplitWatch.take_head``) and ``finish()`` refuses unless each of the rank's heads was
  taken equally often, as a loop over all of them takes them. Writes into one head are counted the same
  way, apart from the reads: ``q[:, h] = ...``, ``q[:, h:h + 1] = ...``, and an in-place op on a view of
  one head (``q.select(1, h).copy_(...)``, ``q.narrow(1, h, 1).mul_(...)``, ``q[:, h] *= 2``: the view is
  remembered, SplitWatch.take_head), so a loop writing each head in turn passes and
  ``q.select(1, 0).copy_(q[:, 1])`` (each head read once, head 0 written) is refused, as is a write of
  values read from another head of as many (head_sources.py). An index or a mask of the heads
  (``index_fill_``, ``index_copy_``, ``masked_fill_``, ``torch.where``, ...) is checked by head_indices.py;
  an index tensor of the heads (``q[:, torch.arange(q.size(1))]``, ``q[:, [h]]``) as one of its index
  ops. A write into several heads but not all (``q[:, :2] = 0``) is a cut, refused at once.
  (Undetectable: a loop over a fixed number of heads that happens to equal the rank's count, ``for h in
  range(2)`` with 4 heads at tp 2; a fixed head where a rank holds one; a value made from every head of the rank
  written into one,
  ``out[:, h] = q[:, h] + q[:, (h + 1) % H]`` at two heads a rank. The loop's head number used as a value,
  ``q[:, h] * (h + 1)``, is refused by head_loop_values.py; the head count and an arange over it used as
  values, by head_numbers.py.)

The heads dim is followed through transposes, permutes, index keeping the heads whole, unsqueeze, expand and
same-shaped ops (rotary products, casts), batched matrix products that keep it as a batch dim (the scores ``q @
k.transpose(-1, -2)``, ``einsum("bhtd,bhsd->bhts", q, k)``, ``probs @ v``: a loop over the scores' heads is then
judged as one over q's, and a mean over their heads is refused), and through a reshape of it into several dims onto
the one that carries the rank's split (Falcon's key/value groups: head_factors.py, which refuses a reshape that has
none). An op across it (``z - z.mean(1)``, a norm over heads and head_dim together) computes over a rank's heads
only, and is refused (split_watch.py, with feature_mixing.py's tables). A reshape that merges the heads back into
the rank's width (``y.transpose(1, 2).reshape(b, t, -1)``) is followed as the features again, up to the Rowwise: a
norm with no weight or a softmax over them there is refused as before the view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .head_factors import FACTORING, factored_heads
from .head_indices import NAMES as HEAD_INDEX_OPS
from .head_indices import HeadIndexRefused, index_heads, see_head_index
from .head_numbers import HeadRange
from .model_frames import innermost_model_line
from .read_refusals import head_number_message

if TYPE_CHECKING:
    from .split_watch import SplitWatch, _Output

# Cuts of a tensor along a dim, and where each takes its dim (positionally; default 0).
_CUT_DIM_AT = {
    "chunk": 2, "split": 2, "split_with_sizes": 2, "tensor_split": 2, "narrow": 1, "index_select": 1,
    "select": 1, "unbind": 1,
}
_SAME_DIMS = {"expand", "expand_as", "broadcast_to"}
# Reshapes that merge the heads back into the rank's width (before the Rowwise): followed as features again.
_MERGES = {"reshape", "view", "flatten"}


def check_head_count(entry: _Output, factors: list[int]) -> None:
    """Refuse a per-head view (``factors``: heads first) by a whole count of a Colwise outside any Region."""
    if entry.parts <= 1 or not entry.counts:
        return
    heads, parts = factors[0], entry.parts
    local = {count // parts for _, count in entry.counts.values() if count % parts == 0}
    for attr, (module, count) in entry.counts.items():
        if heads != count or heads in local:
            continue
        owes = (
            f"each rank must compute {count // parts} whole heads" if count % parts == 0
            else f"and {parts} ranks cannot each compute whole heads of {count}"
        )
        own = module == entry.label  # a Linear subclass's own count, its forward viewing its output by it
        fix = (
            f"Name it in the heads=(...) of a Region on the module around {module!r} ('<its name there>.{attr}'), "
            "which divides it by the tp size while that module runs" if own else
            f"Give {module!r} a Region naming the count, sw.tp.Region(heads=({attr!r},)) in the plan, which divides "
            "it by the tp size while the module runs"
        )
        raise ValueError(
            f"tensor_parallel: Colwise() on {entry.label!r}, "
            f"{'which views its output per head in its own forward' if own else 'outside any Region'}, gives each "
            f"rank 1/{parts} of its output features ({entry.width} here), and the module views them per head by its "
            f"whole head count ({module}.{attr} = {count}): {factors} on this rank, {count} heads of 1/{parts} of the "
            f"head width, where {owes}: another attention, trained without an error. {fix}; or view by the head "
            "width (view(..., -1, head_dim), as Hugging Face's attentions do)"
        )


def see_heads(
    watch: SplitWatch, func: Any, t: Tensor, entry: _Output, dim: int, args: Sequence[Any], kwargs: dict[str, Any],
    out: Any,
) -> None:
    """``func`` took ``t``, which holds a rank's heads of ``entry`` along ``dim``: refuse a cut across the
    heads, and follow the heads into ``out`` where it keeps them."""
    name = str(getattr(func, "__name__", func))
    first = args[0] if args else None
    if name in HEAD_INDEX_OPS and see_head_index(watch, name, t, entry, dim, args, kwargs, out):
        return  # an index_select of the heads whole, or of one head: followed or counted (head_indices.py)
    if name == "__setitem__" and first is t and len(args) >= 2:
        try:
            _, one = _index_heads(t, args[1], dim)
        except _Cut as cut:
            raise ValueError(head_cut_message(entry, f"a write into {cut}")) from None
        if one is not None:  # a write into one head, a loop's (q[:, h] = ...) or a fixed one's: finish() tells
            where = f"[{one[1]!r}] = ... at {innermost_model_line()}"
            watch.check_head_write(t, entry, dim, one[0], where, args[2:])
            watch.take_head(t, entry, dim, one[0], where, write=True)
        return
    if name in _CUT_DIM_AT:
        if first is not t:
            return
        at = _CUT_DIM_AT[name]
        cut_dim = kwargs.get("dim", args[at] if len(args) > at else 0)
        if not isinstance(cut_dim, int) or cut_dim % t.dim() == dim:
            if not _into_single_heads(name, t, dim, out):
                raise ValueError(_cut_refusal(entry, name, t, dim, out))
            start = kwargs.get("index", kwargs.get("start", args[2] if len(args) > 2 else None))
            if name in ("select", "narrow") and isinstance(start, int):  # one head, by its number
                where = f"{name}(..., {start}) at {innermost_model_line()}"
                watch.take_head(t, entry, dim, start % t.shape[dim], where, view=out)
            return
        dropped = name in ("unbind", "select")  # (the cut dim dropped: the heads move down past it)
        for part in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(part, Tensor) and part.dim() == t.dim():
                watch.follow_heads(part, entry, dim)
            elif isinstance(part, Tensor) and dropped and part.dim() == t.dim() - 1:
                watch.follow_heads(part, entry, dim - 1 if cut_dim % t.dim() < dim else dim)
        return
    if not isinstance(out, Tensor):
        return
    try:
        if name == "__getitem__" and first is t and len(args) >= 2:
            new, one = _index_heads(t, args[1], dim)
            if one is not None:  # a per-head loop's q[:, h], or a fixed head number: finish() tells them apart
                watch.take_head(t, entry, dim, one[0], f"[{one[1]!r}] at {innermost_model_line()}", view=out)
        else:
            new = _heads_after(name, t, dim, args, kwargs, out, entry.parts)
    except _Cut as cut:
        raise ValueError(head_cut_message(entry, str(cut))) from None
    if new is not None:
        watch.follow_heads(out, entry, new)
    elif name in _MERGES and t.dim() > out.dim() and out.dim() and out.shape[-1] == entry.width:
        watch.follow_merged(out, entry)  # the heads merged back, (b, t, heads x head_dim): features again


def _heads_after(
    name: str, t: Tensor, dim: int, args: Sequence[Any], kwargs: dict[str, Any], out: Tensor, parts: int
) -> int | None:
    """Where ``out`` holds the heads ``t`` holds along ``dim`` (split over ``parts`` ranks); None where it is no
    longer followed. Raises _Cut where a reshape groups them by their place among all of them."""
    n = t.dim()
    if args and args[0] is t:
        if name in FACTORING:  # the heads viewed into several dims: followed on the one that carries the split
            factored = factored_heads(name, t, dim, args, kwargs, out, parts)
            if isinstance(factored, str):
                raise _Cut(factored)
            if factored is not None:
                return factored
        if name in ("transpose", "swapaxes", "swapdims") and len(args) >= 3:
            a, b = args[1] % n, args[2] % n
            return b if dim == a else a if dim == b else dim
        if name == "permute":
            order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            return [d % n for d in order].index(dim) if len(order) == n else None
        if name == "unsqueeze" and len(args) >= 2:
            at = args[1] % (n + 1)
            return dim + 1 if at <= dim else dim
        if name in _SAME_DIMS and out.dim() == n and out.shape[dim] == t.shape[dim]:
            return dim
        if name in _MERGES:
            return _singletons_moved(t, dim, out)
    if name in _BATCHED_PRODUCTS:
        return _batch_dim_kept(t, dim, out)
    if name == "einsum":
        return _einsum_kept(t, dim, args, out)
    return dim if out.shape == t.shape else None


# Matrix products batched over the leading dims: the heads as a batch dim stay each on its own (attention's
# scores q @ k.transpose(-1, -2), and probs @ v, computed per head in one call).
_BATCHED_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm"}


def _batch_dim_kept(t: Tensor, dim: int, out: Tensor) -> int | None:
    """Where a batched matrix product keeps ``t``'s heads, a batch dim (aligned from the right, as broadcasting
    aligns them); None where the heads are a matrix dim (contracted, or rows of another shape)."""
    if t.dim() < 3 or dim >= t.dim() - 2 or out.dim() < t.dim():
        return None
    kept = dim + out.dim() - t.dim()
    return kept if out.shape[kept] == t.shape[dim] else None


def _einsum_kept(t: Tensor, dim: int, args: Sequence[Any], out: Tensor) -> int | None:
    """Where ``einsum`` keeps ``t``'s heads: the output's place of the heads' letter (``"bhtd,bhsd->bhts"``);
    None where the letter is summed over, or the equation has an ellipsis or no output given."""
    if not args or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return None
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    at = next((i for i, a in enumerate(operands) if a is t), None)
    inputs, output = args[0].replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if at is None or at >= len(subscripts) or len(subscripts[at]) != t.dim():
        return None
    letter = subscripts[at][dim]
    return output.index(letter) if letter in output and out.shape[output.index(letter)] == t.shape[dim] else None


def _singletons_moved(t: Tensor, dim: int, out: Tensor) -> int | None:
    """Where a reshape that only adds or drops dims of size 1 puts ``t``'s heads dim (GPT-OSS's
    ``sinks.reshape(1, -1, 1, 1)``); None for any other reshape, or heads of size 1 (a rank's one head:
    nothing to take across)."""
    if t.shape[dim] == 1:
        return None
    kept = [k for k, size in enumerate(t.shape) if size != 1]
    placed = [k for k, size in enumerate(out.shape) if size != 1]
    if [t.shape[k] for k in kept] != [out.shape[k] for k in placed]:
        return None
    return placed[kept.index(dim)]


def _into_single_heads(name: str, t: Tensor, dim: int, out: Any) -> bool:
    """A cut into parts of one head each, each head then computed on its own, as a per-head loop does
    (``unbind``, ``select``, ``split(1)`` or ``split([1, 1, ...])``, ``narrow`` of one head): what it
    computes is the same on a rank's heads as on all of them. ``chunk(n)`` and ``tensor_split(n)`` are not,
    even where their parts are single heads on a rank: a count of parts fixed by the module (DiffLlama's
    ``chunk(..., 2)``) gives single heads on a rank of two heads and pairs of heads on all of them. A part
    of several heads groups them by their place."""
    if name in ("unbind", "select"):
        return True
    if name in ("chunk", "tensor_split"):
        return False
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return all(isinstance(p, Tensor) and p.dim() == t.dim() and p.shape[dim] == 1 for p in parts)


def _index_heads(t: Tensor, index: Any, dim: int) -> tuple[int | None, tuple[int, Any] | None]:
    """Where ``t[index]`` holds ``t``'s heads (dim ``dim``, None where no longer followed), and the head it
    takes alone (its number on this rank, and the index as written), if one; raises _Cut where it takes
    some of them."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [list(i) if isinstance(i, (range, HeadRange)) else i for i in items]  # (torch indexes by a range's list)
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (t.dim() - consumed)
    items += [slice(None)] * (t.dim() - sum(1 for i in items if i is not None))
    advanced = sum(1 for i in items if isinstance(i, (Tensor, list)))
    in_dim = out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if in_dim == dim:
            heads = t.shape[dim]
            if isinstance(item, int):
                return None, (item % heads, item)  # one head, computed on its own: no longer followed
            if isinstance(item, slice) and len(range(*item.indices(heads))) == 1:
                return None, (range(*item.indices(heads))[0], item)
            if isinstance(item, (Tensor, list)):  # q[:, torch.arange(q.size(1))]: whole; q[:, [h]]: one head
                try:
                    taken = index_heads(item, heads)
                except HeadIndexRefused as refused:
                    raise _Cut(str(refused)) from None
                if taken != "whole":
                    return None, (int(taken), item)
                one_dim = isinstance(item, list) or item.dim() == 1
                return (out_dim if advanced == 1 and one_dim else None), None
            whole = isinstance(item, slice) and item.indices(heads) == (0, heads, 1)
            if not whole:
                raise _Cut(f"an index {item!r} of the heads dim")
            return (None if advanced else out_dim), None
        in_dim += 1
        out_dim += 0 if isinstance(item, int) else 1
    return None, None


def whole_along(t: Tensor, index: Any, dim: int) -> bool:
    """Whether ``t[index]`` takes all of ``t``'s dim ``dim`` (each in its place)."""
    try:
        return _index_heads(t, index, dim)[1] is None
    except _Cut:
        return False


def check_head_write(t: Tensor, index: Any, dim: int, owner: str) -> None:
    """Refuse ``t[index] = ...`` into some of the heads ``t`` holds along ``dim``, in the forward of a Colwise Linear
    subclass (``owner``) that viewed its product per head."""
    whose = (
        f"a Colwise Linear subclass ({owner}) views its product per head in its own forward, this rank's "
        f"{t.shape[dim]} heads (dim {dim}), 1/tp of all, and"
    )
    try:
        _, one = _index_heads(t, index, dim)
    except _Cut as cut:
        raise ValueError(head_number_message(whose, f"a write into {cut} ({innermost_model_line()})", t, dim)) from None
    if one is not None:
        raise ValueError(head_number_message(whose, f"a write into head {one[1]!r} ({innermost_model_line()})", t, dim))


class _Cut(ValueError):
    """An index that takes some of a rank's heads (turned into the refusal by see_heads' caller)."""


def _cut_refusal(entry: _Output, name: str, t: Tensor, dim: int, out: Any) -> str:
    parts = [p.shape[dim] for p in out if isinstance(p, Tensor)] if isinstance(out, (tuple, list)) else None
    into = f" into parts of {parts} heads" if parts else ""
    return head_cut_message(entry, f"{name} of its {t.shape[dim]} heads (dim {dim}){into}")


def head_cut_message(entry: _Output, what: str) -> str:
    module = entry.label.rsplit(".", 1)[0] if "." in entry.label else entry.label
    if entry.parameter:
        return (
            f"tensor_parallel: PerHead() on {entry.label!r} gives each rank its heads' values, 1/tp of them, and the "
            f"module {module!r} cuts them across the heads: {what}. It takes them by their place among all the "
            "heads, and on a rank's slice it takes other heads' values, another model trained without an error. "
            "PerHead() fits a parameter each head reads its own value of (GPT-OSS's sinks); leave this one out of "
            "the plan, and the attention's projections too (replicated)"
        )
    return (
        f"tensor_parallel: Colwise() on {entry.label!r} gives each rank whole heads, 1/tp of them, and the module "
        f"that takes its output ({module!r}) cuts its per-head view across the heads: {what}. A module that pairs or "
        "groups heads by their place among all of them (DiffLlama's torch.chunk(value_states, 2, dim=1): head h with "
        "head h + H/2) pairs other heads on a rank's slice, another model trained without an error. Tensor "
        "parallel needs each head computed on its own: leave this module's projections out of the plan (replicated), "
        "or pair the heads within each rank's group (a per-head loop: cut with unbind(), split(1) or q[:, h], "
        "which take one head whatever the count; chunk(n) takes n parts, which are heads of another size on a rank)"
    )
