"""A directory of safetensors files as ``save_pretrained`` writes it, read box by box.

``model.safetensors``, or shards named by ``model.safetensors.index.json``'s weight map.
A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor its
dtype, shape and byte range in the data after the header), then each tensor's raw row-major
bytes. Reading the header is all a load needs to find any element, so this reads it directly
and then only the contiguous runs of the elements a rank keeps (``safe_open``'s mmap would
serve the same pages, but its reads cannot be bounded or counted). The format carries no
checksums: what can be checked is checked (the header's ranges against the tensor sizes and
the file's length, the weight map against the files' headers).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .record_io import ReadBuffer, read_box_into
from .regions import Placed, fill

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    file: Path
    offset: int  # of the tensor's first byte in the file
    shape: tuple[int, ...]
    dtype: torch.dtype


class SafetensorsFiles:
    """The tensors of a ``save_pretrained`` directory, by state_dict key (headers read at once)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.where = f"safetensors weights {self.directory}"
        files, weight_map = self._files()
        absent_files = [name for name in files if not (self.directory / name).is_file()]
        if absent_files:
            raise CheckpointError(
                f"{self.where}: {INDEX} names {absent_files[:8]}, which are not there; copy every shard file "
                "the index lists (a download or a copy was cut short?)"
            )
        self.entries: dict[str, Entry] = {}
        for name in files:
            for key, entry in _header(self.directory / name).items():
                if weight_map is not None and weight_map.get(key) != name:
                    raise CheckpointError(
                        f"{self.where}: {name} holds {key!r}, which {INDEX} places in "
                        f"{weight_map.get(key)!r}; the index is of another save"
                    )
                self.entries[key] = entry
        absent = sorted(set(weight_map or ()) - set(self.entries))
        if absent:
            raise CheckpointError(
                f"{self.where}: {INDEX} lists {absent[:8]}, which no file holds; "
                "a shard file is missing or of another save"
            )

    def _files(self) -> tuple[list[str], dict[str, str] | None]:
        index = self.directory / INDEX
        if (self.directory / SINGLE).is_file():  # before an index, as transformers' from_pretrained reads
            return [SINGLE], None
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(
                    f"{self.where}: {INDEX} is not a safetensors index ({err})"
                ) from None
            return sorted(set(weight_map.values())), dict(weight_map)
        raise CheckpointError(
            f"{self.where}: neither {SINGLE} nor {INDEX} is there; pass the directory "
            "model.save_pretrained(directory) wrote"
        )

    def read_into(self, key: str, placed: list[Placed]) -> None:
        """Copy the elements of tensor ``key`` in each box of ``placed`` into its view, reading only
        the contiguous runs of the file that hold them."""
        entry = self.entries[key]

        def read(pieces: list[Placed]) -> None:
            with open(entry.file, "rb") as f:
                read_box_into(f, f"{self.where}: {entry.file.name} ({key})", entry.offset,
                              entry.shape, entry.dtype, pieces, None, ReadBuffer())

        fill(self.where, key, entry.shape, placed, [(((0,) * len(entry.shape), entry.shape), read)])


def _header(path: Path) -> dict[str, Entry]:
    """A safetensors file's tensors, once its header's byte ranges fit the tensors and the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: not a safetensors file (its header length {length} does not fit)"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: its safetensors header is not JSON ({err})") from None
    out: dict[str, Entry] = {}
    for key, item in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(item.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{path}: {key!r} has dtype {item.get('dtype')!r}, which this reader does not know"
            )
        shape = tuple(int(n) for n in item["shape"])
        begin, end = (int(x) for x in item["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or 8 + length + end > size:
            raise CheckpointError(
                f"{path}: {key!r} {list(shape)} {item['dtype']} claims bytes {begin}..{end} of "
                f"the data, which do not fit its {nbytes} bytes or the file; the file is corrupt"
            )
        out[key] = Entry(path, 8 + length + begin, shape, dtype)
    return out
