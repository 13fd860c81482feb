"""Why a tensor-parallel module failed, said by its likely cause (modules.py raises these).

torch's own error on a rank's slices names sizes, not the cause. A Region's module that fails on its
rank's heads most often computes with a whole count or width no Region divides, or holds a
parameter as wide as all heads together (a norm over every head's features), which no split fits.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch import Tensor, nn

from .match import CONV1D, Install
from .styles import Colwise, Region
from .whole_head_bias import argument_message, table_message, whole_head_argument, whole_head_table


def rowwise_width_message(
    label: str, width: int, whole: int, got: int, in_region: bool, after_colwise: bool = True
) -> str:
    """A Rowwise's input is not its slice of the features: ``got`` wide where it takes ``width`` of ``whole``;
    ``after_colwise``: whether a Colwise ran before it in its Region (none: the Region's own whole input)."""
    if got == whole and in_region and not after_colwise:
        return (
            f"tensor_parallel: Rowwise() on {label!r} takes its input split on the features ({width} of "
            f"{whole} on each rank), but got all {whole}: no Colwise ran before it in its Region, so it met the "
            "Region's own input, whole. A Rowwise takes back what a Colwise split: are the two styles swapped? Give "
            "the projections that make the heads (q_proj, k_proj, v_proj; an MLP's up and gate) Colwise(), and the "
            "one that takes them back (o_proj; down_proj) Rowwise()"
        )
    if got == whole and in_region:
        return (
            f"tensor_parallel: Rowwise() on {label!r} takes its input split on the features ({width} of "
            f"{whole} on each rank), but got all {whole}, though its Region split them: the module built "
            "a whole-width value from this rank's heads, most likely by a count or width it read whole "
            "(Phi-3's query_pos = config.num_attention_heads * head_dim reads the config, which every layer "
            "shares, so no Region divides it). Name a count the module holds in the Region's heads=(...) "
            "or local=(...); a module reading its config's counts cannot run on a rank's heads unchanged: "
            "leave its projections out of the plan"
        )
    return (
        f"tensor_parallel: Rowwise() on {label!r} takes its input split on the features ({width} of "
        f"{whole} on each rank), but got {got}: give the module before it "
        "Colwise() (its output stays split), inside the same Region"
    )


def region_failed(
    m: nn.Module, path: str, style: Region, err: BaseException, parts: int, per_head: frozenset[str] = frozenset(),
    fed: tuple[str, ...] = (), call: tuple[tuple[Any, ...], dict[str, Any], str | None] | None = None,
) -> str:
    """Why a Region's module likely failed: a replicated parameter spanning a Colwise's whole output, a
    per-head bias of every head (an argument or a table: whole_head_bias.py), or a whole count each rank
    divides. ``per_head``: its parameters PerHead splits (never the cause named); ``fed``: the Colwise modules
    whose outputs the failing op took, where the Region's first call watched it; ``call``: the failing call's
    arguments and the name of its hidden states."""
    sizes = {int(n) for n in re.findall(r"\d+", str(err))}
    spanning = _spanning_parameter(m, parts, sizes, per_head, fed)
    if spanning is not None and isinstance(m.get_submodule(spanning[0].rpartition(".")[0]), nn.Linear):
        name, shape, colwise, whole = spanning
        return (
            f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): its Linear "
            f"{name.rpartition('.')[0]!r} (weight {shape}), which no style splits, takes {whole} input features, "
            f"as wide as the whole output of {colwise} (every head's), of which each of the {parts} ranks holds "
            f"1/{parts}: a projection of every head's features together (Doge's dt_proj over the values) meets "
            "only this rank's heads; its head counts are not the cause. Leave this module's projections out of "
            "the plan (replicated)"
        )
    if spanning is not None:
        name, shape, colwise, whole = spanning
        rows = len(shape) >= 2 and shape[0] % parts == 0  # (heads, head_dim): one row per head
        per_row = (
            f"; if its rows are the heads' (Cohere's and Chameleon's (heads, head_dim) norm weights), split it with "
            f"the heads: sw.tp.PerHead() on '{path}.{name}' in the plan (PerHead(heads='<its count>') for a "
            "key/value norm of fewer heads)"
        ) if rows else ""
        return (
            f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): its parameter {name!r} of "
            f"shape {shape} spans the whole output of {colwise} ({whole} features, every head's), of which each "
            f"of the {parts} ranks holds 1/{parts}: a norm whose weight covers every head (OLMo2's q_norm over all "
            "heads' features together) meets only this rank's heads; its head counts are "
            "not the cause. Leave this module's projections out of the plan (replicated), or use a model whose "
            f"norms act on each head alike (Qwen3's q_norm over head_dim){per_row}"
        )
    table = whole_head_table(m, style, parts, sizes)  # before a per-head parameter: T5's table is one
    if table is not None:
        return table_message(path, err, parts, table)
    found = _per_head_parameter(m, style, parts, sizes, per_head)
    if found is not None:
        name, shape, count = found
        return (
            f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): its parameter {name!r} of "
            f"shape {shape} holds one value per head ({count} heads), and no style splits it, so each of the "
            f"{parts} ranks meets every head's values with its {count // parts} heads (GPT-OSS's attention sinks); "
            "its head counts are not the cause. If each head reads its own value, split it as the heads are: "
            f"give {path + '.' + name!r} sw.tp.PerHead() in the plan (by a pattern such as "
            "'model.layers.*.self_attn.sinks', as sw.tp.gpt_oss_plan() does); otherwise leave this module's "
            "projections out of the plan (replicated)"
        )
    argument = None if call is None else whole_head_argument(m, style, parts, sizes, *call)
    if argument is not None:
        return argument_message(path, err, parts, argument)
    counts = _head_counts(m, set(style.heads) | set(style.local))
    if not counts and (style.heads or style.local):
        named = ", ".join(map(repr, (*style.heads, *style.local)))
        return (
            f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): each of the {parts} ranks "
            f"holds 1/{parts} of its heads, and the Region divides the counts it names ({named}). If the module "
            "cuts at a width it holds and the Region does not name (a split size, the embedding width it splits "
            "q, k and v at), name that in local=(...) too. If it takes a width from a tensor's shape (B, T, C = "
            "x.size(): its input is whole on every rank, so C is the whole hidden size) and views by it, no "
            "Region can divide it (nanoGPT's CausalSelfAttention does): compute that width from the counts or "
            "with -1 (view(B, T, self.n_head, -1), y.view(B, T, -1)), or leave this module's projections out of "
            "the plan (replicated)"
        )
    has = f"; {type(m).__name__} has {counts}" if counts else ""
    return (
        f"tensor_parallel: Region {path!r} failed ({type(err).__name__}: {err}): each of the "
        f"{parts} ranks holds 1/{parts} of its heads, but the module computes with a count it was "
        f"not told to divide{has}; name its head counts in Region(heads=(...)) and the "
        "widths it cuts at in Region(local=(...)), e.g. Region(heads=('num_heads',), "
        "local=('split_size',)); a projection computing blocks side by side that the module cuts apart (q, k "
        "and v in one) takes Colwise(fused=<the number of blocks>) too"
    )


