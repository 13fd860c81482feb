"""The files of a checkpoint directory, written so that torch.distributed.checkpoint can read them.

::

    PATH/
      __0_0.distcp, __1_0.distcp, ...  each rank's tensors, one ``torch.save`` record after another
                                        (DCP's FileSystemWriter layout)
      rank0.json, rank1.json, ...       each rank's index: per record the tensor's name, its box
                                        (offsets, sizes) in the global tensor, byte offset, length, crc32
      shardwise.json                    the checkpoint: format version, step count, loss scale, mesh,
                                        stack, every tensor's global shape and dtype, the parameters'
                                        shard specs, the optimizer state's layout (and a record of its
                                        containers and its update's name: opt_structure.py)
      .metadata                         the same index as DCP's ``Metadata`` (a pickle, for DCP's reader)
      COMMITTED                         written last: every file's size, and the sha256 of every
                                        file but the rank files (whose records the crc32s cover)

Every file shardwise reads is verified before its content is used: each JSON file carries
``"sha256"``, the digest of its canonical content (sorted keys, no spaces) without that key,
and the marker's digests tie the files together (a rank index from another save, each one
consistent in itself, is refused too); each record's bytes match the crc32 in its verified
index, and each 64 KiB chunk of its raw data the chunk's crc32 there (a load reads only the
chunks it needs: see ``record_io``). Format version 1 (before checksums) still loads, with a warning that it cannot be
verified.

shardwise reads only the JSON files and the records, each with
``torch.load(weights_only=True)``: loading executes no code from the file (DCP's own
reader unpickles ``.metadata``). Tensor names are DCP's flattened keys:
``model.<state_dict key>`` for the module's parameters and buffers (so
``dcp.load({"model": module.state_dict()})`` fills a plain module) and
``optim.<state path>.<key>`` / ``optim.<state path>`` for the optimizer state.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError as CheckpointError  # re-exported: callers import it from here
from .record_io import RawData, ReadBuffer, contiguous_copy, raw_data, read_box_into
from .regions import Placed, ReadInto, fill, whole

FORMAT = "shardwise-checkpoint"
VERSION = 2  # 2: checksums in every JSON file and in the marker; 1: sizes only
UNVERIFIED_VERSION = 1  # still read, with a warning (see check_committed)
META, COMMITTED, DCP_META = "shardwise.json", "COMMITTED", ".metadata"
CHECKSUM = "sha256"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def index_file(rank: int) -> str:
    return f"rank{rank}.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Record:
    """One saved box of one tensor: where its bytes are (and, saved since ranged reads, where its
    raw data is in them, with a crc32 per chunk: see ``record_io``)."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int
    raw: RawData | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"fqn": self.fqn, "offsets": list(self.offsets), "sizes": list(self.sizes),
               "offset": self.offset, "length": self.length, "crc32": self.crc32}
        if self.raw is not None:
            out.update(data_offset=self.raw.offset, chunk_crc32s=list(self.raw.crc32s))
        return out

    @classmethod
    def from_json(cls, item: Mapping[str, Any], file: str) -> Record:
        raw = None
        if "data_offset" in item:
            raw = RawData(int(item["data_offset"]), tuple(map(int, item["chunk_crc32s"])))
        return cls(str(item["fqn"]), tuple(item["offsets"]), tuple(item["sizes"]), file,
                   int(item["offset"]), int(item["length"]), int(item["crc32"]), raw)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX: the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(value: Any) -> str:
    """sha256 of the canonical JSON of ``value``: what the file says, whatever its whitespace."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write ``value`` with its checksum inside (``read_json`` verifies it), durably."""
    assert CHECKSUM not in value, f"{path.name}: {CHECKSUM!r} is the checksum's key"
    with open(path, "w") as f:
        json.dump({**value, CHECKSUM: _digest(value)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_rank(directory: Path, rank: int, boxes: Iterable[tuple[str, tuple[int, ...], torch.Tensor]],
               tensors: Mapping[str, Any], fault: Any = None, save_id: str | None = None) -> int:
    """Write one rank's boxes (name, offsets, host tensor) and their index, with the global shape and
    dtype of each tensor they belong to (``tensors``) and the id of the save writing them (``save_id``,
    which the commit checks: another save to the same path may write into the same directory);
    return the bytes written."""
    name = data_file(rank)
    records: list[Record] = []
    with open(directory / name, "wb") as f:
        for fqn, offsets, saved in boxes:
            tensor = contiguous_copy(saved)
            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            data = buffer.getbuffer()
            raw = raw_data(data, tensor)
            offset = f.tell()
            if fault is not None and len(records) == 1:  # a test's crash point: some records on disk
                f.flush()
                fault("rank-file-partial")
            f.write(data)
            records.append(Record(fqn, offsets, tuple(tensor.shape), name, offset, len(data),
                                  zlib.crc32(data), raw))
        f.flush()
        os.fsync(f.fileno())
        total = f.tell()
    index = {"rank": rank, "file": name, "bytes": total, "tensors": dict(tensors),
             "records": [r.to_json() for r in records]}
    write_json(directory / index_file(rank), index if save_id is None else {**index, "save": save_id})
    return total


def write_commit_marker(directory: Path) -> None:
    """``COMMITTED``: every other file's size and, but for the rank files, its sha256 (their
    records' crc32s, in the verified indexes, cover them: hashing would read every byte again)."""
    files: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.name != COMMITTED:
            data = path.name.endswith(".distcp")
            digest = None if data else _file_digest(path)
            files[path.name] = {"bytes": path.stat().st_size, CHECKSUM: digest}
    write_json(directory / COMMITTED, {"version": VERSION, "files": files})


# -- reading -----------------------------------------------------------------------------------
def _modified(path: Path, what: str, how: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path.parent}: {path.name} ({what}) was modified or corrupted after the "
        f"save: {how}; restore the file from a copy of this checkpoint, or load another checkpoint"
    )


def _load_json(path: Path, what: str, listed: str | None = None) -> Any:
    """The JSON in ``path``, read once; with ``listed`` (the sha256 the commit marker lists for it), only
    if those bytes are the ones the marker vouches for."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is missing ({what})") from None
    if listed is not None and hashlib.sha256(raw).hexdigest() != listed:
        raise _modified(path, what, f"its {CHECKSUM} is not the one {COMMITTED} lists")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _modified(path, what, f"it is not JSON ({err})") from None


def read_json(path: Path, what: str, *, verify: bool = True, listed: str | None = None) -> dict[str, Any]:
    """A JSON file of the checkpoint, once its content matches its checksum (``verify=False``: a
    format-version-1 file, which has none) and, with ``listed``, the sha256 its commit marker lists."""
    value = _load_json(path, what, listed)
    if not isinstance(value, dict):
        raise _modified(path, what, f"it holds a {type(value).__name__}, not an object")
    if not verify:
        return value
    stored = value.pop(CHECKSUM, None)
    if stored is None:
        raise _modified(path, what, f"it carries no {CHECKSUM} checksum, which every file of a "
                        f"format version {VERSION} checkpoint has")
    if _digest(value) != stored:
        raise _modified(path, what, f"its content does not match its {CHECKSUM} checksum")
    return value


def _not_a_directory(path: Path) -> str:
    """What ``path`` is, when a checkpoint directory was expected."""
    if not path.exists():
        return f"no checkpoint at {path}: it does not exist"
    what = "a file" if path.is_file() else "not a directory"
    return (
        f"no checkpoint at {path}: it is {what}, and a shardwise checkpoint is a directory (the "
        "one sw.checkpoint.save wrote); a file from torch.save reads back with torch.load"
    )


def _written_by_a_save(directory: Path) -> bool:
    """Whether a save began writing here (its metadata or a rank's index or data file)."""
    names = [p.name for p in directory.iterdir()]
    return META in names or any(
        (n.startswith("rank") and n.endswith(".json")) or n.endswith(".distcp") for n in names
    )


def _save_file(name: str) -> bool:
    """Whether a file of this name is one a save writes (its metadata, marker, a rank's index or data)."""
    return name in (META, COMMITTED, DCP_META) or (name.startswith("rank") and name.endswith(".json")) or (
        name.endswith(".distcp"))


def not_replaceable(target: Path) -> str | None:
    """Why a save must not replace what is at ``target``, or None. Through a symbolic link a save would
    move aside, and then delete, the checkpoint the link points to; what is not a checkpoint (a
    user's files, a torch.distributed.checkpoint directory) ``overwrite=True`` would delete."""
    if target.is_symlink():
        return (
            f"{target} is a symbolic link (to {os.readlink(target)}): a save moves the checkpoint at its path aside "
            "and deletes it once the new one is in place, which through a link is the checkpoint it points to; save "
            "to a path of its own and point the link at it once the save returns"
        )
    if not target.exists():
        return None
    if not target.is_dir():
        return f"{target} is a file, not a shardwise checkpoint: a save replaces only a checkpoint; save to a new path"
    names = sorted(p.name for p in target.iterdir())
    if not names:
        return None
    if (target / COMMITTED).is_file() or (target / META).exists() or _written_by_a_save(target):
        # A checkpoint, or a save's start: replaced whole. Not with files of the user's kept in it (notes, a
        # config, an eval's results), which the replacement would delete with it.
        others = [n for n in names if not _save_file(n)]
        if not others:
            return None
        return (
            f"{target} holds a shardwise checkpoint and files no save wrote ({others[:5]}"
            f"{' ...' if len(others) > 5 else ''}), which a save (overwrite=True) replacing it would delete with it; "
            "move them out of the checkpoint's directory first, or save to a new path"
        )
    return (
        f"{target} is not a shardwise checkpoint: it holds none of its files ({META}, {COMMITTED}, rank*.json), but "
        f"{names[:5]}{' ...' if len(names) > 5 else ''}, which a save (overwrite=True) would delete; save to a new "
        "path, or move them away first"
    )


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as its marker listed it when a load read the marker: what each later read
    of the directory is checked against. Another process's save to the same path (``overwrite=True``)
    may put a new checkpoint in the directory's place meanwhile; a read that meets the new one's files
    then fails and :meth:`replaced_error` says why, and :meth:`check_unreplaced` once every file is opened,
    instead of mixing two saves (the step count of one, the tensors of the other)."""

    directory: Path
    meta: dict[str, Any]
    files: Mapping[str, tuple[int, str | None]]  # name -> (bytes, sha256; None for a data file)
    marker: str  # the sha256 of the marker's bytes: the same for every rank that read the same save

    def listed(self, name: str) -> str | None:
        """The sha256 the marker lists for file ``name`` (None: a data file, or a version-1 checkpoint)."""
        return self.files.get(name, (0, None))[1]

    def replaced_error(self, err: Exception) -> Exception:
        """``err`` (a read of this checkpoint that failed), or, where the checkpoint was replaced since its
        marker was read, the error that says so."""
        return _replaced_error(self.directory, self.marker, err)

    def check_unreplaced(self) -> None:
        """Refuse what was read if the marker at the path is no longer the one read first: called once every
        file is opened, it catches a file opened after a replacement whose own checks passed (a version-1
        checkpoint's indexes, which its marker does not digest; a DCP reader, which checks no crc32)."""
        check_unreplaced(self.directory, self.marker)


def check_unreplaced(directory: Path, marker: str) -> None:
    """Raise the error saying the checkpoint at ``directory`` was replaced while it was read, unless its marker
    is still the one of sha256 ``marker``."""
    sentinel = CheckpointError("")
    error = _replaced_error(directory, marker, sentinel)
    if error is not sentinel:
        raise error


def marker_of(directory: Path) -> str | None:
    """The sha256 of the commit marker in ``directory`` (None where it has none: a torch DCP directory)."""
    try:
        with open(directory / COMMITTED, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _replaced_error(directory: Path, marker: str, err: Exception) -> Exception:
    """``err``, or where the marker at ``directory`` is no longer the one of sha256 ``marker`` (or is gone):
    the error that says the checkpoint was replaced while it was read."""
    if marker_of(directory) == marker:
        return err
    return CheckpointError(
        f"checkpoint {directory} was replaced while this load read it: another process saved to it "
        "(overwrite=True) meanwhile, and its files are no longer those its commit marker listed when the load "
        "began; nothing of it is used (a mix of two saves); load again once that save has returned, or load a "
        "path no save replaces while it is read"
    )


def check_committed(directory: Path) -> dict[str, Any]:
    """The checkpoint's metadata, once its commit marker and every file it lists are as written."""
    return open_committed(directory).meta


def open_committed(directory: Path) -> Committed:
    """The checkpoint's metadata and its commit marker, once the marker and every file it lists are as
    written (each read of a file after this is checked against the marker read here: :class:`Committed`)."""
    if not directory.is_dir():
        raise CheckpointError(_not_a_directory(directory))
    if not (directory / META).exists() and (directory / DCP_META).is_file():
        raise CheckpointError(
            f"{directory} is a torch.distributed.checkpoint directory, not a shardwise checkpoint: start a step "
            "from it with init_from_state_dict(step, read_dcp_state_dict(path, prefix), mesh)"
        )
    if not (directory / COMMITTED).is_file() and not _written_by_a_save(directory):
        listed = sorted(p.name for p in directory.iterdir())
        raise CheckpointError(
            f"{directory} is not a shardwise checkpoint: it holds none of its files ({META}, "
            f"{COMMITTED}, rank*.json), but {listed[:5] or 'nothing'}"
            f"{' ...' if len(listed) > 5 else ''}; pass the directory sw.checkpoint.save wrote"
        )
    if not (directory / COMMITTED).is_file():
        raise CheckpointError(
            f"checkpoint {directory} is not committed: {COMMITTED} is missing, so a save was interrupted "
            "before every rank had written its files; load the previous checkpoint"
        )
    version, files, marker = _read_marker(directory)
    what = "the checkpoint's metadata"
    try:
        for name, (size, digest) in files.items():
            _check_listed(directory, name, size, digest)
        meta = read_json(directory / META, what, verify=version != UNVERIFIED_VERSION,
                         listed=files.get(META, (0, None))[1])
    except (CheckpointError, OSError) as err:  # (a file gone or of other bytes: replaced since?)
        raise _replaced_error(directory, marker, err)  # noqa: B904 (the read's error is the context of the new one)
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {directory}: {META} is not a shardwise checkpoint's (format {meta.get('format')!r})"
        )
    if meta.get("version") not in (UNVERIFIED_VERSION, VERSION):
        raise CheckpointError(
            f"checkpoint {directory}: {META} has format version {meta.get('version')!r}; this "
            f"shardwise reads versions {UNVERIFIED_VERSION} and {VERSION}: load it with the "
            "shardwise that wrote it and export it (sw.checkpoint.full_state_dict)"
        )
    if meta["version"] != version:
        raise _modified(directory / META, what,
                        f"it says format version {meta['version']}, {COMMITTED} says {version}")
    if version == UNVERIFIED_VERSION:
        warnings.warn(
            f"checkpoint {directory} is format version {UNVERIFIED_VERSION}, whose index and "
            "metadata files carry no checksums: a changed or corrupted one would load wrong values "
            f"unnoticed; save it again (with this shardwise) to get a verified version {VERSION} "
            "checkpoint",
            UserWarning, stacklevel=3,
        )
    return Committed(directory, meta, files, marker)


def _read_marker(directory: Path) -> tuple[int, dict[str, tuple[int, str | None]], str]:
    """The marker's format version, its files (name -> (bytes, sha256 or None)) and its own sha256,
    from one read of it."""
    path = directory / COMMITTED
    try:
        with open(path, "rb") as f:
            raw_bytes = f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"checkpoint {directory}: {COMMITTED} is missing (the commit marker)") from None
    digest = hashlib.sha256(raw_bytes).hexdigest()
    try:
        raw = json.loads(raw_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _modified(path, "the commit marker", f"it is not JSON ({err})") from None
    old = raw.get("files") if isinstance(raw, dict) and set(raw) == {"files"} else None
    if isinstance(old, dict) and all(type(size) is int for size in old.values()):
        return UNVERIFIED_VERSION, {name: (size, None) for name, size in old.items()}, digest  # sizes only
    if not isinstance(raw, dict):
        raise _modified(path, "the commit marker", f"it holds a {type(raw).__name__}, not an object")
    stored = raw.pop(CHECKSUM, None)
    if stored is None:
        raise _modified(path, "the commit marker", f"it carries no {CHECKSUM} checksum, which every file of a "
                        f"format version {VERSION} checkpoint has")
    if _digest(raw) != stored:
        raise _modified(path, "the commit marker", f"its content does not match its {CHECKSUM} checksum")
    try:
        files = raw["files"]
        return int(raw["version"]), {
            str(name): (int(entry["bytes"]), entry[CHECKSUM]) for name, entry in files.items()
        }, digest
    except (KeyError, TypeError, ValueError) as err:
        raise _modified(path, "the commit marker", f"it lacks {err}") from None


def _check_listed(directory: Path, name: str, size: int, digest: str | None) -> None:
    """One file the marker lists: present, of its size and (where listed) of its sha256."""
    path = directory / name
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory}: {name} is missing (listed in {COMMITTED} with {size} bytes); "
            "restore it from a copy of this checkpoint, or load another checkpoint"
        )
    if path.stat().st_size != size:
        raise CheckpointError(
            f"checkpoint {directory}: {name} has {path.stat().st_size} bytes, {COMMITTED} says "
            f"{size}: the file is truncated or was changed after the save; restore it from a copy "
            "of this checkpoint, or load another checkpoint"
        )
    if digest is not None and _file_digest(path) != digest:
        how = f"its {CHECKSUM} is not the one {COMMITTED} lists"
        raise _modified(path, f"listed in {COMMITTED}", how)


def verified(meta: Mapping[str, Any]) -> bool:
    """Whether the checkpoint of ``meta`` carries checksums (format version 2 on)."""
    return meta.get("version") != UNVERIFIED_VERSION


def read_records(directory: Path, ranks: int, *, verify: bool = True,
                 committed: Committed | None = None) -> dict[str, list[Record]]:
    """Every rank's records, by tensor name (``verify=False``: a version-1 checkpoint's; with ``committed``,
    each index only as the commit marker read then lists it)."""
    by_fqn: dict[str, list[Record]] = {}
    for rank in range(ranks):
        listed = None if committed is None else committed.listed(index_file(rank))
        index = read_json(directory / index_file(rank), f"rank {rank}'s index", verify=verify, listed=listed)
        for item in index["records"]:
            record = Record.from_json(item, index["file"])
            by_fqn.setdefault(record.fqn, []).append(record)
    return by_fqn


class Reader:
    """Tensors, whole or in part, from a committed checkpoint's records: of each record only the
    chunks that hold what is asked for, each checked against its crc32 (a record saved without
    chunk crc32s is read whole, checked against its crc32)."""

    def __init__(self, committed: Committed) -> None:
        self.committed = committed
        self.directory, meta = committed.directory, committed.meta
        self.tensors: dict[str, Any] = meta["tensors"]
        try:
            self.records = read_records(self.directory, int(meta["world"]), verify=verified(meta),
                                        committed=committed)
        except CheckpointError as err:
            raise committed.replaced_error(err)  # noqa: B904 (the read's error is the context of the new one)
        self._files: dict[str, Any] = {}
        self._buffer = ReadBuffer()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, record: Record) -> Any:
        f = self._files.get(record.file)
        if f is None:
            f = self._files[record.file] = open(self.directory / record.file, "rb")  # noqa: SIM115 (kept open across records; close() ends it)
        return f

    def _where(self, record: Record) -> str:
        return f"checkpoint {self.directory}: {record.file} at byte {record.offset} ({record.fqn})"

    def _read(self, record: Record) -> torch.Tensor:
        f = self._file(record)
        f.seek(record.offset)
        data = f.read(record.length)
        where = self._where(record)
        if len(data) != record.length or zlib.crc32(data) != record.crc32:
            raise CheckpointError(f"{where}: the record is truncated or corrupt (its crc32 does not match)")
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointError(f"{where}: the record does not load: {err}") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != record.sizes:
            raise CheckpointError(
                f"{where}: holds {type(t).__name__} {getattr(t, 'shape', '')}, expected a box of {record.sizes}"
            )
        return t

    def _read_into(self, record: Record, dtype: torch.dtype) -> ReadInto:
        def read(pieces: list[Placed]) -> None:
            if record.raw is None:
                t = self._read(record)
                for (at, size), view in pieces:
                    view.copy_(t[tuple(slice(o, o + s) for o, s in zip(at, size, strict=True))])
                return
            read_box_into(self._file(record), self._where(record), record.offset + record.raw.offset,
                          record.sizes, dtype, pieces, record.raw.crc32s, self._buffer)
        return read

    def _spec(self, fqn: str) -> Any:
        spec = self.tensors.get(fqn)
        if spec is None:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {fqn!r}")
        return spec

    def read_into(self, fqn: str, placed: list[Placed]) -> None:
        """Copy the elements of tensor ``fqn`` in each box of ``placed`` into its view, reading of
        each record only the chunks that hold them (see ``record_io``)."""
        spec = self._spec(fqn)
        dtype = dtype_of(spec["dtype"], fqn)
        stored = [((r.offsets, r.sizes), self._read_into(r, dtype)) for r in self.records.get(fqn, [])]
        try:
            fill(f"checkpoint {self.directory}", fqn, spec["shape"], placed, stored)
        except (CheckpointError, OSError) as err:  # (a data file gone or of other bytes: replaced since?)
            raise self.committed.replaced_error(err)  # noqa: B904 (the read's error is the context of the new one)

    def full(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn``, assembled from the boxes every rank saved of it."""
        spec = self._spec(fqn)
        out = torch.empty(tuple(spec["shape"]), dtype=dtype_of(spec["dtype"], fqn))
        self.read_into(fqn, [(whole(spec["shape"])[0], out)])
        return out


def dcp_metadata(meta: Mapping[str, Any], records: Mapping[str, list[Record]], aliases: Mapping[str, str]) -> Any:
    """DCP's ``Metadata`` for the records, so ``torch.distributed.checkpoint.load`` reads the checkpoint;
    an alias (a tied weight's other name) points at its parameter's bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    names = {**{fqn: fqn for fqn in meta["tensors"]}, **aliases}
    for fqn, source in names.items():
        spec = meta["tensors"][source]
        chunks = []
        for r in records.get(source, []):
            chunks.append(ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)))
            storage[MetadataIndex(fqn, torch.Size(r.offsets))] = _StorageInfo(r.file, r.offset, r.length)
        properties = TensorProperties(dtype=dtype_of(spec["dtype"], fqn))
        state[fqn] = TensorStorageMetadata(properties, torch.Size(spec["shape"]), chunks)
        planner[fqn] = tuple(fqn.split(".", 1))
    return Metadata(state, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(), version="1.0.0")


def write_dcp_metadata(directory: Path, metadata: Any) -> None:
    with open(directory / DCP_META, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
