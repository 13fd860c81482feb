"""A torch.distributed.checkpoint directory's tensors, each rank reading only the bytes it keeps.

DCP's metadata (``.metadata``, read with DCP's own classes only) says, per tensor, its chunks
(boxes of the global tensor) and where each chunk's record lies in which ``.distcp`` file. A
record is ``torch.save`` of the chunk: a zip archive whose tensor data is stored uncompressed,
as raw bytes, in one member. DCP's own reader loads each record whole (``torch.load``); this
reads, of a record, its zip directory and its small pickle (which say where the raw data starts,
and the tensor's dtype, shape, strides and offset in its storage: about a kilobyte), and then
only the contiguous runs of the elements the rank keeps (``record_io.read_box_into``). A record
whose tensor is not laid out row-major in its storage (DCP saves contiguous chunks; another
writer might not) is read whole and loaded by ``torch.load``, as DCP's reader would.

Nothing in a record runs code: the pickle is read by an unpickler that knows only the names
``torch.save`` of one tensor uses. The records carry no checksum a part can be checked against
(the zip's crc32 covers the whole member); a record too short for what its header claims is
refused.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cut import Box
from .errors import CheckpointError
from .file_format import check_unreplaced, marker_of
from .record_io import ReadBuffer, read_box_into
from .regions import Placed, ReadInto, fill
from .save_load import resolve
from .state_dict import read_dcp_metadata

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header


class DcpFiles:
    """A DCP directory's tensors under ``prefix`` (the prefix removed), read by byte ranges."""

    def __init__(self, path: str | os.PathLike[str], prefix: str = "") -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # a shardwise checkpoint an interrupted save left beside its path, as load finds it
        self.path, self.where = resolve(path), f"DCP checkpoint {path}"
        self.marker = marker_of(Path(self.path))  # a shardwise save's: what every read must still be of at the end
        self.metadata = read_dcp_metadata(self.path)
        self.specs = {
            fqn[len(prefix) :]: (fqn, spec)
            for fqn, spec in self.metadata.state_dict_metadata.items()
            if fqn.startswith(prefix) and isinstance(spec, TensorStorageMetadata)
        }

    def check_unreplaced(self) -> None:
        """Refuse what was read where a shardwise save replaced the checkpoint meanwhile (these reads check no
        crc32: a file opened after the replacement gives the next save's values)."""
        if self.marker is not None:
            check_unreplaced(Path(self.path), self.marker)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(spec.size), spec.properties.dtype) for k, (_, spec) in self.specs.items()}

    def read_into(self, key: str, placed: list[Placed]) -> None:
        """Copy the elements of tensor ``key`` in each box of ``placed`` into its view, reading of
        each chunk's record only the bytes that hold them."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        fqn, spec = self.specs[key]
        stored: list[tuple[Box, ReadInto]] = []
        for chunk in spec.chunks:
            info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            box = (tuple(chunk.offsets), tuple(chunk.sizes))
            stored.append((box, _record_reader(self.path, fqn, info, box[1], spec.properties.dtype)))
        fill(self.where, key, tuple(spec.size), placed, stored)


@dataclass(frozen=True)
class _Tensor:
    """What a record's pickle says of its one tensor."""

    key: str  # the storage's member name under ``data/``
    dtype: torch.dtype
    storage_numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _record_reader(path: Path, fqn: str, info: Any, sizes: tuple[int, ...], dtype: torch.dtype) -> ReadInto:
    def read(pieces: list[Placed]) -> None:
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: {fqn} is stored with transforms {info.transform_descriptors}, "
                "which this reader does not undo"
            )
        where = f"{path}: the chunk of {fqn} in {info.relative_path}"
        try:
            f = open(path / info.relative_path, "rb")  # noqa: SIM115 (closed by the with below)
        except OSError as err:
            raise CheckpointError(f"{where} cannot be read: {err}") from None
        with f:
            record = _Window(f, info.offset, info.length)
            try:
                found = _locate(record, where)
            except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, struct.error, ValueError, KeyError) as err:
                raise CheckpointError(f"{where} is not a torch.save record of one tensor ({err})") from None
            if found is None:  # not row-major in its storage: read it whole, as DCP's reader does
                _load_whole(record, where, pieces)
                return
            data_at, tensor = found
            if tensor.size != sizes or tensor.dtype != dtype:
                raise CheckpointError(
                    f"{where} holds {tensor.dtype} {list(tensor.size)}, the metadata says {dtype} "
                    f"{list(sizes)}; the metadata is of another save"
                )
            read_box_into(f, where, info.offset + data_at, sizes, dtype, pieces, None, ReadBuffer())

    return read


def _locate(record: _Window, where: str) -> tuple[int, _Tensor] | None:
    """(where the tensor's first element is in the record, the tensor), or None when its
    elements are not its storage's, row-major, from one offset."""
    with zipfile.ZipFile(record) as archive:
        pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{where} is not a torch.save record (it holds {len(pickles)} data.pkl)")
        root = pickles[0].filename[: -len("data.pkl")]
        tensor = _RecordUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
        if not isinstance(tensor, _Tensor):
            raise CheckpointError(f"{where} holds a {type(tensor).__name__}, not one tensor")
        member = archive.getinfo(f"{root}data/{tensor.key}") if math.prod(tensor.size) else None
    if member is None:
        return 0, tensor  # no elements: nothing will be read
    itemsize = tensor.dtype.itemsize
    if member.compress_type != zipfile.ZIP_STORED or member.file_size != tensor.storage_numel * itemsize:
        return None
    contiguous = torch.empty(tensor.size, device="meta").stride()
    ends = tensor.offset + math.prod(tensor.size) <= tensor.storage_numel
    if not ends or any(s != c for s, c, n in zip(tensor.stride, contiguous, tensor.size, strict=True) if n > 1):
        return None
    record.seek(member.header_offset)
    header = _LOCAL_HEADER.unpack(record.read(_LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: its zip directory points at no member header")
    start = member.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
    return start + tensor.offset * itemsize, tensor


def _load_whole(record: _Window, where: str, pieces: list[Placed]) -> None:
    record.seek(0)
    try:
        box = torch.load(io.BytesIO(record.read()), map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign record: name it
        raise CheckpointError(f"{where} does not load: {err}") from None
    for (at, size), view in pieces:
        view.copy_(box[tuple(slice(o, o + s) for o, s in zip(at, size, strict=True))])


def _rebuild(storage: tuple[str, torch.dtype, int], offset: int, size: Any, stride: Any, *_: Any) -> _Tensor:
    key, dtype, numel = storage
    return _Tensor(key, dtype, numel, int(offset), tuple(int(n) for n in size), tuple(int(s) for s in stride))


class _Storage:
    """Stands for a storage class (``torch.FloatStorage``): carries its dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _RecordUnpickler(pickle.Unpickler):
    """Reads the pickle ``torch.save`` writes of one tensor, building only a description of it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            try:  # as torch.load(weights_only=True) reads a storage class's name
                return _Storage(torch.serialization.StorageType(name).dtype)
            except KeyError:
                pass
        raise pickle.UnpicklingError(f"the record refers to {module}.{name}, which torch.save of a tensor does not")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError(f"the record refers to storage {pid!r}, not to one of its own")
        return str(pid[2]), pid[1].dtype, int(pid[4])


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own (a record)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f, self._offset, self._length, self._at = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._at, 2: self._length}[whence]
        self._at = min(max(base + offset, 0), self._length)
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._at)
        if n <= 0:
            return 0
        self._f.seek(self._offset + self._at)
        got = self._f.readinto(view[:n]) or 0
        self._at += got
        return got