def _spanning_parameter(
    m: nn.Module, parts: int, sizes: set[int], per_head: frozenset[str], fed: tuple[str, ...] = ()
) -> tuple[str, tuple[int, ...], str, int] | None:
    """A parameter of the Region's module that no style splits, as wide as a Colwise's whole output
    (OLMo2's q_norm (heads * head_dim,), Cohere's (heads, head_dim)), with a dim whole and divided among
    the numbers torch's error names ("size of tensor a (32) must match ... (16)"): (name, shape, the
    Colwise, that width). Read while the rank's slices are bound (the Region's forward). The Colwise is the
    one of that width whose output the failing op took (``fed``: Doge's dt_proj takes v_proj's, as wide as
    k_proj's), or, unknown, every one of that width ("'k_proj' or 'v_proj'")."""
    wholes: dict[int, list[str]] = {}
    styled: set[str] = set()
    for sub, inner in m.named_modules():
        install = getattr(inner.__dict__.get("forward"), "install", None)  # a TPForward's
        if not isinstance(install, Install) or isinstance(install.style, Region):
            continue
        styled.add(sub)
        weight = getattr(inner, "weight", None)
        if isinstance(install.style, Colwise) and isinstance(weight, Tensor) and weight.dim() == 2:
            local = weight.shape[1] if install.kind == CONV1D else weight.shape[0]
            wholes.setdefault(local * parts, []).append(install.path)
    for name, t in m.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in styled or name in per_head:
            continue
        shape = tuple(t.shape)
        # A Linear's weight takes its input features whole (its last dim); a norm's spans its dims' product.
        linear = owner and name.endswith(".weight") and isinstance(m.get_submodule(owner), nn.Linear)
        widths = (shape[-1],) if linear else (math.prod(shape[k:]) for k in range(len(shape)))
        spans = [w for w in widths if w in wholes]
        if spans and any(d in sizes and d // parts in sizes and d % parts == 0 for d in shape):
            candidates = wholes[spans[0]]
            named = [c for c in candidates if c in fed] or candidates
            return name, shape, " or ".join(map(repr, named)), spans[0]
    return None


def _per_head_parameter(
    m: nn.Module, style: Region, parts: int, sizes: set[int], per_head: frozenset[str]
) -> tuple[str, tuple[int, ...], int] | None:
    """A parameter of the Region's module outside its split modules with a dim of one value per head
    (GPT-OSS's sinks, (num_heads,)), that many and 1/parts of it among the numbers torch's error names:
    (name, shape, the whole head count). A named count reads whole (a config's) or divided (the module's
    own, while the rank's heads run), so both are tried."""
    counts: set[int] = set()
    for dotted in style.heads:
        owner: Any = m
        for part in dotted.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, int) and not isinstance(owner, bool):  # a held count reads as a HeadCount, an int
            counts |= {int(owner), int(owner) * parts}
    styled = set()
    for sub, inner in m.named_modules():
        install = getattr(inner.__dict__.get("forward"), "install", None)  # a TPForward's; a Region splits none
        if isinstance(install, Install) and not isinstance(install.style, Region):
            styled.add(sub)
    for name, t in m.named_parameters():
        if name.rpartition(".")[0] in styled or name in per_head:
            continue
        for d in t.shape:
            if d in counts and d % parts == 0 and d in sizes and d // parts in sizes:
                return name, tuple(t.shape), d
    return None


