"""Every rank builds the same step: checked once, at ``init``, before anything can diverge.

SPMD programs compute the step on every rank from the same code, but a rank
can still end up with another one (a flag read differently, an environment
variable, a schedule file that differs on one host). The ranks would then run
different Plans and hang, or train on silently wrong. So ``Step.init`` gathers
a fingerprint of what the rank built (the transform stack, the schedule, the
mesh, the parameters' names, shapes and dtypes, the optimizer and the loss) from
every rank and refuses a mismatch, naming the ranks that differ from rank 0,
what differs, and how (both ranks' text of it, around the first difference).

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


def fingerprint(parts: Mapping[str, str]) -> tuple[int, ...]:
    """One 52-bit digest per part (exact in float64, so it can travel in a collective)."""
    return tuple(int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big") >> 4 for text in parts.values())


def check_ranks_agree(mesh: Mesh, parts: Mapping[str, object], device: torch.device) -> None:
    """Gather every rank's fingerprint of ``parts`` (an all-gather per mesh axis; a part that is
    not a string is described by :func:`stable_text`) and refuse a mismatch on every rank alike,
    naming the ranks and the parts that differ, and showing how."""
    if mesh.size == 1:
        return
    texts = {name: v if isinstance(v, str) else stable_text(v) for name, v in parts.items()}
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
    # Every rank found the same differences: the second exchange is the same on every rank.
    shown = [name for name in names if any(name in what for what in differing.values())]
    got = gather_texts(mesh, [texts[name] for name in shown], device)
    detail = "; ".join(
        f"rank {rank} differs from rank 0 in its {', '.join(what)} ("
        + "; ".join(_contrast(n, got[0][shown.index(n)], got[rank][shown.index(n)]) for n in what)
        + ")"
        for rank, what in differing.items()
    )
    raise ValueError(
        f"the ranks built different steps: {detail}. Every rank must build the same step, "
        "schedule, mesh, optimizer, loss, parameters and seed: build them from the same code and "
        "inputs on every rank"
    )


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
    a function by its qualified name, its code and what it closes over; an object by its type and
    its public attributes, a dataclass or NamedTuple by its fields; never a memory address."""
    if depth > 8:
        return "..."
    deeper = functools.partial(stable_text, depth=depth + 1)
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return repr(value)
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return str(value)
    if isinstance(value, torch.Tensor):
        total = float(value.detach().double().sum()) if value.numel() and not value.is_meta else 0.0
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, sum={total!r})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        fields = ", ".join(f"{n}={deeper(getattr(value, n))}" for n in names)
        return f"{_qualname(type(value))}({fields})"
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        fields = ", ".join(f"{f}={deeper(getattr(value, f))}" for f in value._fields)
        return f"{_qualname(type(value))}({fields})"
    if isinstance(value, list | tuple | set | frozenset):
        items = [deeper(v) for v in value]
        if isinstance(value, set | frozenset):
            items.sort()  # a set's order depends on the process's string hashes
        return f"{type(value).__name__}[{', '.join(items)}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{deeper(k)}: {deeper(v)}" for k, v in value.items()) + "}"
    if isinstance(value, functools.partial):
        return f"partial({deeper(value.func)}, {deeper(value.args)}, {deeper(value.keywords)})"
    if isinstance(value, types.FunctionType):
        return _function_text(value, deeper)
    if isinstance(value, types.MethodType):
        return f"{deeper(value.__self__)}.{value.__name__}"
    named = isinstance(value, type | types.BuiltinFunctionType | types.ModuleType)
    if named or (callable(value) and not hasattr(value, "__dict__")):
        return _qualname(value)
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    return f"{_qualname(type(value))}({', '.join(f'{k}={deeper(v)}' for k, v in public.items())})"


def _function_text(fn: types.FunctionType, deeper: Any) -> str:
    """A function's qualified name, a digest of its code, its defaults and its closure's values."""
    code = fn.__code__
    consts = [c for c in code.co_consts if not isinstance(c, types.CodeType)]
    # Constants in words, not repr: a set literal compiles to a frozenset, whose repr's order
    # follows string hashing, which differs between processes (PYTHONHASHSEED).
    digest = hashlib.sha1(code.co_code + deeper(tuple(consts)).encode()).hexdigest()[:12]
    cells = [c.cell_contents if _filled(c) else "<empty>" for c in fn.__closure__ or ()]
    closure = ", ".join(f"{n}={deeper(v)}" for n, v in zip(code.co_freevars, cells, strict=True))
    defaults = deeper(fn.__defaults__) if fn.__defaults__ else ""
    between = "; " if defaults and closure else ""
    return f"{_qualname(fn)}[code {digest}]({defaults}{between}{closure})"


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _qualname(value: object) -> str:
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    name = name or type(value).__qualname__
    return f"{module}.{name}" if module else str(name)
