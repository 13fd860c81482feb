"""Every rank builds the same step: checked once, at ``init``, before anything can diverge.

SPMD programs compute the step on every rank from the same code, but a rank
can still end up with another one (a flag read differently, an environment
variable, a schedule file that differs on one host). The ranks would then run
different Plans and hang, or train on silently wrong. So ``Step.init`` gathers
a fingerprint of what the rank built (the transform stack, the schedule, the
mesh, the model's structure and code, its parameters' names, shapes, dtypes and
values, its buffers, the optimizer and the loss) from every rank and refuses a
mismatch, naming the ranks that differ from rank 0, what differs, and how (both
ranks' text of it, around the first difference; of a part listed by items, such
as one digest per parameter, the first item in which they differ).

Objects are fingerprinted by :func:`stable_text`: the same text on every rank
that built the same thing, with no memory address in it (a ``repr`` has them).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...collectives import all_gather
from ...collectives.mesh import Mesh
from ..torch_api import is_fake
from .code_text import code_digest, global_values, module_text, private_settings, qualified_name
from .metrics import tensor_digest


def fingerprint(parts: Mapping[str, str]) -> tuple[int, ...]:
    """One 52-bit digest per part (exact in float64, so it can travel in a collective)."""
    return tuple(_digest(text) for text in parts.values())


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big") >> 4


def check_ranks_agree(mesh: Mesh, parts: Mapping[str, object], device: torch.device) -> None:
    """Gather every rank's fingerprint of ``parts`` (an all-gather per mesh axis) and refuse a
    mismatch on every rank alike, naming the ranks and the parts that differ, and showing how: a
    part that is a text as it is, an object by :func:`stable_text`, a mapping of items ({item:
    text}) by the first item in which each rank differs from rank 0."""
    if mesh.size == 1:
        return
    items = {name: _items(value) for name, value in parts.items()}
    texts = {name: "\n".join(_item_text(listed, i) for i in range(len(listed))) for name, listed in items.items()}
    digests = torch.tensor(fingerprint(texts), dtype=torch.float64, device=device)
    rows: Sequence[Any] = _gather(mesh, digests).tolist()
    names = list(texts)
    differing = {
        rank: [names[i] for i, (a, b) in enumerate(zip(row, rows[0], strict=True)) if a != b]
        for rank, row in enumerate(rows)
        if row != rows[0]
    }
    if not differing:
        return
    # Every rank found the same differences: the exchanges below are the same on every rank.
    shown = [name for name in names if any(name in what for what in differing.values())]
    first = _first_differing_items(mesh, [items[name] for name in shown], device)
    wanted = sorted({(shown.index(n), first[rank][shown.index(n)]) for rank, what in differing.items() for n in what})
    got = gather_texts(mesh, [text for part, at in wanted for text in _item(items[shown[part]], at)], device)

    def contrast(rank: int, name: str) -> str:
        part = shown.index(name)
        k = 2 * wanted.index((part, first[rank][part]))
        (item, text), (item_0, text_0) = got[rank][k : k + 2], got[0][k : k + 2]
        if item == item_0:  # the same item, another text: the item, and how its texts differ
            return _contrast(f"{name}, {item}" if item else name, text_0, text)
        return _contrast(name, f"{item_0}: {text_0}", f"{item}: {text}")  # another item there

    detail = "; ".join(
        f"rank {rank} differs from rank 0 in its {', '.join(what)} (" + "; ".join(contrast(rank, n) for n in what) + ")"
        for rank, what in differing.items()
    )
    raise ValueError(
        f"the ranks built different steps: {detail}. Every rank must build the same step, "
        "schedule, mesh, optimizer, loss, model, parameters and seed: build them from the same code "
        "and inputs on every rank"
    )


def _items(value: object) -> list[tuple[str, str]]:
    """A part as (item, text) pairs: a text or an object is one item, named ''."""
    if isinstance(value, str):
        return [("", value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return list(value.items())
    return [("", stable_text(value))]


def _item_text(listed: list[tuple[str, str]], at: int) -> str:
    item, text = _item(listed, at)
    return f"{item}: {text}" if item else text


def _item(listed: list[tuple[str, str]], at: int) -> tuple[str, str]:
    """Item ``at`` of a part as (its name, its text); past the end of the list, ('(none)', '')."""
    return listed[at] if at < len(listed) else ("(none)", "")


def _first_differing_items(mesh: Mesh, parts: list[list[tuple[str, str]]], device: torch.device) -> list[list[int]]:
    """For every rank and each of ``parts``, the index of the first item (name and text) in which the
    rank's list differs from rank 0's: every rank's item digests, gathered (padded with -1 to the
    longest list: a rank with fewer items differs where its list ends)."""
    counts = _gather(mesh, torch.tensor([len(p) for p in parts], dtype=torch.int64, device=device)).cpu()
    width = max(1, int(counts.max()))
    table = torch.full((len(parts), width), -1.0, dtype=torch.float64)
    for i, listed in enumerate(parts):
        if listed:
            digests = [float(_digest(f"{item}: {text}")) for item, text in listed]
            table[i, : len(listed)] = torch.tensor(digests, dtype=torch.float64)
    every = _gather(mesh, table.to(device)).cpu()

    def first(rank: int, part: int) -> int:
        unequal = (every[rank, part] != every[0, part]).nonzero()
        return int(unequal[0]) if len(unequal) else 0

    return [[first(rank, part) for part in range(len(parts))] for rank in range(every.shape[0])]


def _gather(mesh: Mesh, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's ``mine``, stacked in rank order."""
    gathered = mine[None]
    for axis in reversed(mesh.axis_names):  # row-major: the last axis varies fastest
        gathered = all_gather(gathered, axis, tiled=True, mesh=mesh)
    return gathered


