"""Restoring a chain's persistent buffers, frozen parameters among them, from saved values.

``functionalize`` carries a module's buffers and its parameters with ``requires_grad=False``
in the chain's layers, not in a step's state: they are never trained, so a ``TrainState`` has no
copy of them. A resume or a start from stored weights therefore restores each stored value into
the tensor the chain holds, in place and in that tensor's own dtype, as
``nn.Module.load_state_dict`` restores a module's buffers: a model rebuilt under another seed,
or built on the meta device (whose buffers the chain holds as their initializers made them,
and its frozen weights as the split's stand-ins), then computes with the stored values. A
buffer the module does not persist (``persistent=False``) is not stored, and keeps its value.

The chain's tensors are the module's own (``functionalize`` copies nothing), so the module sees
the restored values too. Ranks on the threads backend share one chain: they restore one at a
time, after every rank has compared (``load``: its ranks meet in between) or each comparing in
its turn (``restore_from``); the first writes, and the others find the values restored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from ..model.chain import Chain
from .errors import CheckpointError
from .names import StateDictNames
from .regions import Placed, whole

copying = threading.RLock()  # restore_from holds it around restore

# Reads the stored tensor of a key into the given boxes (a Reader's or a weights store's read_into).
ReadInto = Callable[[str, list[Placed]], None]


def _checked(where: str, chain: Chain, names: StateDictNames,
             stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], prefix: str) -> None:
    """Every persistent buffer of ``chain`` stored (under ``prefix + key``), with its shape; else
    refused, naming the key."""
    missing = sorted(key for key in names.buffers if prefix + key not in stored)
    if missing:
        raise CheckpointError(
            f"{where} has no value for the model's buffers or frozen parameters {missing[:8]}: it was saved from "
            "another model (one where they are trainable, or absent); load it for a model built like the one "
            "that saved it"
        )
    for key, (layer, name) in names.buffers.items():
        held = chain[layer].buffers[name]
        shape = stored[prefix + key][0]
        if tuple(shape) != tuple(held.shape):
            raise CheckpointError(
                f"{where}: buffer or frozen parameter {key!r} is {list(shape)} there, {list(held.shape)} in the "
                "model; load it for a model of the configuration that saved it"
            )


def _stored_value(held: torch.Tensor, key: str, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  read_into: ReadInto) -> torch.Tensor:
    shape, dtype = stored[key]
    value = torch.empty(tuple(shape), dtype=dtype)
    read_into(key, [(whole(tuple(shape))[0], value)])
    return value.to(device=held.device, dtype=held.dtype)


def changed_buffers(where: str, chain: Chain, names: StateDictNames,
                    stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], read_into: ReadInto,
                    prefix: str = "") -> list[str]:
    """The keys of the persistent buffers of ``chain`` whose stored value (under ``prefix + key``)
    differs from the chain's, each read and compared on its own (one buffer's bytes at a time); a
    buffer that is not stored, or stored with another shape, is refused, naming its key."""
    _checked(where, chain, names, stored, prefix)
    changed = []
    for key, (layer, name) in names.buffers.items():
        held = chain[layer].buffers[name]
        if not torch.equal(_stored_value(held, prefix + key, stored, read_into), held):
            changed.append(key)
    return changed


def restore_keys(chain: Chain, names: StateDictNames, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 read_into: ReadInto, keys: list[str], prefix: str = "") -> None:
    """Give the chain's buffers ``keys`` their stored values, read and written one at a time (as
    ``nn.Module.load_state_dict``): copied in, or, where the chain holds a tensor that cannot be
    written element by element (an expanded one, as a buffer of a user's may be), the tensor is
    pointed at the stored value. Ranks sharing the chain (threads) take turns: the first writes, the
    others find the values there."""
    with copying, torch.no_grad():
        for key in keys:
            layer, name = names.buffers[key]
            held = chain[layer].buffers[name]
            value = _stored_value(held, prefix + key, stored, read_into)
            if torch.equal(value, held):
                continue  # another rank sharing this chain (threads) restored it already
            if _writable(held):
                held.copy_(value)
            else:
                value = value.contiguous()
                held.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())


def restore_from(where: str, chain: Chain, names: StateDictNames,
                 stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], read_into: ReadInto) -> None:
    """Check and restore in one, one rank at a time, one buffer at a time: for a caller whose ranks
    do not meet between the two (a rank that compares while another points a tensor elsewhere
    could read it half changed)."""
    with copying:
        _checked(where, chain, names, stored, "")
        restore_keys(chain, names, stored, read_into, list(names.buffers))


def _writable(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (an expanded tensor's do)."""
    return all(stride != 0 for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1)
