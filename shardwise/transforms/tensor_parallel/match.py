"""Resolving a tensor-parallel plan on a chain: which module of which layer gets which style, how
each parameter is split, and which replicated parameters are used on per-rank values.

A layer built by ``functionalize`` calls a module (``fn.replicas.module``); its
modules' paths in the original model are ``fn.root_prefix`` + the replica's
prefix + their path inside it, and their parameters' local names in the layer
are the replica's prefix + their path + the parameter name. Hand-written layers
(plain functions) have no modules, so a plan cannot reach them.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...engine.model.chain import Chain, Layer
from ...engine.model.embedding_options import option_fix
from .count_fields import config_field
from .head_arguments import check_head_arguments
from .per_head import match_per_head, per_head_count
from .styles import Colwise, PerHead, Region, Rowwise, Style, gathers

LINEAR, CONV1D, EMBEDDING = "linear", "conv1d", "embedding"


def module_kind(module: nn.Module) -> str | None:
    """``linear``, ``conv1d`` (Hugging Face's transposed Linear) or ``embedding``; None otherwise."""
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return CONV1D
    return None


@dataclass(frozen=True)
class Install:
    """One module of a layer's replica and what tensor parallel does to it."""

    subpath: str  # inside the layer's module
    path: str  # in the original model
    style: Style
    kind: str | None
    seq_dim: int | None  # 1 inside a sequence-parallel block: the sequence is split there
    enters: bool  # a Colwise outside any Region enters the parallel region itself
    region: str | None = None  # the Region it sits in, if any
    must_run: bool = False  # a split module that computes with the layer's own parameters: it must run
    to_sequence: bool = False  # a Rowwise embedding outside the blocks: its lookups left unsummed (partial.py)


@dataclass
class LayerPlan:
    """What tensor parallel does to one layer."""

    layer: str
    installs: list[Install] = field(default_factory=list)
    blocks: list[tuple[str, str, bool, bool]] = field(default_factory=list)  # (subpath, path, first, last)
    vary: set[str] = field(default_factory=set)  # local names: replicated, maybe used on per-rank values
    # The start of the sequence-parallel region (partial.py): this layer's input (leaf 0) arrives from the
    # layer before as the embedding's partial sums; this layer's output leaves as one.
    partial_in: bool = False
    partial_out: bool = False
    # Its end: the last block's output stays a slice of the sequence up to the head, which gathers it (its
    # gradient reduce-scattered); this layer's output leaves as a slice; this layer's input arrives as one.
    slices_after: bool = False
    slices_out: bool = False
    slices_in: bool = False
    # Parameters split by their heads (PerHead): (the Region's subpath, the parameter's name in it, its path in
    # the model, its local name in the layer); the layer's first call follows each along its heads, wherever
    # the layer uses it (split_watch.py).
    per_head: list[tuple[str, str, str, str]] = field(default_factory=list)
    # Of those, the buffers and frozen parameters (which travel whole with the layer and are never updated):
    # (local name, path in the model, the Region's count attribute, its value) each, cut to the rank's heads
    # along dim 0 on every call (layer_rewrite.VaryFn).
    cut_whole: list[tuple[str, str, str, int]] = field(default_factory=list)
    # Unstyled modules that own a parameter a styled module inside them splits (Hugging Face ties a head's
    # ``bias`` to its decoder's): (subpath, attribute, refusal) each; the forward must not read it itself.
    owned_only: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def follows(self) -> bool:
        """Whether the layer's call runs a partial.Follower."""
        ends = (self.partial_in, self.partial_out, self.slices_after, self.slices_in)
        return any(ends) or any(i.to_sequence for i in self.installs)


@dataclass(frozen=True)
class ParamSplit:
    dim: int
    blocks: int
    by: str  # the module path and style that split it, for errors
    hint: str = ""  # what to do if the axis size does not divide it (a vocabulary: pad it)
    heads: tuple[str, str, int] | None = None  # a PerHead's: (its path, the count's attribute, its value)


def _vocabulary_hint(path: str, style: Style | None, kind: str | None, dim: int, in_region: bool) -> str:
    """How to split a vocabulary the axis size does not divide (GPT-2's 50257 is odd): a Rowwise embedding
    splits its rows, a Colwise head entering the region by itself its outputs."""
    vocabulary = (isinstance(style, Rowwise) and kind == EMBEDDING and dim == 0) or (
        isinstance(style, Colwise) and kind in (LINEAR, CONV1D) and not in_region
    )
    if not vocabulary:
        return ""
    return (
        f"if it is a vocabulary ({path!r} splits it), pad the vocabulary to a multiple of the tensor-parallel size "
        "before sw.functionalize, as Megatron-LM does: with Hugging Face, model.resize_token_embeddings("
        "pad_to_multiple_of=64) (it resizes a tied head too; the added tokens are never targets, but they enter the "
        "softmax), or leave the embedding and the head out of the plan"
    )


@dataclass
class Resolved:
    """The plan on a chain: per layer, and every split parameter by (owner layer, owner local name)."""

    layers: dict[str, LayerPlan]
    splits: dict[tuple[str, str], ParamSplit]
    # (module path, attribute, value, the config field it copies or ""): must divide by the axis size
    heads: list[tuple[str, str, int, str]]
    matched: dict[str, list[str]]  # pattern -> module paths (a PerHead's: parameter paths)


def _modules_of(layer: Layer) -> tuple[nn.Module, str, str] | None:
    replicas = getattr(layer.fn, "replicas", None)
    module = getattr(replicas, "module", None)
    if not isinstance(module, nn.Module):
        return None
    return module, str(getattr(layer.fn, "root_prefix", "")), str(getattr(replicas, "prefix", ""))


def _join(*parts: str) -> str:
    return ".".join(p.strip(".") for p in parts if p.strip("."))


def _is_stub(module: nn.Module) -> bool:
    return type(module).__name__ == "UnitStub"


def resolve(chain: Chain, plan: Mapping[str, Style], sequence_parallel: str | None) -> Resolved:
    """Match ``plan`` (and the sequence-parallel block pattern) on ``chain``; refuse what cannot work."""
    # (layer, root module, root prefix, prefix, subpath, module)
    found: list[tuple[Layer, nn.Module, str, str, str, nn.Module]] = []
    for layer in chain:
        got = _modules_of(layer)
        if got is None:
            continue
        root, root_prefix, prefix = got
        for subpath, module in root.named_modules():
            if not _is_stub(module):
                found.append((layer, root, root_prefix, prefix, subpath, module))
    if not found:
        raise ValueError(
            "tensor_parallel: no layer of the chain calls a module (its layers are hand-written functions), so a "
            "plan of module name patterns reaches nothing; build the chain with sw.functionalize(model, units=...)"
        )
    paths = {_join(rp, p, sub): None for _, _, rp, p, sub, _ in found}
    modules = {_join(rp, p, sub): m for _, _, rp, p, sub, m in found}
    subpaths = {_join(rp, p, sub): sub for _, _, rp, p, sub, _ in found}
    # A PerHead names a parameter, not a module (per_head.py): matched on the parameters' paths.
    # Buffers too (fixed ALiBi slopes): never trained, each rank takes its heads' rows at each call.
    owners = {
        _join(path, n): path for path, m in modules.items()
        for n, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
    }
    per_head = match_per_head({p: s for p, s in plan.items() if isinstance(s, PerHead)}, owners, modules)
    plan = {p: s for p, s in plan.items() if not isinstance(s, PerHead)}
    matched: dict[str, list[str]] = {}
    for path, (pattern, _) in per_head.items():
        matched.setdefault(pattern, []).append(path)
    for pattern in [*plan, *([sequence_parallel] if sequence_parallel else [])]:
        hits = [path for path in paths if fnmatch.fnmatchcase(path, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, list(paths), n=4, cutoff=0.4)
            hint = f"; close module paths: {close}" if close else f"; module paths look like {list(paths)[:6]}"
            what = "sequence_parallel" if pattern == sequence_parallel and pattern not in plan else f"plan[{pattern!r}]"
            raise ValueError(f"tensor_parallel: {what} matches no module of the model{hint}")
        matched[pattern] = hits
    style_of: dict[str, tuple[str, Style]] = {}
    for pattern, style in plan.items():
        for path in matched[pattern]:
            if path in style_of and style_of[path][1] != style:
                raise ValueError(
                    f"tensor_parallel: module {path!r} matches plan[{style_of[path][0]!r}] = {style_of[path][1]} and "
                    f"plan[{pattern!r}] = {style}; make the patterns select it once"
                )
            style_of[path] = (pattern, style)
    # The blocks are the outermost modules the pattern matches (fnmatch's * also matches dots).
    hits = [p for p in paths if sequence_parallel and fnmatch.fnmatchcase(p, sequence_parallel)]
    blocks_in_order = [p for p in hits if not any(p.startswith(q + ".") for q in hits)]
    for region in (p for p, (_, s) in style_of.items() if isinstance(s, Region)):
        inner = [
            p for p, (_, s) in style_of.items() if p.startswith(region + ".") and isinstance(s, (Colwise, Rowwise))
        ]
        if not inner:
            raise ValueError(
                f"tensor_parallel: plan[{style_of[region][0]!r}] = Region() on {region!r}, which holds no Colwise or "
                "Rowwise module: a Region's input gradient is summed over the axis because its split projections "
                "each computed a part of it, so a Region without them would count every gradient upstream N "
                "times; put the Region on the attention or MLP module that holds the split pair, or drop it"
            )
    for path, (_, style) in style_of.items():  # before the Regions' checks: the cause, not a missing Rowwise
        _check_not_stacked_experts(path, style, modules[path])
    _check_regions_close(style_of)
    order = {layer.name: i for i, layer in enumerate(chain)}
    layer_of = {_join(rp, p, sub): layer.name for layer, _, rp, p, sub, _ in found}
    first_layer = layer_of[blocks_in_order[0]] if blocks_in_order else None
    last_layer = layer_of[blocks_in_order[-1]] if blocks_in_order else None
    region_paths = [p for p, (_, s) in style_of.items() if isinstance(s, Region)]
    layers: dict[str, LayerPlan] = {}
    splits: dict[tuple[str, str], ParamSplit] = {}
    heads: list[tuple[str, str, int, str]] = []
    # (layer, module path, param key, styled, subpath, attribute, whether the module has a forward of ours)
    uses: list[tuple[str, str, tuple[str, str], bool, str, str, bool]] = []
    split_at: dict[tuple[str, str], str] = {}  # param key -> the path of the module that splits it
    first_names: dict[int, dict[int, str]] = {}
    for layer, _root, root_prefix, prefix, subpath, module in found:
        path = _join(root_prefix, prefix, subpath)
        lp = layers.setdefault(layer.name, LayerPlan(layer.name))
        # A Region's own parameters, and its modules', may act on per-rank values (after its input enters):
        # candidates; its first forward leaves out those used only after its split layers (layer_rewrite.VaryFn).
        inside = [r for r in region_paths if path == r or path.startswith(r + ".")]
        enclosing = [r for r in inside if r != path]
        in_block = any(path == b or path.startswith(b + ".") for b in blocks_in_order)
        seq_dim = 1 if in_block else None
        if path in blocks_in_order:
            lp.blocks.append((subpath, path, path == blocks_in_order[0], path == blocks_in_order[-1]))
        chosen: Style | None = style_of[path][1] if path in style_of else None
        kind = module_kind(module)
        # Each parameter by the name the layer knows it under: an alias (a head tied to the embedding
        # inside one module) is fed under its first name, as functional_call's tie_weights does.
        first = first_names.setdefault(id(_root), {id(t): n for n, t in _root.named_parameters()})
        own = {f"{prefix}{first.get(id(t), _join(subpath, n))}": n for n, t in module.named_parameters(recurse=False)}
        declared = {local: name for local, name in own.items() if local in layer.param_names}
        if chosen is not None:
            _check_fits(path, chosen, kind, module)
            if in_block and isinstance(chosen, Colwise) and kind != EMBEDDING and gathers(chosen, False):
                raise ValueError(
                    f"tensor_parallel: plan[{style_of[path][0]!r}] = {chosen} on {path!r}, inside a sequence-parallel "
                    "block: its input is gathered over the sequence as it enters the region, so its gathered output "
                    "holds the whole sequence where the block around it holds this rank's slice, and no Rowwise "
                    "reduce-scatters it back; leave its output split (Colwise()) with Rowwise() on the module that "
                    "takes it, both in one Region, or leave the block out of sequence_parallel"
                )
            frozen = sorted(local for local in own if local in layer.buffers)
            if frozen and not isinstance(chosen, Region):
                raise ValueError(
                    f"tensor_parallel: {chosen} on {path!r}, whose {frozen} are frozen (requires_grad=False): a frozen "
                    "tensor travels whole with its layer and is never split; leave the module replicated"
                )
            # A split module computes with this layer's parameters. Where the layer holds none of them it
            # is not this layer's to run: a Hugging Face head replays the code before the first block on
            # placeholders of the embedding, whose lookup must not be summed over the axis again.
            if isinstance(chosen, Region) or declared:
                # Known to the layer under its own names (not only as another module's alias): the layer
                # must call it, or its split parameters would be used without its communication.
                own_names = {f"{prefix}{_join(subpath, n)}" for n, _ in module.named_parameters(recurse=False)}
                # The sequence-parallel region's ends (partial.py): an embedding split on the vocabulary in the
                # first block's layer or the one before leaves its lookups unsummed for the block to reduce-scatter.
                # Under sequence parallel such a lookup is left unsummed and followed (partial.py) where the
                # first block takes it (in its layer or the one before), and after the first block's layer:
                # there it is a Hugging Face head's replay of the code before the first block (whose embedding
                # a tied head makes the layer's), never used, so never summed. (Without sequence parallel a
                # partial sum would meet the residual stream and be summed again at each norm.)
                to_sequence = (
                    isinstance(chosen, Rowwise) and kind == EMBEDDING and not in_block and first_layer is not None
                    and order[first_layer] - order[layer.name] <= 1
                )
                lp.installs.append(Install(
                    subpath, path, chosen, kind, seq_dim, isinstance(chosen, Colwise) and not enclosing,
                    region=enclosing[-1] if enclosing else None,
                    must_run=not isinstance(chosen, Region) and bool(own_names & set(layer.param_names)),
                    to_sequence=to_sequence,
                ))
                if to_sequence and first_layer is not None and order[first_layer] - order[layer.name] == 1:
                    assert first_layer is not None
                    lp.partial_out = True
                    layers.setdefault(first_layer, LayerPlan(first_layer)).partial_in = True
                # A head entering the region in the last block's layer or the one after gathers the last
                # block's output itself: the code between (the final norm) runs on the slice (partial.py).
                heads_it = (
                    isinstance(chosen, Colwise) and kind in (LINEAR, CONV1D) and not enclosing and not in_block
                    and last_layer is not None and 0 <= order[layer.name] - order[last_layer] <= 1
                )
                if heads_it:
                    assert last_layer is not None
                    last = layers.setdefault(last_layer, LayerPlan(last_layer))
                    last.slices_after = True
                    if layer.name != last_layer:
                        last.slices_out = lp.slices_in = True
            if isinstance(chosen, Region):
                _check_heads_named(style_of[path][0], path, chosen, module)
                check_head_arguments(style_of[path][0], path, chosen, module)
                for attr in (*chosen.heads, *chosen.local):
                    value = _read_attribute(module, path, attr)
                    heads.append((path, attr, value, config_field(module, attr, value)))
                _check_per_head_lists(
                    style_of[path][0], path, module, {a: _read_attribute(module, path, a) for a in chosen.heads},
                    {p for p, (_, s) in style_of.items() if isinstance(s, (Colwise, Rowwise))},
                )
        # A per-head buffer or frozen parameter stays whole in the layer (nothing trains it, so no rank's copy
        # can drift): the layer's call hands the module its rank's rows, as a split parameter's shard would be.
        whole = {
            **{local: name for local, name in own.items() if local in layer.buffers},
            **{f"{prefix}{_join(subpath, n)}": n for n, _ in module.named_buffers(recurse=False)},
        }
        for local, name in whole.items():
            param_path = _join(path, name)
            if param_path not in per_head:
                continue
            if local not in layer.buffers:
                raise ValueError(
                    f"tensor_parallel: plan[{per_head[param_path][0]!r}] = {per_head[param_path][1]} on "
                    f"{param_path!r}, a buffer layer {layer.name!r} does not carry as its own (shared with another "
                    "layer); register it in the attention that reads it, or leave it out of the plan"
                )
            pattern, ph = per_head[param_path]
            region, attr, count = per_head_count(pattern, ph, param_path, path, layer.buffers[local], style_of, modules)
            lp.per_head.append((subpaths[region], param_path.removeprefix(region + "."), param_path, local))
            lp.cut_whole.append((local, param_path, attr, count))
        for local, name in declared.items():
            key = layer.ties.get(local, (layer.name, local))
            cut = param_split(chosen, kind, name, module)
            split = None if cut is None else ParamSplit(
                cut[0], cut[1], f"{path} ({chosen})", _vocabulary_hint(path, chosen, kind, cut[0], bool(enclosing))
            )
            param_path = _join(path, name)
            if param_path in per_head:  # one value per head: cut as the Colwise projections cut the heads
                pattern, ph = per_head[param_path]
                region, attr, count = per_head_count(pattern, ph, param_path, path, module.get_parameter(name),
                                                     style_of, modules)
                split = ParamSplit(0, 1, f"{param_path} ({ph})", heads=(param_path, attr, count))
                lp.per_head.append((subpaths[region], param_path.removeprefix(region + "."), param_path, local))
            if split is not None:
                earlier = splits.get(key)
                if earlier is not None and (earlier.dim, earlier.blocks) != (split.dim, split.blocks):
                    raise ValueError(
                        f"tensor_parallel: parameter {key[1]!r} of layer {key[0]!r} is tied, and split on dim "
                        f"{earlier.dim} by {earlier.by} but on dim {split.dim} by {split.by}; a tied weight is split "
                        "one way: give both modules styles that cut it alike"
                    )
                splits[key] = split
                split_at[key] = path
            ours = chosen is not None or path in blocks_in_order
            uses.append((layer.name, path, key, split is not None, subpath, name, ours))
            replicated_bias = isinstance(chosen, Rowwise) and name == "bias"
            # A split module's 0-d gain scales its rank's part of the product: its gradient is that part's.
            gain = isinstance(chosen, (Colwise, Rowwise)) and is_gain(name)
            if split is None and (in_block or gain or (inside and not replicated_bias)):
                lp.vary.add(local)
    for layer_name, path, key, styled, subpath, attr, ours in uses:
        if styled or key not in splits:
            continue
        message = (
            f"tensor_parallel: parameter {key[1]!r} of layer {key[0]!r} is split by {splits[key].by}, but module "
            f"{path!r} uses it too and has no style that splits it alike (a tied weight: an output head tied to "
            "the embedding); give it one, e.g. Rowwise() on the Embedding with Colwise() on the head: both cut "
            "the vocabulary. (A module that only holds the tied weight and never runs, as T5's and BART's "
            "'shared', cannot take a style, which must run: leave the embeddings and the head whole there.)"
        )
        # Owning is not using: a module inside this one splits it, and this one's forward may only hand it
        # on (BertLMPredictionHead's bias, its decoder's). Its forward is watched for reading it instead.
        if not ours and split_at[key].startswith(path + "."):
            layers[layer_name].owned_only.append((subpath, attr, message.replace(" uses it too ", " reads it too ")))
            continue
        raise ValueError(message)
    return Resolved(layers, splits, heads, matched)


def _check_regions_close(style_of: Mapping[str, tuple[str, Style]]) -> None:
    """Refuse a Region whose split outputs no Rowwise sums: the module that takes them (an output
    projection) would multiply a slice of the features by its whole weight."""
    for region, (pattern, style) in style_of.items():
        if not isinstance(style, Region):
            continue
        inner = {p: s for p, (_, s) in style_of.items() if p.startswith(region + ".")}
        split = [p for p, s in inner.items() if isinstance(s, Colwise) and s.output != "replicated"]
        if split and not any(isinstance(s, Rowwise) for s in inner.values()):
            raise ValueError(
                f"tensor_parallel: plan[{pattern!r}] = Region on {region!r} holds Colwise() on "
                f"{split}, whose outputs stay split over the axis, but no Rowwise() to sum them; "
                "add Rowwise() on the module that takes them (the output projection, e.g. "
                "'o_proj' in sw.tp.llama_plan()), or give the Colwise output='replicated' (not in a "
                "sequence-parallel block, whose Region must end in a Rowwise)"
            )


# The attributes an attention module counts its heads by (TinyGPT, GPT-2, hand-written ones).
HEAD_COUNTS = (
    "n_heads", "n_head", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads",
)


def is_head_count(attr: str) -> bool:
    """Whether an attribute's name says it counts heads (``n_heads``, ``heads``, ``num_key_value_heads``),
    not their width (``head_dim``, ``attention_head_size``)."""
    return attr in HEAD_COUNTS or attr.endswith("heads") or attr in ("n_head", "num_head", "n_kv_head")


def _check_heads_named(pattern: str, path: str, style: Region, module: nn.Module) -> None:
    """Refuse a Region without heads= on a module that counts heads: nothing would check that the
    axis size divides them, and a reshape by the whole count splits each rank's features wrongly."""
    counts = {k: v for k, v in vars(module).items() if k in HEAD_COUNTS and type(v) is int}
    if style.heads or not counts:
        return
    raise ValueError(
        f"tensor_parallel: plan[{pattern!r}] = {style} on {path!r}, a {type(module).__name__} with "
        f"{counts}, names no heads: each rank must compute whole heads, 1/N of them; give "
        f"Region(heads={tuple(counts)!r})"
    )


def _check_per_head_lists(
    pattern: str, path: str, module: nn.Module, counts: Mapping[str, int], split: set[str]
) -> None:
    """Refuse a Region holding one module or parameter per head in a list (StableLM's per-head
    LayerNorms, ``zip(self.norms, heads.split(1, dim=1))``): each rank holds 1/N of the heads but the
    whole list, and pairs its heads with the list's first entries (rank 1's heads with the norms of
    rank 0's), training another model without an error. A list whose entries the plan splits (q, k and v
    as a list of projections) is not one per head, nor one whose entries hold a matrix (a list of
    adapters, Linear(D, D), as long as the head count by chance): per-head entries are norms, scales and
    biases over a head's width, vectors."""
    for sub, inner in module.named_modules():
        if not isinstance(inner, (nn.ModuleList, nn.ParameterList)) or not any(True for _ in inner.parameters()):
            continue
        if any(p.dim() > 1 for p in inner.parameters()):
            continue
        if any(p.startswith(_join(path, sub) + ".") for p in split):  # its entries split by the plan: not per head
            continue
        for attr, count in counts.items():
            if count > 1 and len(inner) == count:
                raise ValueError(
                    f"tensor_parallel: plan[{pattern!r}] = Region on {path!r} holds {_join(path, sub)!r}, a "
                    f"{type(inner).__name__} of {count} entries, one per head ({attr} = {count}): each rank computes "
                    f"1/N of the heads but holds the whole list, so a forward that pairs its heads with the entries "
                    "(zip over the heads) gives rank r's heads the entries of rank 0's; the entries the other ranks' "
                    "heads need never train. Tensor parallel cannot split such a list: leave this module out of the "
                    "plan (replicated), or turn the per-head parameters off (StableLM: qk_layernorm=False)"
                )


def is_gain(name: str) -> bool:
    """Whether a Colwise / Rowwise module's parameter ``name`` is a 0-d gain (_check_fits refuses any other besides
    its weight and bias): never split, its gradient summed over the axis, so only its module's forward may read it
    (weight_reads.py)."""
    return name not in ("weight", "bias")


def param_split(style: Style | None, kind: str | None, name: str, module: nn.Module) -> tuple[int, int] | None:
    """(dim, fused blocks) a style splits a module's parameter on, or None: replicated (a Rowwise's bias, a
    0-d gain besides weight and bias)."""
    if is_gain(name):
        return None
    if isinstance(style, Colwise):
        if kind == LINEAR:
            return 0, style.fused
        if kind == CONV1D:
            return (1 if name == "weight" else 0), style.fused
        if kind == EMBEDDING:
            return 1, 1
    if isinstance(style, Rowwise):
        if name == "bias":
            return None
        if kind == LINEAR:
            return 1, 1
        if kind == CONV1D:
            return 0, 1
        if kind == EMBEDDING:
            return 0, 1
    return None


def _check_not_stacked_experts(path: str, style: Style, module: nn.Module) -> None:
    """Refuse Colwise or Rowwise on a mixture of experts' experts held stacked (GPT-OSS's ``(experts, in,
    out)`` parameters): no style of a Linear fits them, and the generic refusal would send the user to
    projections the module does not have."""
    stacked = {n: tuple(t.shape) for n, t in module.named_parameters() if t.dim() >= 3}
    if not isinstance(style, (Colwise, Rowwise)) or module_kind(module) is not None or not stacked:
        return
    raise ValueError(
        f"tensor_parallel: {style} on {path!r}, a {type(module).__name__} holding its experts' weights stacked "
        f"({stacked}): tensor parallel splits the features of Linear, Conv1D and Embedding modules, and does "
        "not split experts held as (experts, in, out) parameters (their fused gate and up, their biases, "
        "their router). Leave the mixture of experts out of the plan (replicated on every rank; "
        "sw.tp.gpt_oss_plan() does so for GPT-OSS), or split its experts over ranks with sw.expert_parallel"
    )


def _check_fits(path: str, style: Style, kind: str | None, module: nn.Module) -> None:
    if isinstance(style, Region):
        return
    if kind is None:
        raise ValueError(
            f"tensor_parallel: {style} on {path!r}, a {type(module).__name__}: Colwise and Rowwise split an "
            "nn.Linear, a Hugging Face Conv1D or an nn.Embedding; give its projections the styles, and the "
            "module itself Region() if it is an attention or MLP block"
        )
    if kind == EMBEDDING:
        if isinstance(style, Colwise) and style.fused != 1:
            raise ValueError(f"tensor_parallel: {style} on the Embedding {path!r}: an embedding has no fused blocks")
        for option in ("max_norm", "sparse", "scale_grad_by_freq"):
            if getattr(module, option, None):
                raise ValueError(
                    f"tensor_parallel: the Embedding {path!r} sets {option}={getattr(module, option)!r}, which a "
                    f"split embedding does not reproduce; leave it replicated, or {option_fix(option)}"
                )
    parametrized = getattr(module, "parametrizations", None)
    if isinstance(parametrized, nn.ModuleDict) and len(parametrized):
        made = {n: [type(p).__name__ for p in plist.children()] for n, plist in parametrized.items()}
        raise ValueError(
            f"tensor_parallel: {style} on {path!r}, whose {sorted(made)} are computed by torch.nn.utils.parametrize "
            f"({made}: weight_norm, spectral_norm, orthogonal): a parametrization computes the weight from tensors "
            "of the whole shape (a norm over all of it), which tensor parallel does not split, so each rank would "
            "not hold its slice of the weight; leave the module out of the plan (replicated, with its Colwise / "
            "Rowwise partner), or remove the parametrization before sw.functionalize "
            "(torch.nn.utils.parametrize.remove_parametrizations(module, 'weight'))"
        )
    extra = {n: tuple(t.shape) for n, t in module.named_parameters(recurse=False) if n not in ("weight", "bias")}
    # A 0-d gain is taken where the module's own forward runs on the rank's slice (an nn.Linear's, a Colwise
    # nn.Embedding's), its gradient summed over the axis; a Conv1D's or a vocabulary lookup's is not run.
    runs = kind == LINEAR or (kind == EMBEDDING and isinstance(style, Colwise))
    refused = {n: shape for n, shape in extra.items() if shape or not runs}
    if refused:
        what = (
            "its forward would use them whole with the rank's slice of the weight (a gain per output feature "
            "meeting a slice of the features)" if runs else
            "tensor parallel computes its split product itself, without its forward, so they would go unused"
        )
        raise ValueError(
            f"tensor_parallel: {style} on {path!r}, a {type(module).__name__}, has parameters {refused} besides "
            f"weight and bias, which no style splits: {what}. A 0-d one (a learned scalar gain) on a Linear, or "
            "on a Colwise Embedding, is taken, its gradient summed over the axis; otherwise apply it in the module "
            "around this one, or leave this one out of the plan (replicated, with its Colwise / Rowwise partner)"
        )


def _read_attribute(module: nn.Module, path: str, attr: str) -> int:
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(
                f"tensor_parallel: Region on {path!r} names the attribute {attr!r}, which "
                f"{type(module).__name__} does not have; name the attribute that counts its heads"
            )
        value = getattr(value, part)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"tensor_parallel: {path}.{attr} is {value!r}, not a count that the axis size must divide")
    return value
