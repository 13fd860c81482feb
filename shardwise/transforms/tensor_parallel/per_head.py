"""Parameters split by the heads they hold (``PerHead``): which the plan names, and why one cannot be.

A plan names a per-head parameter by its own path (``"model.layers.*.self_attn.sinks"``), not its module's:
GPT-OSS's sinks belong to the attention itself, whose other parameters are its projections'. Its dim 0
is cut as the Colwise projections cut their heads, tp equal contiguous blocks, so it must count the
heads a Region around it names: those are what the tp size is checked to divide, and what the rank's
query heads are blocks of. A parameter whose dim 0 counts something else (a ``(hidden,)`` gain read by
the attention) would be cut at places no head boundary is, and a rank would train other values than its
heads use: refused here, naming the parameter, its shape and the count. A buffer (or a frozen parameter)
of fixed per-head values, ALiBi's slopes, is named and checked alike; it is never split in the layout, but
cut to the rank's rows where its layer is called (layer_rewrite.VaryFn).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .styles import PerHead, Region, Style


def match_per_head(
    plan: Mapping[str, PerHead], params: Mapping[str, str], modules: Mapping[str, Any]
) -> dict[str, tuple[str, PerHead]]:
    """Parameter path -> (pattern, style) for the plan's PerHead patterns, matched on ``params`` (each
    parameter's or buffer's path -> its module's path); a pattern matching none is refused, naming why."""
    found: dict[str, tuple[str, PerHead]] = {}
    for pattern, style in plan.items():
        hits = [p for p in params if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            modules_hit = [m for m in modules if fnmatch.fnmatchcase(m, pattern)]
            if modules_hit:
                raise ValueError(
                    f"tensor_parallel: plan[{pattern!r}] = {style} matches the module {modules_hit[0]!r}, not a "
                    "parameter: PerHead() names the parameter that holds one value per head by its path, the "
                    f"module's path and the parameter's name ({modules_hit[0]!r} has "
                    f"{_own_parameters(modules[modules_hit[0]])})"
                )
            close = difflib.get_close_matches(pattern, list(params), n=4, cutoff=0.4)
            hint = f"; close parameter paths: {close}" if close else f"; parameter paths look like {list(params)[:6]}"
            raise ValueError(f"tensor_parallel: plan[{pattern!r}] = {style} matches no parameter of the model{hint}")
        for path in hits:
            if path in found and found[path][1] != style:
                raise ValueError(
                    f"tensor_parallel: parameter {path!r} matches plan[{found[path][0]!r}] = {found[path][1]} and "
                    f"plan[{pattern!r}] = {style}; make the patterns select it once"
                )
            found[path] = (pattern, style)
    return found


def per_head_count(
    pattern: str, style: PerHead, path: str, owner: str, tensor: Tensor, styled: Mapping[str, tuple[str, Style]],
    modules: Mapping[str, nn.Module],
) -> tuple[str, str, int]:
    """The Region around the per-head parameter ``path`` (of the module ``owner``) and the count its dim 0
    holds: (the Region's path, the count's attribute, its value). Refuses a parameter that is not one value
    per head of a Region's heads, or whose module the plan splits otherwise."""
    if owner in styled and not isinstance(styled[owner][1], Region):
        raise ValueError(
            f"tensor_parallel: plan[{pattern!r}] = {style} on {path!r}, a parameter of {owner!r}, which "
            f"plan[{styled[owner][0]!r}] = {styled[owner][1]} splits already; PerHead() is for a parameter no "
            "module style splits (GPT-OSS's sinks, the attention's own)"
        )
    regions = [
        r for r, (_, s) in styled.items()
        if isinstance(s, Region) and s.heads and (owner == r or owner.startswith(r + "."))
    ]
    if not regions:
        raise ValueError(
            f"tensor_parallel: plan[{pattern!r}] = {style} on {path!r}, but no Region with heads=(...) holds it: "
            "a per-head parameter is split as the heads of the attention around it are, and the Region names "
            "them; give that attention sw.tp.Region(heads=('config.num_attention_heads', ...)) with Colwise() "
            "on its q, k and v projections and Rowwise() on its output projection"
        )
    region = max(regions, key=len)  # the innermost
    around = styled[region][1]
    assert isinstance(around, Region)
    heads = around.heads
    attr = style.heads or heads[0]
    if attr not in heads:
        raise ValueError(
            f"tensor_parallel: plan[{pattern!r}] = {style} on {path!r}: the Region {region!r} names the heads "
            f"{heads}, not {attr!r}; name one of them (the counts the tp size is checked to divide)"
        )
    count = _read_count(modules[region], attr)
    shape = tuple(tensor.shape)
    if not shape or shape[0] != count:
        got = f"{shape[0]}" if shape else "no dim 0"
        raise ValueError(
            f"tensor_parallel: plan[{pattern!r}] = {style} on {path!r} of shape {shape}: its dim 0 ({got}) is not "
            f"one value per head, where {region}.{attr} counts {count} heads. PerHead() cuts dim 0 where the heads "
            "are cut, so a rank would train values its heads do not use (a vector over the features, "
            "(hidden,), is no per-head parameter). Leave it out of the plan; if the attention reads it on "
            "the rank's split values, leave the attention's projections out of the plan (replicated)"
        )
    return region, attr, count


def per_head_message(path: str, length: int, attr: str, parts: int, axis: str) -> str:
    """The tp size does not divide a per-head parameter's heads: said by the parameter."""
    return (
        f"tensor_parallel: parameter {path!r} holds one value per head ({attr} = {length}), split by "
        f"PerHead() as the heads are, and the {parts} ranks of axis {axis!r} do not divide its {length} values "
        f"(each rank computes whole heads and holds their values); use a tensor-parallel size that divides {length}"
    )


def _read_count(module: nn.Module, attr: str) -> int:
    value: Any = module
    for part in attr.split("."):
        value = getattr(value, part)
    return int(value)


def _own_parameters(module: Any) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)] if isinstance(module, nn.Module) else []
