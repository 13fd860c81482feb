"""What a Step tells a grouped optimizer: each parameter's options, range by range of its tree.

The groups are resolved once per layout over *every* parameter of the model (all pipeline
stages, global shapes before any tensor-parallel cut), so each rank decides alike and a
pattern that matches only another stage's parameters is not refused on this rank. Then:

- whole tensors (one device, pipeline stages, tensor-parallel slices): one run per tensor,
  the options of its path;
- ZeRO flat shards: one run per parameter range the rank's shard holds (``UnitLayout``'s
  offsets cut by the shard's bounds), the padding joined to the run before it (padding is
  zero and stays zero under any options).
"""

from __future__ import annotations

from typing import Any

from ..checkpoint.names import state_dict_names
from ..layout.state_layout import StateLayout
from ..model.chain import Chain
from ..optim.groups import Options, ParamGroups, ParamInfo, Runs

Key = tuple[str, str]


def param_infos(chain: Chain, layout: StateLayout) -> dict[Key, ParamInfo]:
    """Every parameter's names (state_dict key first, then ``layer.local``), global shape, dtype."""
    names = state_dict_names(chain)
    keys = names.param_key
    aliases: dict[str, list[str]] = {}
    for alias, key in names.aliases.items():
        aliases.setdefault(key, []).append(alias)
    infos = {}
    for (layer, name), spec in layout.leaves.items():
        path = f"{layer}.{name}"
        key = keys.get((layer, name), path)
        infos[(layer, name)] = ParamInfo(
            (key,) if key == path else (key, path), spec.shape, spec.dtype, tuple(aliases.get(key, ()))
        )
    return infos


def param_options(groups: ParamGroups, chain: Chain, layout: StateLayout) -> dict[Key, Options]:
    """Each parameter's options (refusing a group that gets none), memoised on the layout."""
    cache_key = ("param groups", groups)
    if cache_key not in layout.cache:
        layout.cache[cache_key] = groups.resolve(param_infos(chain, layout))
    options: dict[Key, Options] = layout.cache[cache_key]
    return options


def master_runs(
    groups: ParamGroups, chain: Chain, layout: StateLayout, master: Any, dp_index: int
) -> Any:
    """A tree like ``master`` (what the optimizer updates) of each leaf's Runs."""
    options = param_options(groups, chain, layout)
    sharding = layout.sharding
    if sharding is None:
        return {
            layer: {
                name: Runs.whole(t.numel(), options[(layer, name)]) for name, t in tensors.items()
            }
            for layer, tensors in master.items()
        }
    out = {}
    for unit in master:
        lay = sharding.units[unit]
        lo, hi = dp_index * lay.shard_numel, (dp_index + 1) * lay.shard_numel
        runs, offset = [], 0
        for name, numel in zip(lay.names, lay.numels, strict=True):
            start, stop = max(offset, lo), min(offset + numel, hi)
            if start < stop:
                runs.append((start - lo, stop - lo, options[(unit, name)]))
            offset += numel
        padding_from = max(offset, lo) - lo
        if padding_from < hi - lo:
            last = runs[-1][2] if runs else groups.default
            runs.append((padding_from, hi - lo, last))
        out[unit] = Runs.merged(runs)
    return out


def check_clipping(
    groups: ParamGroups, chain: Chain, layout: StateLayout, clip_norm: float | None
) -> None:
    """Refuses clipping by a norm that would count frozen parameters (torch's would not)."""
    options = param_options(groups, chain, layout)
    frozen = [f"{layer}.{name}" for (layer, name), o in options.items() if o.frozen]
    if clip_norm is not None and frozen:
        raise ValueError(
            f"train_step(clip_norm={clip_norm}) with frozen parameters ({frozen[0]!r} and "
            f"{len(frozen) - 1} more): the step's gradient norm counts every parameter's gradient, "
            "frozen ones included, where torch's clip_grad_norm_ skips parameters without .grad; "
            "clip without the frozen group, or drop clip_norm"
        )
