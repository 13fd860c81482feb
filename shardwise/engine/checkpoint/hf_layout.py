"""A transformers checkpoint read under the module's own keys, as ``from_pretrained`` reads it.

``save_pretrained`` does not always write a module's ``state_dict`` keys. transformers 5 holds a
mixture of experts fused (Mixtral's ``mlp.experts.gate_up_proj`` [E, 2I, H]) but writes the
checkpoint format (``block_sparse_moe.experts.N.w1.weight``, ``.w3``, ``.w2``), and converts back
on load with the model's *conversion mapping* (renamings, then per-expert stacks and
concatenations). A base model's save (the hub's ``gpt2``) lacks the head model's
``base_model_prefix`` (``transformer.``); old files carry tensors the model no longer has
(``attn.bias``, ``rotary_emb.inv_freq``), which ``from_pretrained`` drops by the model's
``_keys_to_ignore_on_load_unexpected``. ``HfLayout`` applies the same rules, through transformers'
own mapping and renaming functions, and serves each module key from the stored tensors it is made
of: a stack or concatenation of stored tensors is virtual, so a rank still reads only the elements
it keeps (each box it keeps is cut into the boxes of the stored tensors it covers). A conversion
other than renames, stacks and concatenations is refused, naming it and the way round it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..model.chain import Chain
from ..model.materialize import is_transformers_model
from .errors import CheckpointError
from .names import StateDictNames
from .regions import Placed

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class _Store(Protocol):
    where: str

    def shapes(self) -> Shapes: ...

    def read_into(self, key: str, placed: list[Placed]) -> None: ...


@dataclass(frozen=True)
class _Stored:
    key: str


@dataclass(frozen=True)
class _Joined:
    """Parts joined along ``dim``: stacked (each part one index of a new dim) or concatenated."""

    dim: int
    parts: tuple[_Node, ...]
    stack: bool


_Node = _Stored | _Joined


def pretrained_model(chain: Chain) -> nn.Module | None:
    """The transformers model whose ``state_dict`` names the chain's tensors (a layer holding the
    root: the whole module, or a split's embed / head), or None."""
    found = pretrained(chain)
    return None if found is None else found[0]


def pretrained(chain: Chain, keys: Iterable[str] | None = None) -> tuple[nn.Module, str] | None:
    """The transformers model whose ``state_dict`` names the chain's tensors, and the prefix of its keys in the
    chain's: ``""`` for the root itself; ``"model."`` for one that a module of one's own wraps as its one
    transformers model (an encoder-decoder wrapped to be split per layer), where every key of ``keys`` (the
    chain's state_dict keys, when given) is under it, so that its files are read and written under the
    transformers model's own keys. None where there is none."""
    for layer in chain.layers:
        replicas = getattr(layer.fn, "replicas", None)
        module = getattr(replicas, "module", None)
        held_whole = not str(getattr(replicas, "prefix", "") or "")  # (a split's embed / head hold the root)
        if not isinstance(module, nn.Module) or not held_whole:
            continue
        if is_transformers_model(module):
            return module, ""
        inner = [(path, m) for path, m in module.named_modules() if path and is_transformers_model(m)]
        outermost = [(path, m) for path, m in inner if not any(path.startswith(p + ".") for p, _ in inner)]
        if len(outermost) != 1:
            return None
        path, model = outermost[0]
        if keys is not None and not all(k.startswith(path + ".") for k in keys):
            return None
        return model, path + "."
    return None


