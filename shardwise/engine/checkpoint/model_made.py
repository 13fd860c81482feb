"""Buffers and frozen parameters a transformers ``save_pretrained`` leaves out, which ``from_pretrained`` makes.

A start from stored weights fills the chain's buffers and frozen (``requires_grad=False``) parameters from the
files (``buffers.py``), and refuses one that is not there. Two kinds are left out of a model's own files, and
``from_pretrained`` loads them all the same:

* a tensor the model's ``_keys_to_ignore_on_load_missing`` names, which its initializer computes: Marian's
  frozen sinusoidal position tables (``model.encoder.embed_positions.weight``, also in ``_keys_to_ignore_on_save``:
  no opus-mt checkpoint holds them), BART's ``final_logits_bias`` (zeros). An eagerly built model holds them as its
  constructor made them, and keeps them; a meta-built one has its frozen ones as the split's stand-ins, made here
  by its initializer (``ModuleInit``: the model's ``_init_weights``), as ``step.init`` makes a parameter;
* the other name of a frozen tied weight (a frozen GPT-2 ``wte``, which ``lm_head.weight`` is): ``save_pretrained``
  keeps one name of a tied tensor, and the chain carries both; it is read from the name stored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..model.chain import Chain
from ..model.materialize import is_stand_in
from .buffers import copying
from .hf_layout import pretrained
from .names import StateDictNames
from .regions import Placed

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def tied_frozen_names(chain: Chain, names: StateDictNames, shapes: Shapes) -> dict[str, str]:
    """Each buffer key not stored whose tensor the chain holds under a stored buffer key too -> that key."""
    stored: dict[int, str] = {}
    for key, (layer, name) in names.buffers.items():
        if key in shapes:
            stored.setdefault(id(chain[layer].buffers[name]), key)
    return {key: stored[id(chain[layer].buffers[name])] for key, (layer, name) in names.buffers.items()
            if key not in shapes and id(chain[layer].buffers[name]) in stored}


class Aliased:
    """``store`` with each key of ``aliases`` read from the stored key it names."""

    def __init__(self, store: object, aliases: Mapping[str, str]) -> None:
        self.store, self.aliases = store, dict(aliases)
        self.where: str = getattr(store, "where")  # noqa: B009 - a Store's
        shapes = getattr(store, "shapes")()  # noqa: B009
        self._shapes = {**shapes, **{alias: shapes[key] for alias, key in self.aliases.items()}}

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._shapes

    def read_into(self, key: str, placed: list[Placed]) -> None:
        getattr(self.store, "read_into")(self.aliases.get(key, key), placed)  # noqa: B009

    def made_of(self, key: str) -> str:
        made_of = getattr(self.store, "made_of", None)
        return "" if made_of is None else str(made_of(self.aliases.get(key, key)))


def left_to_the_model(chain: Chain, names: StateDictNames, shapes: Shapes) -> set[str]:
    """The buffer keys (frozen parameters among them) not stored that the chain's transformers model's
    ``_keys_to_ignore_on_load_missing`` names (matched as ``from_pretrained`` matches them, on its own keys)."""
    found = pretrained(chain, names.keys)
    if found is None:
        return set()
    model, prefix = found
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    return {key for key in names.buffers if key not in shapes and key.startswith(prefix)
            and any(p.search(key[len(prefix):]) for p in patterns)}


def without(names: StateDictNames, keys: set[str]) -> StateDictNames:
    """``names`` less ``keys``."""
    return StateDictNames({k: v for k, v in names.keys.items() if k not in keys}, dict(names.param_key))


def make_left_to_the_model(chain: Chain, names: StateDictNames, keys: set[str], seed: int) -> None:
    """Make each of ``keys`` the chain still holds as a stand-in (a meta build's frozen parameter) by the model's
    initializer; an eager build's (and a buffer, made by ``functionalize``) keep their values."""
    init = getattr(chain, "init", None)
    with copying, torch.no_grad():  # (thread ranks share the chain: the first makes it, the others find it)
        for key in sorted(keys):
            layer, name = names.buffers[key]
            held = chain[layer].buffers[name]
            if init is None or not is_stand_in(held):
                continue
            value = init.tensor(key, seed).to(device=held.device, dtype=held.dtype).contiguous()
            held.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())