_SHOWN_BYTES = 20_000  # of each differing part's text: enough to find where two ranks' texts part


def gather_texts(mesh: Mesh, texts: list[str], device: torch.device) -> list[list[str]]:
    """Every rank's ``texts`` (the first _SHOWN_BYTES of each), by rank."""
    encoded = [text.encode()[:_SHOWN_BYTES] for text in texts]
    sizes = torch.tensor([len(b) for b in encoded], dtype=torch.int64, device=device)
    lengths = _gather(mesh, sizes).cpu()
    width = max(1, int(lengths.max()))
    padded = torch.zeros(len(encoded), width, dtype=torch.uint8)
    for i, raw in enumerate(encoded):
        padded[i, : len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    data = _gather(mesh, padded.to(device)).cpu()
    def decoded(r: int, i: int) -> str:
        return bytes(data[r, i, : int(lengths[r, i])].tolist()).decode(errors="replace")

    return [[decoded(r, i) for i in range(len(encoded))] for r in range(data.shape[0])]


def _contrast(name: str, first: str, other: str, context: int = 60) -> str:
    """``name`` with another rank's text of it and rank 0's, around where they first differ."""
    pairs = enumerate(zip(first, other, strict=False))  # texts of two lengths: up to the shorter
    at = next((i for i, (a, b) in pairs if a != b), min(len(first), len(other)))
    start, end = max(0, at - context), at + context

    def cut(text: str) -> str:
        return ("..." if start else "") + text[start:end] + ("..." if len(text) > end else "")

    return f"{name}: {cut(other)!r} where rank 0 has {cut(first)!r}"


def stable_text(value: object, depth: int = 0) -> str:
    """``value`` in words that are the same on every rank (and process) that built the same thing:
    a function by its qualified name, its code and what it closes over; a module by its submodules'
    classes, code, ``extra_repr``, plain attributes and tensors (``code_text.module_text``); a tensor
    by its shape, dtype and an exact digest of its values; an object by its type and its public
    attributes, a dataclass or NamedTuple by its fields; never a memory address."""
    if depth > 8:
        return "..."
    deeper = functools.partial(stable_text, depth=depth + 1)
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return repr(value)
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return str(value)
    if isinstance(value, torch.Tensor):
        return tensor_text(value)
    if isinstance(value, torch.nn.Module):
        return f"{qualified_name(type(value))}(\n{module_text(value, deeper)})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        fields = ", ".join(f"{n}={deeper(getattr(value, n))}" for n in names)
        return f"{qualified_name(type(value))}({fields})"
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        fields = ", ".join(f"{f}={deeper(getattr(value, f))}" for f in value._fields)
        return f"{qualified_name(type(value))}({fields})"
    if isinstance(value, list | tuple | set | frozenset):
        items = [deeper(v) for v in value]
        if isinstance(value, set | frozenset):
            items.sort()  # a set's order depends on the process's string hashes
        return f"{type(value).__name__}[{', '.join(items)}]"
    if isinstance(value, Mapping):  # sorted: a dict filled from a set is in the process's hash order
        return "{" + ", ".join(sorted(f"{deeper(k)}: {deeper(v)}" for k, v in value.items())) + "}"
    if isinstance(value, functools.partial):
        return f"partial({deeper(value.func)}, {deeper(value.args)}, {deeper(value.keywords)})"
    if isinstance(value, types.FunctionType):
        return _function_text(value, deeper)
    if isinstance(value, types.MethodType):
        return f"{deeper(value.__self__)}.{value.__name__}"
    named = isinstance(value, type | types.BuiltinFunctionType | types.ModuleType)
    if named or (callable(value) and not hasattr(value, "__dict__")):
        return qualified_name(value)
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    public.update(private_settings(value))  # (a user's optimizer keeping its rate in self._lr)
    return f"{qualified_name(type(value))}({', '.join(f'{k}={deeper(v)}' for k, v in public.items())})"


_SHOWN_VALUES = 16  # a tensor this small is shown by its values too (a loss's class weights)


def tensor_text(value: torch.Tensor) -> str:
    """A tensor's shape, dtype and exact digest (:func:`tensor_digest`; 'meta' for a meta or fake
    tensor, which has no values), and its values when it has at most _SHOWN_VALUES."""
    shape = f"shape={tuple(value.shape)}, dtype={value.dtype}"
    if value.is_meta or is_fake(value):  # no values to read
        return f"tensor({shape}, meta)"
    shown = f"{value.detach().cpu().reshape(-1).tolist()!r}, " if value.numel() <= _SHOWN_VALUES else ""
    return f"tensor({shown}{shape}, digest={tensor_digest(value):016x})"


def _function_text(fn: types.FunctionType, deeper: Any) -> str:
    """A function's qualified name, a digest of its code, its defaults and its closure's values."""
    cells = [c.cell_contents if _filled(c) else "<empty>" for c in fn.__closure__ or ()]
    closure = ", ".join(f"{n}={deeper(v)}" for n, v in zip(fn.__code__.co_freevars, cells, strict=True))
    defaults = deeper(fn.__defaults__) if fn.__defaults__ else ""
    between = "; " if defaults and closure else ""
    read = global_values(fn)
    code = f"code {code_digest(fn)}" + (f"; globals {read}" if read else "")
    return f"{qualified_name(fn)}[{code}]({defaults}{between}{closure})"


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