class HfLayout:
    """``store`` (a ``save_pretrained`` directory's tensors by stored key) under ``model``'s
    ``state_dict`` keys ``names``; a stored tensor the model would not load and ``from_pretrained``
    does not ignore keeps its own key (so it is refused as unexpected)."""

    def __init__(self, store: _Store, model: nn.Module, names: StateDictNames) -> None:
        self.store, self.where = store, store.where
        stored = store.shapes()
        self.wanted = frozenset(names.keys)  # the model's keys (the others are stored tensors it does not load)
        self.prefix = str(getattr(model, "base_model_prefix", "") or "")
        self._nodes = self._convert(model, names, stored)
        self._shapes = {key: _shape(self.where, key, node, stored) for key, node in self._nodes.items()}

    def shapes(self) -> Shapes:
        return self._shapes

    def made_of(self, key: str) -> str:
        """For an error about ``key``: the stored tensors it is joined from, or '' for a stored one."""
        node = self._nodes[key]
        if isinstance(node, _Stored):
            return ""
        stacks = [part for part in node.parts if isinstance(part, _Joined)] if not node.stack else [node]
        counts = ", ".join(f"{len(stack.parts)} x {_first_key(stack)!r}" for stack in stacks)
        return f" (stacked from the files' tensors per expert: {counts}; an index missing there makes it short)"

    def read_into(self, key: str, placed: list[Placed]) -> None:
        self._read(self._nodes[key], placed)

    def _read(self, node: _Node, placed: list[Placed]) -> None:
        if isinstance(node, _Stored):
            self.store.read_into(node.key, placed)
            return
        at = 0
        for part in node.parts:
            size = 1 if node.stack else self._shapes_of(part)[node.dim]
            pieces: list[Placed] = []
            for (offsets, sizes), view in placed:
                lo, hi = max(offsets[node.dim], at), min(offsets[node.dim] + sizes[node.dim], at + size)
                if hi <= lo or 0 in sizes:
                    continue
                begin = lo - offsets[node.dim]
                if node.stack:  # the part is index ``at`` of the dim, which it lacks
                    pieces.append(((_drop(offsets, node.dim), _drop(sizes, node.dim)), view.select(node.dim, begin)))
                else:
                    moved = (*offsets[: node.dim], lo - at, *offsets[node.dim + 1 :])
                    cut = (*sizes[: node.dim], hi - lo, *sizes[node.dim + 1 :])
                    pieces.append(((moved, cut), view.narrow(node.dim, begin, hi - lo)))
            if pieces:
                self._read(part, pieces)
            at += size

    def _shapes_of(self, node: _Node) -> tuple[int, ...]:
        if isinstance(node, _Stored):
            return self.store.shapes()[node.key][0]
        first = self._shapes_of(node.parts[0])
        if node.stack:
            return (*first[: node.dim], len(node.parts), *first[node.dim :])
        total = sum(self._shapes_of(p)[node.dim] for p in node.parts)
        return (*first[: node.dim], total, *first[node.dim + 1 :])

    def _convert(self, model: nn.Module, names: StateDictNames, stored: Shapes) -> dict[str, _Node]:
        loading = _transformers_loading()
        transforms = [] if loading is None else _conversions(model)
        # split as from_pretrained splits them (convert_and_load_state_dict_in_model)
        renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        wanted = dict.fromkeys(names.keys, True)
        ignored = _ignored_unexpected(model)
        nodes: dict[str, _Node] = {}
        gathered: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # module key -> converter, its stored keys
        order = sorted(stored, key=loading.dot_natural_key) if loading is not None else sorted(stored)
        for key in order:  # experts in index order (10 after 9), as from_pretrained collects them
            renamed, pattern = self._renamed(loading, key, renamings, converters, wanted)
            if renamed not in wanted:
                if ignored is None or ignored.search(renamed) is None:
                    nodes[key] = _Stored(key)  # unexpected: refused by the caller, under its own key
                continue
            if pattern is None:
                if renamed in nodes:
                    self._twice(renamed, [_origin(nodes[renamed]), key])
                nodes[renamed] = _Stored(key)
                continue
            converter = by_pattern[pattern]
            gathered.setdefault(renamed, (converter, {}))[1].setdefault(pattern, []).append(key)
        for key, (converter, parts) in gathered.items():
            if key in nodes:
                self._twice(key, [_origin(nodes[key]), *(k for keys in parts.values() for k in keys)][:4])
            nodes[key] = self._joined(loading, key, converter, parts)
        return nodes

    def _check_indices(self, key: str, pattern: str, stored: list[str]) -> None:
        """A stack takes its tensors in index order: they must be indices 0, 1, ... with none skipped
        (``from_pretrained`` stacks whatever it finds, and a gap moves the experts after it a slot down)."""
        if pattern.count("*") != 1:
            return
        index = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found = [index.search(k) for k in stored]
        if any(m is None for m in found):
            return
        indices = [int(m.group(1)) for m in found if m is not None]
        if indices != list(range(len(indices))):
            missing = sorted(set(range(len(indices))) - set(indices))
            raise CheckpointError(
                f"{self.where} stores the model's {key!r} as one tensor per index of {pattern!r}, but holds "
                f"indices {indices[:12]}: {missing[:12]} missing, so the ones after them would land a slot "
                "early; load a save of this model's experts, every index from 0"
            )

    def _twice(self, key: str, stored: list[str]) -> None:
        raise CheckpointError(
            f"{self.where} holds the model's {key!r} twice: as {stored} (with and without the model's "
            f"base_model_prefix {self.prefix!r}, or fused and per expert); keep one of them"
        )

    def _renamed(self, loading: Any, key: str, renamings: list[Any], converters: list[Any],
                 wanted: Mapping[str, bool]) -> tuple[str, str | None]:
        """``from_pretrained``'s name for stored ``key`` (renamings, at most one converter, the
        base_model_prefix added or stripped) and the converter's source pattern it matched."""
        if loading is None:
            return _with_prefix(key, self.prefix, wanted), None
        renamed, pattern = loading.rename_source_key(key, renamings, converters, self.prefix or None, wanted)
        if renamed not in wanted and key in wanted:  # stored under the module's own name already
            renamed, pattern = key, None
        return renamed, pattern

    def _joined(self, loading: Any, key: str, converter: Any, parts: dict[str, list[str]]) -> _Node:
        """The node of ``converter``'s stacks (``MergeModulelist``: each source pattern's tensors, in
        order) then concatenation (``Concatenate``: the stacks, in source-pattern order) of ``parts``
        (stored keys by source pattern), or refused naming the conversion."""
        ops = list(converter.operations)
        names = [type(op).__name__ for op in ops]
        kinds = [type(op) for op in ops]  # exactly these: a subclass may convert otherwise
        if kinds in ([loading.MergeModulelist], [loading.MergeModulelist, loading.Concatenate]) and (
            len(converter.source_patterns) == 1 or len(kinds) == 2
        ) and converter.quantization_operation is None:
            for pattern in converter.source_patterns:
                if pattern in parts:
                    self._check_indices(key, pattern, parts[pattern])
            stacked = [
                _Joined(ops[0].dim, tuple(_Stored(k) for k in parts[p]), stack=True)
                for p in converter.source_patterns if p in parts
            ]
            if len(kinds) == 1:
                return stacked[0]
            return _Joined(ops[1].dim, tuple(stacked), stack=False)
        stored = [k for keys in parts.values() for k in keys]
        raise CheckpointError(
            f"{self.where} stores the model's {key!r} as {stored[:4]}, which transformers' from_pretrained converts "
            f"with {names} ({converter!r}); init_from_pretrained applies renamings, stacks (MergeModulelist) and "
            "concatenations (Concatenate) only. Write the weights under the module's own keys once "
            "(safetensors.torch.save_model(Model.from_pretrained(directory), f'{other}/model.safetensors')) "
            "and load that directory, or pass Model.from_pretrained(directory).state_dict() to "
            "sw.checkpoint.init_from_state_dict (every rank then holds the whole model)"
        )


