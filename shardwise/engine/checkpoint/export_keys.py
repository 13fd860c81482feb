"""Which tensors an export writes, under which keys, layer by layer, before any value is gathered.

A transformers model's (also one a module of one's own wraps, under its own keys) are the ones its
``save_pretrained`` writes: the ``state_dict`` less the
model's ``_keys_to_ignore_on_save``, a tied weight once under the name transformers keeps
(``remove_tied_weights_from_state_dict``: GPT-2's ``transformer.wte.weight``, not ``lm_head.weight``),
then transformers' reverse conversion mapping (``revert_weight_conversion``: Mixtral's fused
``mlp.experts.gate_up_proj`` [E, 2I, H] written per expert as ``block_sparse_moe.experts.N.w1.weight``
and ``.w3``). Those functions are run here on meta tensors of the step's shapes and master dtypes,
one layer's tensors at a time, and the export runs them again on each layer's gathered values, so
the keys and shapes are transformers' own; a conversion that joins the tensors of two layers cannot
be streamed a layer at a time and is refused. Any other module's are its ``state_dict`` keys with a
tied weight once, under its first name (safetensors holds no tensor twice).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..layout.state_layout import StateLayout
from ..model.chain import Chain
from .errors import CheckpointError
from .hf_layout import pretrained, unprefixed
from .names import Source, StateDictNames
from .safetensors_writer import Planned

Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LayerExport:
    """What one layer's tensors become in the files: ``inputs`` (a kept ``state_dict`` key and where
    its value lives) are converted into ``outputs``, written in this order."""

    layer: str
    inputs: tuple[tuple[str, Source], ...]
    outputs: tuple[Planned, ...]


@dataclass(frozen=True)
class ExportKeys:
    layers: tuple[LayerExport, ...]
    convert: Convert

    @property
    def planned(self) -> list[Planned]:
        return [t for layer in self.layers for t in layer.outputs]


def export_keys(call: str, chain: Chain, layout: StateLayout, names: StateDictNames) -> ExportKeys:
    """The tensors ``save_pretrained`` of ``chain``'s module writes, per layer of ``layout``."""
    found = pretrained(chain, names.keys)
    model, prefix = (None, "") if found is None else found
    # A transformers model wrapped in a module of one's own is written under its own keys (without the
    # wrapper's prefix), so that its class's from_pretrained reads the files.
    own = unprefixed(names, prefix) if prefix else names
    kept = _kept_keys(model, own) if model is not None else [k for k in names.keys if k not in names.aliases]
    by_layer: dict[str, list[tuple[str, Source]]] = {layer: [] for layer in layout.layers}
    for key in kept:
        source = own.keys[key]
        by_layer[source[1]].append((key, source))
    convert = _converter(model)
    layers = []
    for layer, inputs in by_layer.items():
        metas = {key: _meta(chain, layout, source) for key, source in inputs}
        outputs = tuple(Planned(k, tuple(t.shape), t.dtype) for k, t in convert(metas).items())
        layers.append(LayerExport(layer, tuple(inputs), outputs))
    _check_layerwise(call, layers, convert, {k: _meta(chain, layout, own.keys[k]) for k in kept})
    return ExportKeys(tuple(layers), convert)


def _kept_keys(model: nn.Module, names: StateDictNames) -> list[str]:
    """The ``state_dict`` keys transformers' ``save_pretrained`` keeps, in the state_dict's order.

    The chain's model is the root with its units stubbed, so the state_dict is made from the chain's
    names: one small tensor per source, shared by a tied weight's names, which is how transformers
    finds ties (by storage) before it picks the name to keep from the model's tied-weight keys."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tensors: dict[Source, torch.Tensor] = {}
    state_dict = {key: tensors.setdefault(source, torch.empty(1)) for key, source in names.keys.items()
                  if key not in ignored}
    utils = importlib.import_module("transformers.modeling_utils")
    remove_tied = getattr(utils, "remove_tied_weights_from_state_dict", None)
    if remove_tied is not None:  # transformers 5
        return list(remove_tied(state_dict, model))
    return [k for k in state_dict if k not in names.aliases]


def _converter(model: nn.Module | None) -> Convert:
    """transformers' reverse conversion mapping for ``model`` (its ``save_pretrained`` applies it), or
    the identity."""
    try:
        loading = importlib.import_module("transformers.core_model_loading") if model is not None else None
    except ImportError:
        loading = None
    revert = getattr(loading, "revert_weight_conversion", None)
    if revert is None:
        return dict
    return lambda tensors: dict(revert(model, tensors)) if tensors else {}


def _meta(chain: Chain, layout: StateLayout, source: Source) -> torch.Tensor:
    kind, layer, name = source
    if kind == "param":
        spec = layout.leaves[(layer, name)]
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return torch.empty_like(chain[layer].buffers[name], device="meta")


def _check_layerwise(call: str, layers: list[LayerExport], convert: Convert, whole: dict[str, torch.Tensor]) -> None:
    """The layers' conversions together must be the whole state_dict's: no output made of two layers."""
    per_layer: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for layer in layers:
        for t in layer.outputs:
            if t.key in per_layer:
                raise CheckpointError(f"{call}: two layers' tensors are both converted to {t.key!r}; "
                                      "export with sw.checkpoint.full_state_dict and model.save_pretrained")
            per_layer[t.key] = (t.shape, t.dtype)
    together = {k: (tuple(t.shape), t.dtype) for k, t in convert(whole).items()}
    if together != per_layer:
        differ = sorted(k for k in set(together) | set(per_layer) if together.get(k) != per_layer.get(k))[:4]
        raise CheckpointError(
            f"{call}: transformers' save_pretrained converts tensors of several layers together ({differ}), which "
            "an export a layer at a time cannot; export with sw.checkpoint.full_state_dict and model.save_pretrained"
        )
