"""Safetensors files written tensor by tensor, as their bytes arrive, cut into shards as ``save_pretrained`` cuts them.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor its dtype,
shape and byte range in the data), then the tensors' raw bytes. Every shape and dtype is known
before the first byte is (the layout says them), so each file's header is written first and each
tensor's bytes go straight after the last one's: nothing waits in memory for the rest of its file.
The header lists the tensors in the order their bytes come (the format wants the ranges to tile the
data; the reader sorts them by offset, so any key order loads).

Shards follow transformers' ``save_pretrained``: ``model.safetensors`` when everything fits one,
else ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``; a file is
closed when the next tensor would take it past ``max_shard_size`` bytes, and a tensor larger than
that is a file of its own. ``max_shard_size`` is parsed as transformers (huggingface_hub) parses it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from .file_format import fsync_dir
from .safetensors_files import _DTYPES, SINGLE

_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the files a sharded save_pretrained writes


def parse_max_shard_size(call: str, value: Any) -> int:
    """``max_shard_size`` in bytes: a positive int, or digits and a unit (``"5GB"``, ``"500MB"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{call}: max_shard_size is a {type(value).__name__}, not a positive int (bytes) or a size "
                        'string such as "5GB" or "500MB"')
    if isinstance(value, int):
        size = value
    else:
        text = value.strip()
        try:
            size = int(float(text[:-2].strip()) * _UNITS[text[-2:].upper()])
        except (KeyError, ValueError, OverflowError):  # OverflowError: "infGB"
            raise ValueError(f"{call}: max_shard_size={value!r} is not a size: write digits and one of the units "
                             f'{sorted(_UNITS)} ("5GB", "500MB"), or an int of bytes') from None
    if size <= 0:
        raise ValueError(f"{call}: max_shard_size={value!r} is not positive; pass the most bytes one file may hold")
    return size


@dataclass(frozen=True)
class Planned:
    """One tensor of the export: its key, shape and dtype, known before its bytes are."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def cut_into_files(tensors: Sequence[Planned], max_shard_size: int) -> list[tuple[str, list[Planned]]]:
    """The files, each with its tensors in order: one ``model.safetensors``, or numbered shards."""
    shards: list[list[Planned]] = []
    size = 0
    for t in tensors:
        if not shards or (shards[-1] and size + t.nbytes > max_shard_size):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) <= 1:
        return [(SINGLE, shards[0] if shards else [])]
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards)]


def header_bytes(tensors: Sequence[Planned]) -> bytes:
    """The length prefix and JSON header of a file of ``tensors``, their bytes in this order."""
    if any(t.dtype not in _NAMES for t in tensors):
        bad = next(t for t in tensors if t.dtype not in _NAMES)
        raise ValueError(f"{bad.key} is {bad.dtype}, which safetensors does not store")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in tensors:
        header[t.key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text


def write_tensor(f: IO[bytes], tensor: torch.Tensor) -> None:
    """Append ``tensor``'s raw row-major bytes (a host copy of it, contiguous)."""
    host = tensor.detach().to("cpu").contiguous()
    f.write(host.reshape(-1).view(torch.uint8).numpy().data)


class StreamWriter:
    """Writes the planned tensors into ``directory`` as they are handed over, in plan order."""

    def __init__(self, directory: Path, files: list[tuple[str, list[Planned]]]) -> None:
        self.directory, self.files = directory, files
        self._order = [(name, t) for name, tensors in files for t in tensors]
        self._next = 0
        self._open: tuple[str, IO[bytes]] | None = None

    def put(self, key: str, tensor: torch.Tensor) -> None:
        """The next tensor of the plan: it must be ``key`` with the planned shape and dtype."""
        name, planned = self._order[self._next]
        if key != planned.key or tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
            raise RuntimeError(
                f"the export planned {planned.key!r} {list(planned.shape)} {planned.dtype} next, but got {key!r} "
                f"{list(tensor.shape)} {tensor.dtype} (a conversion that depends on values, not shapes?)"
            )
        if self._open is None or self._open[0] != name:
            self._close()
            f = open(self.directory / name, "wb")  # noqa: SIM115 (closed by _close, across calls)
            self._open = (name, f)
            f.write(header_bytes(next(ts for n, ts in self.files if n == name)))
        write_tensor(self._open[1], tensor)
        self._next += 1

    def finish(self) -> dict[str, Any] | None:
        """Close the last file (files with no tensor are written whole) and return the index, or None
        for a single file; every file is fsynced."""
        if self._next != len(self._order):
            raise RuntimeError(f"the export wrote {self._next} of its {len(self._order)} tensors")
        self._close()
        for name, tensors in self.files:
            if not tensors:  # a model with no tensors: the header alone
                (self.directory / name).write_bytes(header_bytes(tensors))
        fsync_dir(self.directory)
        if len(self.files) == 1:
            return None
        return {
            "metadata": {"total_size": sum(t.nbytes for _, ts in self.files for t in ts)},
            "weight_map": {t.key: name for name, ts in self.files for t in ts},
        }

    def abort(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def _close(self) -> None:
        if self._open is not None:
            f = self._open[1]
            f.flush()
            os.fsync(f.fileno())
            f.close()
            self._open = None


def write_index(path: Path, index: dict[str, Any]) -> None:
    """The index as transformers writes it (sorted keys, indent 2), durably."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