def _transformers_loading() -> Any:
    """transformers' key renaming (``core_model_loading``), or None where it has none (before 5)."""
    try:
        loading = importlib.import_module("transformers.core_model_loading")
    except ImportError:
        return None
    return loading if hasattr(loading, "rename_source_key") and hasattr(loading, "dot_natural_key") else None


def _conversions(model: nn.Module) -> list[Any]:
    """The model's conversion mapping, as ``from_pretrained`` gets it (PEFT uses this function too)."""
    mapping = importlib.import_module("transformers.conversion_mapping")
    return list(mapping.get_model_conversion_mapping(model))


def _ignored_unexpected(model: nn.Module) -> re.Pattern[str] | None:
    """The patterns of stored keys ``from_pretrained`` drops without a word: the model's
    ``_keys_to_ignore_on_load_unexpected``, and, as transformers adds them for every model, a
    per-layer ``rotary_emb.inv_freq`` where the model has one shared one and ``position_ids`` where
    the model holds it unpersisted (``PreTrainedModel._adjust_missing_and_unexpected_keys``)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def _with_prefix(key: str, prefix: str, wanted: Mapping[str, bool]) -> str:
    if not prefix:
        return key
    if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in wanted:
        return key[len(prefix) + 1 :]
    return f"{prefix}.{key}" if f"{prefix}.{key}" in wanted else key


def _origin(node: _Node) -> str:
    assert isinstance(node, _Stored)  # joined nodes are made last
    return node.key


def _first_key(node: _Node) -> str:
    return node.key if isinstance(node, _Stored) else _first_key(node.parts[0])


def _drop(values: Sequence[int], dim: int) -> tuple[int, ...]:
    return (*values[:dim], *values[dim + 1 :])


def _shape(where: str, key: str, node: _Node, stored: Shapes) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of ``node``; its parts must fit together (same dtype, equal shapes to
    stack, equal but along ``dim`` to concatenate)."""
    if isinstance(node, _Stored):
        return stored[node.key]
    parts = [_shape(where, key, p, stored) for p in node.parts]
    shapes, dtypes = [s for s, _ in parts], {d for _, d in parts}
    others = {_drop(s, node.dim) if not node.stack else s for s in shapes}
    if len(dtypes) != 1 or len(others) != 1 or any(len(s) < node.dim + (0 if node.stack else 1) for s in shapes):
        raise CheckpointError(
            f"{where}: the stored tensors transformers joins into {key!r} do not fit together "
            f"(shapes {[list(s) for s in shapes][:4]}, dtypes {sorted(map(str, dtypes))}); the files are of "
            "another save"
        )
    first = shapes[0]
    if node.stack:
        return (*first[: node.dim], len(shapes), *first[node.dim :]), parts[0][1]
    return (*first[: node.dim], sum(s[node.dim] for s in shapes), *first[node.dim + 1 :]), parts[0][1]


