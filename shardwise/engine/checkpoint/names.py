"""The names a chain's tensors have in the original module's ``state_dict``.

``functionalize`` names a layer's tensors in one of two ways: relative to the
layer's module (an ``nn.Sequential`` child: ``params["0"]["weight"]`` is the
module's ``"0.weight"``), or relative to the root (a whole module, an fx or
call-recording split: ``params["tok_emb"]["tok_emb.weight"]`` is ``"tok_emb.weight"``).
The layer's module (kept by its fn for the per-thread replicas) says which, and
also what no params pytree shows: every alias of a tied weight (Hugging Face's
``lm_head.weight`` is ``transformer.wte.weight``), and which buffers are
persistent (in the state_dict) and which are not (TinyGPT's causal mask).

A hand-written chain has no module: its tensors are named ``"<layer>.<name>"``,
every buffer included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model.chain import Chain, Layer

WHOLE_MODULE = "model"  # functionalize's name for a module kept whole

# Where a state_dict entry's value lives: ("param", owner layer, owner's local name) or
# ("buffer", layer, local name).
Source = tuple[str, str, str]


@dataclass(frozen=True)
class StateDictNames:
    """Every ``state_dict`` key of the chain's module and where its value lives.

    ``keys`` in the module's order; ``param_key[(layer, name)]`` is the key a checkpoint
    and an exported state_dict use for an owned parameter (its first name; a tied
    weight's other names are aliases of it)."""

    keys: dict[str, Source]
    param_key: dict[tuple[str, str], str]

    @property
    def aliases(self) -> dict[str, str]:
        """Each key that names a parameter already named by another key -> that key."""
        return {
            key: self.param_key[(layer, name)]
            for key, (kind, layer, name) in self.keys.items()
            if kind == "param" and self.param_key[(layer, name)] != key
        }

    @property
    def buffers(self) -> dict[str, tuple[str, str]]:
        return {key: (layer, name) for key, (kind, layer, name) in self.keys.items() if kind == "buffer"}


def state_dict_names(chain: Chain) -> StateDictNames:
    """The state_dict names of every parameter and persistent buffer of ``chain``."""
    keys: dict[str, Source] = {}
    for layer in chain.layers:
        for key, source in _layer_keys(chain, layer).items():
            known = keys.get(key)
            if known is not None and known != source and not _same_buffer(chain, known, source):
                raise ValueError(
                    f"state_dict key {key!r} names two different tensors: {known[1]}.{known[2]} and "
                    f"{source[1]}.{source[2]}; name the layers' tensors apart"
                )
            keys.setdefault(key, source)
    param_key: dict[tuple[str, str], str] = {}
    for key, (kind, owner, name) in keys.items():
        if kind == "param":
            param_key.setdefault((owner, name), key)
    missing = [
        f"{layer.name}.{n}"
        for layer in chain.layers
        for n in layer.owned_param_names
        if (layer.name, n) not in param_key
    ]
    if missing:
        raise ValueError(f"state_dict_names: parameters {missing} have no name in their layer's module")
    return StateDictNames(keys, param_key)


def _same_buffer(chain: Chain, a: Source, b: Source) -> bool:
    """Whether two layers' buffers are one tensor of the model (a buffer of the model every block reads,
    which each block's segment holds): one state_dict entry, saved once."""
    return a[0] == b[0] == "buffer" and chain[a[1]].buffers[a[2]] is chain[b[1]].buffers[b[2]]


def module_params(chain: Chain) -> dict[tuple[str, str], torch.Tensor]:
    """The tensors the chain's modules hold for its owned parameters, by (layer, name): the
    shapes and dtypes a step of this chain was built for. Hand-written layers (no module) say
    nothing, so they are absent."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for layer in chain.layers:
        replicas = getattr(layer.fn, "replicas", None)
        module = getattr(replicas, "module", None)
        if not isinstance(module, nn.Module):
            continue
        prefix, owned = str(getattr(replicas, "prefix", "")), set(layer.owned_param_names)
        for name, t in module.named_parameters(remove_duplicate=False):  # every tied name
            if prefix + name in owned:
                out[(layer.name, prefix + name)] = t
    return out


def _layer_keys(chain: Chain, layer: Layer) -> dict[str, Source]:
    replicas = getattr(layer.fn, "replicas", None)
    module = getattr(replicas, "module", None)
    if not isinstance(module, nn.Module):
        return _hand_written_keys(layer)
    local_prefix = str(getattr(replicas, "prefix", ""))
    key_prefix = _key_prefix(chain, layer, module, local_prefix)
    canonical: dict[int, str] = {}  # id(tensor) -> its first (deduplicated) name in the module
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        canonical.setdefault(id(t), name)
    keys: dict[str, Source] = {}
    transient: frozenset[str] = getattr(layer.fn, "transient", frozenset())  # not persisted (functionalize's)
    for name, t in module.state_dict(keep_vars=True).items():
        if name in transient:
            continue
        local = local_prefix + canonical.get(id(t), name)
        source = _source_of(layer, local)
        if source is not None:
            keys[key_prefix + name] = source
    return keys


def _key_prefix(chain: Chain, layer: Layer, module: nn.Module, local_prefix: str) -> str:
    """What turns a name relative to the layer's module into the root module's name."""
    if local_prefix:  # a recorded unit: its module is the unit, its names carry the unit's path
        return local_prefix
    if isinstance(module, torch.fx.GraphModule) or (len(chain) == 1 and layer.name == WHOLE_MODULE):
        return ""  # an fx segment or the whole module: names are the root's already
    if type(layer.fn).__name__ != "_ModuleFn":
        return ""  # the call-recording split's embed / head: the root, units stubbed
    return layer.name + "."  # an nn.Sequential child


def _source_of(layer: Layer, local: str) -> Source | None:
    if local in layer.ties:
        owner, owner_local = layer.ties[local]
        return ("param", owner, owner_local)
    if local in layer.param_names:
        return ("param", layer.name, local)
    if local in layer.buffers:
        return ("buffer", layer.name, local)
    return None  # a placeholder for a tensor another layer holds


def _hand_written_keys(layer: Layer) -> dict[str, Source]:
    keys: dict[str, Source] = {}
    for name in layer.param_names:
        source = _source_of(layer, name)
        assert source is not None
        keys[f"{layer.name}.{name}"] = source
    for name in layer.buffers:
        keys[f"{layer.name}.{name}"] = ("buffer", layer.name, name)
    return keys