def _head_counts(m: nn.Module, named: set[str]) -> dict[str, int]:
    """The module's int attributes that look like head counts or widths, not already named, by the names a
    Region takes: its config's as ``config.<name>`` (T5Attention holds ``n_heads``, its config ``num_heads``:
    named bare, the count would be refused as an attribute the module does not have)."""
    own = {k: v for k, v in vars(m).items() if k not in named}
    config = {f"config.{k}": v for k, v in getattr(getattr(m, "config", None), "__dict__", {}).items()
              if k not in own and k not in named and f"config.{k}" not in named}
    return {
        k: v for k, v in sorted({**config, **own}.items())
        if type(v) is int and ("heads" in k or k.rpartition(".")[2] in ("n_head", "split_size"))
    }


def colwise_subclass_failed(label: str, m: nn.Module, err: BaseException, parts: int, counts: dict[str, Any]) -> str:
    """A Colwise Linear subclass's own forward failed in torch on the rank's slice of its output features: it
    sized a view by something whole (its head count, its whole width)."""
    weight = getattr(m, "weight", None)
    rows = weight.shape[0] if isinstance(weight, Tensor) and weight.dim() else 0
    held = ", ".join(f"self.{a} = {v}" for a, v in counts.items())
    held = f" (it holds {held}, divided only by a Region naming it)" if held else ""
    return (
        f"tensor_parallel: Colwise() on {label!r}, a {type(m).__name__} whose forward overrides nn.Linear's, failed "
        f"in torch ({type(err).__name__}: {err}) on this rank's slice of its output features ({rows} of "
        f"{rows * parts}): its forward sizes something by the whole, most likely a view by a whole head count or "
        f"width{held}. Size it by the head width with the heads inferred (view(*x.shape[:-1], -1, head_dim); "
        "a fused q, k, v under Colwise(fused=3): view(*x.shape[:-1], 3, -1, head_dim)), or name its count in the "
        "heads=(...) of a Region on the module around it ('<its name there>.n_heads'), which divides it by the tp "
        "size while that module runs; or leave it out of the plan (replicated, with its Rowwise partner)"
    )
