"""A per-head bias made for every head, met by a Region's per-head views of 1/tp of them: said by its cause.

ALiBi models (Bloom, MPT, Falcon with alibi=True) build one bias of all H heads in the model around the
layers (Bloom's ``alibi`` of shape (b * H, 1, t), MPT's ``position_bias`` (H, 1, t), Falcon's folded into the
``attention_mask`` (b, H, q, k)) and hand it to every attention as an argument; T5's first block computes its
``position_bias`` (1, H, q, k) from a table ``relative_attention_bias = Embedding(num_buckets, H)`` (one column
per head) and passes it on to the later blocks as an argument. Inside a Region each rank's q, k and v hold
H/tp heads, so adding that bias fails in torch with sizes only, which read like a head count the Region
was not told to divide. Naming the argument (or the table), its shape and where it comes from says
what is wrong: the bias is whole where the heads are split, and no count in the Region can fix that.

Such an argument is cut to the rank's heads by an entry in the Region, ``arguments={"alibi":
sw.tp.HeadsAlong(dim=0, folded_batch=True)}`` (head_arguments.py): the refusal names that entry first, for the
argument it found (its name, the dim, whether the batch is folded in), for a plan without it.

T5's table can be split instead: its output columns are the heads, so ``Colwise(output="sharded")`` on it
cuts them into the tp blocks the q, k and v Colwise cut, each rank's first block computes the position_bias
of its own heads and passes that on to its later blocks, whose Regions hold the same heads: equal to one
device (tests/transforms/tensor_parallel/test_whole_head_bias.py). The refusal names that fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from .match import EMBEDDING, Install
from .styles import Colwise, Region, gathers

_FIX = (
    "build it inside the Region from a per-head table marked sw.tp.PerHead() in the plan (ALiBi's slopes as "
    "a (num_heads,) buffer or parameter of the attention, which each rank then holds for its own heads); where "
    "an earlier layer's attention computes it from a table of one column per head (T5's relative_attention_bias "
    "in block 0), give that table sw.tp.Colwise(output='sharded') and that attention a Region too, so the bias "
    "it passes on holds this rank's heads; or leave this attention replicated: no Region for it and no styles "
    "on its projections"
)


def whole_head_counts(m: nn.Module, style: Region, parts: int) -> set[int]:
    """The whole head counts the Region names, read while it runs: a count a module holds is divided
    then (modules._divided), one read through a config or a property is whole."""
    found: set[int] = set()
    for dotted in style.heads:
        *path, attr = dotted.split(".")
        owner: Any = m
        divided = True
        for part in path:
            owner = getattr(owner, part, None)
            divided = divided and isinstance(owner, nn.Module)
        if owner is None or isinstance(getattr(type(owner), attr, None), property):
            divided = False
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.add(int(value) * parts if divided else int(value))
    return found


def whole_head_argument(
    m: nn.Module, style: Region, parts: int, sizes: set[int], args: tuple[Any, ...], kwargs: dict[str, Any],
    hidden: str | None,
) -> tuple[str, tuple[int, ...], int, int, int, int] | None:
    """A tensor argument of the Region's call (not its hidden states, which it splits) with a dim of all
    H heads, or of the batch times H (Bloom's flattened (b * H, 1, t)), where torch's error names that
    size and its 1/parts: (its name, its shape, the dim, H, the batch it is flattened with, or 1, and the
    call's batch: at 1, b * H rows read as H). The
    last two dims are skipped (a bias of scores ends in its query and key lengths, which may equal H),
    and so is a dim 0 as long as the batch (a mask's (b, 1, q, k)): a bias (H, 1, t) with H equal to the batch
    is left to region_failed's other causes."""
    counts = {h for h in whole_head_counts(m, style, parts) if h % parts == 0}
    if not counts:
        return None
    named = _named_arguments(m, args, kwargs)
    batch = named.get(hidden or "") if hidden else None
    if not isinstance(batch, Tensor):
        batch = next((t for t in named.values() if isinstance(t, Tensor)), None)
    b = batch.shape[0] if isinstance(batch, Tensor) and batch.dim() else 1
    for name, t in named.items():
        if name == hidden or not isinstance(t, Tensor) or t.dim() < 3:
            continue
        shape = tuple(t.shape)
        for dim, d in enumerate(shape[:-2]):
            if dim == 0 and d == b:  # the batch, even where it equals a head count (GPT-OSS's 2 kv heads)
                continue
            for h in sorted(counts):
                for times in ((1, b) if dim == 0 and b > 1 else (1,)):
                    if d == h * times and d in sizes and d // parts in sizes:
                        return name, shape, dim, h, times, b
    return None


def argument_message(
    path: str, err: BaseException, parts: int, found: tuple[str, tuple[int, ...], int, int, int, int]
) -> str:
    """The refusal of a Region fed a bias of every head: the argument, its shape and where it comes from."""
    name, shape, dim, heads, times, batch = found
    held = f"{heads} heads" if times == 1 else f"the batch of {times} times {heads} heads (b * H rows, Bloom's)"
    return (
        f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): its argument {name!r} of shape "
        f"{shape} holds all {heads} heads (dim {dim}: {held}), a per-head bias built outside the Region (by the "
        "model around the layers: BloomModel's alibi, MptModel's position_bias, FalconModel's alibi folded into "
        "the attention_mask; or by an earlier layer that returned it: T5's block 0 computes position_bias and "
        f"passes it on), while each of the {parts} ranks' per-head views hold {heads // parts} heads. The "
        f"Region's head counts are not the cause, and no count in it can split that argument. Give the Region an "
        f"entry for it, sw.tp.Region(..., {_entry(name, dim, times)}){_batch_of_one(dim, times, batch)}: each "
        "call then hands the module this rank's heads of it, the blocks its Colwise projections cut "
        f"(sw.tp.bloom_plan(), mpt_plan() and falcon_plan() do so); or {_FIX}"
    )


def _entry(name: str, dim: int, times: int) -> str:
    """The Region's ``arguments=`` entry that cuts the argument ``name`` (its heads on ``dim``, folded with a
    batch of ``times`` where more than 1)."""
    folded = ", folded_batch=True" if times > 1 else ""
    return f"arguments={{{name!r}: sw.tp.HeadsAlong(dim={dim}{folded})}}"


def _batch_of_one(dim: int, times: int, batch: int) -> str:
    """At a batch of 1, b * H rows (Bloom's alibi) read as H: the entry without folded_batch then cuts this call
    alike, and a later batch is refused (review6): say which to choose."""
    if dim != 0 or times != 1 or batch != 1:
        return ""
    return (" (with folded_batch=True where that dim holds the batch and the heads flattened, b * H rows, "
            "batch-major, as Bloom's alibi: at this batch of 1 the two read alike)")


def whole_head_table(
    m: nn.Module, style: Region, parts: int, sizes: set[int]
) -> tuple[str, tuple[int, int], int] | None:
    """An Embedding inside the Region whose output has one column per head, all H (T5's
    relative_attention_bias, Embedding(num_buckets, H)), where torch's error names H and H/parts: (its path in
    the module, its weight's shape, H). Its lookup is the bias of every head, which the module adds to its
    rank's heads' scores. One under a Colwise that gathers its output (an Embedding's default) or a Rowwise
    (which sums it) is whole too."""
    counts = {h for h in whole_head_counts(m, style, parts) if h % parts == 0}
    for sub, inner in m.named_modules():
        install = getattr(inner.__dict__.get("forward"), "install", None)  # a TPForward's
        split = (
            isinstance(install, Install) and isinstance(install.style, Colwise)
            and not gathers(install.style, install.kind == EMBEDDING)
        )
        if not isinstance(inner, nn.Embedding) or split:  # its output holds this rank's columns
            continue
        d = inner.embedding_dim
        if d in counts and d in sizes and d // parts in sizes:
            return sub, (inner.num_embeddings, d), d
    return None


def table_message(path: str, err: BaseException, parts: int, found: tuple[str, tuple[int, int], int]) -> str:
    """The refusal of a Region holding a table of every head's position bias (T5's)."""
    name, shape, heads = found
    return (
        f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): its Embedding {name!r} (weight "
        f"{shape}) has one output column per head, all {heads}: its lookup is a position bias of every head (T5's "
        f"compute_bias makes position_bias of shape (1, {heads}, q, k) from it), added to this rank's "
        f"{heads // parts} heads' scores; T5 computes that position_bias in the first block's attention and "
        "passes it on to the later blocks as an argument, so they would meet all heads too. The Region's head "
        "counts are not the cause. Its columns are cut as the heads are by sw.tp.Colwise(output='sharded') (the "
        "output stays split, one column per head of this rank's): give it that in the plan, by a pattern such "
        "as '*.relative_attention_bias', and every rank's bias holds its own heads, in this layer and in those "
        "it passes it on to; or leave the attention of every layer that takes this bias replicated: no Region "
        "for it and no styles on its projections (the MLPs can stay split)"
    )


def _named_arguments(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by their names in the forward's signature; positional ones it cannot name as
    'argument <i>'."""
    try:
        bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
    named: dict[str, Any] = {}
    for key, value in list(bound.arguments.items())[1:]:
        if isinstance(value, dict) and bound.signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif isinstance(value, tuple) and bound.signature.parameters[key].kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{key}[{i}]": v for i, v in enumerate(value)})
        else:
            named[key] = value
    return named