def layout_of(store: _Store, chain: Chain, names: StateDictNames) -> _Store:
    """``store`` as ``from_pretrained`` would read it into the chain's transformers model (under the keys of the
    module that wraps it, if one does), or as it is."""
    found = pretrained(chain, names.keys)
    if found is None:
        return store
    model, prefix = found
    if not prefix:
        return HfLayout(store, model, names)
    return _Prefixed(HfLayout(store, model, unprefixed(names, prefix)), prefix)


def unprefixed(names: StateDictNames, prefix: str) -> StateDictNames:
    """``names`` of the keys under ``prefix``, without it: a wrapped transformers model's own keys."""
    n = len(prefix)
    return StateDictNames({k[n:]: v for k, v in names.keys.items() if k.startswith(prefix)},
                          {at: k[n:] for at, k in names.param_key.items() if k.startswith(prefix)})


class _Prefixed:
    """A wrapped transformers model's files (``inner``, under its own keys) under the wrapper's keys
    (``prefix`` + its own); a stored tensor it does not load keeps its stored key (refused as unexpected)."""

    def __init__(self, inner: HfLayout, prefix: str) -> None:
        self.inner, self.prefix, self.where = inner, prefix, inner.where
        self._own = {k for k in inner.shapes() if k in inner.wanted}

    def _inner_key(self, key: str) -> str:
        return key[len(self.prefix):] if key.startswith(self.prefix) and key[len(self.prefix):] in self._own else key

    def shapes(self) -> Shapes:
        return {self.prefix + k if k in self._own else k: v for k, v in self.inner.shapes().items()}

    def made_of(self, key: str) -> str:
        return self.inner.made_of(self._inner_key(key))

    def read_into(self, key: str, placed: list[Placed]) -> None:
        self.inner.read_into(self._inner_key(key), placed)

