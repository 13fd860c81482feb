"""What torch.fx's trace of the code between units read from Python, and what it changed.

An fx split (``fx_split``) runs the code between units (the root's forward, and the forwards of
the modules it calls outside the units) once, at ``functionalize``, on proxies: every Python value
that code reads is read then and written into the traced graph as a constant, and every Python
statement in it runs that once. A plain torch loop runs that code at every call. Three ways the two
part, each refused rather than trained as the trace left it:

* a module global the code reads (a curriculum's ``SCALE``, a warm-up flag, ``if SCALE > 1.5``), or a
  setting it reads through one (``C.SCALE`` of an imported config module, ``CFG["scale"]``, ``cfg.scale``
  of a config object), that the loop changes later: the layers would go on computing with the value
  traced. The values read are noted as the trace reads them (:func:`recording_reads`; not under coverage
  or a debugger, whose trace function ours would displace) and compared at every call of a traced layer
  (:func:`refuse_changed`): a changed one is refused, naming it;
* a number attribute the code changes (a step counter ``self.steps += 1``, a warm-up on it): it would
  have counted once, at the trace, and the branch on it stays as traced. Refused at the trace
  (:func:`put_back`, :func:`written_refusal`), the module's attribute put back as it was (a flag or
  value built once, which later calls find as the first call left it, and a tensor are put back only);
* a draw from Python's ``random``, numpy's or torch's global generator that fx does not trace (a
  LayerDrop deciding in the root's loop over its blocks; fairseq's ``LayerDropModuleList`` draws with
  torch in its ``__iter__``): the trace draws once and keeps that one decision for every
  step (a LayerDrop of 0.5 trained as none). Refused at the trace (:func:`drawn_refusal`).

Only the code fx traces is concerned: the units (and torch's own layers, fx's leaves) run as
written at every call, and so does a module split without ``units``.
"""

from __future__ import annotations

import contextlib
import dis
import enum
import os
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# One step from a global to the setting read through it: ("attr", name) for ``.name``, ("item", key) for
# ``[key]`` with a constant key.
PathStep = tuple[str, Any]


@dataclass(frozen=True)
class GlueRead:
    """A module global, or a setting read through one (``path``: ``C.SCALE``, ``CFG["scale"]``), that
    traced code read: its module's name, the global's name, and the value the trace read (and wrote into
    the graph)."""

    module: str
    name: str
    value: Any
    path: tuple[PathStep, ...] = ()

    def now(self) -> Any:
        found = sys.modules.get(self.module)
        return _MISSING if found is None else _walk(vars(found).get(self.name, _MISSING), self.path)

    @property
    def shown(self) -> str:
        return self.name + "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in self.path)


_MISSING = object()


def model_files(module: nn.Module) -> frozenset[str]:
    """The source files of the classes of ``module``'s modules (torch's own left out), and of their
    methods (a class a notebook cell defines has no module file): where the code the trace runs is
    written. :func:`recording_reads` looks at these and at every file beside or below them (a helper in
    another file of one's package), installed packages left out."""
    files = set()
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls is nn.Module or _torch_code(cls):
                break
            found = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if found:
                files.add(os.path.abspath(found))
            for value in vars(cls).values():
                code = getattr(value, "__code__", None)
                if isinstance(code, types.CodeType) and not code.co_filename.startswith("<"):
                    files.add(os.path.abspath(code.co_filename))
    return frozenset(files)


def _watched(files: frozenset[str]) -> Callable[[str], bool]:
    """Whether code in a file is the model's (:func:`model_files`): one of them, or beside or below one,
    not in an installed package (a virtual environment inside the project holds torch)."""
    folders = tuple(sorted({os.path.join(os.path.dirname(f), "") for f in files}))
    seen: dict[str, bool] = {}

    def watched(filename: str) -> bool:
        found = seen.get(filename)
        if found is None:
            path = filename if filename.startswith("<") else os.path.abspath(filename)
            found = seen[filename] = path in files or (
                path.startswith(folders) and not _INSTALLED.search(path) and not path.startswith(_NOT_THE_MODELS)
            )
        return found

    return watched


_INSTALLED = re.compile(r"[\\/](site|dist)-packages[\\/]")
# Never the model's: shardwise, torch, and Python's own library and install folders (a pyenv or conda under the home
# folder a model file sits in: the review found 48 reads of inspect's, re's and logging's globals noted, and the
# trace 4x slower).
_NOT_THE_MODELS = tuple(sorted({
    os.path.join(os.path.abspath(folder), "") for folder in (
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        os.path.dirname(os.path.abspath(torch.__file__)),
        *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    ) if folder
}))


@contextlib.contextmanager
def recording_reads(files: frozenset[str]) -> Iterator[dict[tuple[str, str, tuple[PathStep, ...]], GlueRead]]:
    """Note, while it is open, every scalar module global (a number, bool, string, enum, or a tuple of
    these), and every scalar setting read through a global (``C.SCALE``, ``CFG["scale"]``, ``cfg.lr``:
    attributes and constant subscripts after a global's load), that the model's code (:func:`model_files`,
    :func:`_watched`) loads: the reads the trace made, by (module, name, path). A trace function on this
    thread, opcode by opcode in those frames only (the trace is made once); not code elsewhere, which a
    garbage collector's callback may run in the middle of it. A global that code stores too (a warn-once
    flag, a lazily built cache), and a value the trace itself changed (``STATS.calls += 1``), is the
    code's own state, not a setting: left out. Where a trace function is set already (coverage, a
    debugger), nothing is noted: setting it back after ours would leave coverage's not recording (its C
    tracer's state is lost)."""
    found: dict[tuple[str, str, tuple[PathStep, ...]], GlueRead] = {}
    stored: set[tuple[str, str]] = set()
    ops: dict[types.CodeType, dict[int, tuple[str, str, tuple[PathStep, ...]]]] = {}
    watched = _watched(files)

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            op = ops[frame.f_code].get(frame.f_lasti)
            if op is not None and op[0] == "LOAD_GLOBAL":
                _note(frame, op[1], op[2], found)
            elif op is not None:
                stored.add((str(frame.f_globals.get("__name__", "")), op[1]))
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event != "call" or not watched(code.co_filename):
            return None
        if code not in ops:
            ops[code] = _global_ops(code)
        if not ops[code]:
            return None
        frame.f_trace_opcodes = True
        return local

    previous = sys.gettrace()
    if previous is not None:
        yield found
        return
    sys.settrace(calls)
    try:
        yield found
    finally:
        sys.settrace(previous)
        for key in list(found):
            if key[:2] in stored or not _same(found[key].now(), found[key].value):
                del found[key]


def _global_ops(code: types.CodeType) -> dict[int, tuple[str, str, tuple[PathStep, ...]]]:
    """By offset, each load and store of a global in ``code``; with a load, the attributes and constant
    subscripts that follow it at once (``C.SCALE``: ("attr", "SCALE"); ``CFG["scale"]``: ("item", "scale"))."""
    instructions = list(dis.get_instructions(code))
    found = {}
    for k, i in enumerate(instructions):
        if i.opname not in ("LOAD_GLOBAL", "STORE_GLOBAL") or not isinstance(i.argval, str):
            continue
        path: list[PathStep] = []
        j = k + 1
        while i.opname == "LOAD_GLOBAL" and j < len(instructions) and not instructions[j].is_jump_target:
            after = instructions[j]
            if after.opname == "LOAD_ATTR" and isinstance(after.argval, str):
                path.append(("attr", after.argval))
                j += 1
            elif (after.opname == "LOAD_CONST" and j + 1 < len(instructions)
                  and instructions[j + 1].opname == "BINARY_SUBSCR" and not instructions[j + 1].is_jump_target
                  and isinstance(after.argval, str | int) and not isinstance(after.argval, bool)):
                path.append(("item", after.argval))
                j += 2
            else:
                break
        found[i.offset] = (i.opname, i.argval, tuple(path))
    return found


def _note(frame: types.FrameType, name: str, path: tuple[PathStep, ...],
          found: dict[tuple[str, str, tuple[PathStep, ...]], GlueRead]) -> None:
    if name not in frame.f_globals:
        return
    root, module = frame.f_globals[name], str(frame.f_globals.get("__name__", ""))
    if module not in sys.modules or _torch_code(root):
        return
    # The longest part of the path that ends at a setting: C.SCALE of C.SCALE.real, nothing of F.relu.
    for end in range(len(path), -1, -1):
        value = _walk(root, path[:end])
        if value is not _MISSING and _scalar(value):
            found.setdefault((module, name, path[:end]), GlueRead(module, name, value, path[:end]))
            return


def _walk(value: Any, path: tuple[PathStep, ...]) -> Any:
    """The value at ``path`` from ``value``, reading only what is stored (no property or __getattr__ runs),
    or _MISSING."""
    for kind, key in path:
        if value is _MISSING:
            break
        value = _attribute(value, key) if kind == "attr" else _item(value, key)
    return value


def _item(container: Any, key: Any) -> Any:
    if type(container) is dict:
        return container.get(key, _MISSING)
    if type(container) in (list, tuple) and isinstance(key, int) and -len(container) <= key < len(container):
        return container[key]
    return _MISSING


def _attribute(obj: Any, key: str) -> Any:
    """``obj.key`` where it is a stored value: an instance's, a module's or a class's own, not one a
    descriptor computes (a property, a slot) or one of torch's."""
    if _torch_code(obj) or isinstance(obj, nn.Module):
        return _MISSING
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    in_class: Any = _MISSING
    for cls in classes:
        if key in vars(cls):
            in_class = vars(cls)[key]
            break
    if isinstance(obj, type):
        return _MISSING if hasattr(type(in_class), "__get__") else in_class
    if in_class is not _MISSING and (hasattr(type(in_class), "__set__") or hasattr(type(in_class), "__delete__")):
        return _MISSING
    own = getattr(obj, "__dict__", None)
    if isinstance(own, dict) and key in own:
        return own[key]
    return _MISSING if hasattr(type(in_class), "__get__") else in_class


def refuse_changed(reads: tuple[GlueRead, ...], where: str) -> None:
    """Refuse a call of a traced layer after a global its traced code read has changed."""
    for read in reads:
        now = read.now()
        if not _same(now, read.value):
            value = "no longer defined" if now is _MISSING else f"{now!r} now"
            raise RuntimeError(
                f"{where}: the code between units that torch.fx traced at functionalize reads the global "
                f"{read.shown!r} (of {read.module}), which was {read.value!r} then and is {value}. "
                "A traced layer keeps the value it was traced with (torch.fx writes it into the graph), so "
                "the step would go on computing with the old one. Read it inside a unit (a module that "
                "units= names runs as written at every call), pass it with the batch, or functionalize the "
                "model again after changing it. (A process rank imports the script again without running its "
                "`if __name__ == '__main__':` block: a global set there has its default in the rank.)"
            )


def attribute_values(module: nn.Module) -> dict[int, tuple[nn.Module, dict[str, Any]]]:
    """Each module's attributes as they are now, for :func:`put_back` after the trace."""
    return {id(m): (m, dict(vars(m))) for m in module.modules()}


def put_back(before: Mapping[int, tuple[nn.Module, dict[str, Any]]]) -> list[tuple[nn.Module, str, Any, Any]]:
    """Put back every attribute a module had before the trace and the trace changed; ``(module, name, value
    before, value after)`` of each number among them that the trace changed to another number (a counter its
    forward advances). Not a tensor or proxy (the old weight_norm's hook sets ``module.weight`` from its
    parameters at every call, a computation the graph holds), nor a flag or a value built once (``if
    self.gain is None: self.gain = ...``; a ``_built`` flag), which later calls find as the first left it."""
    written = []
    for m, attributes in before.values():
        for key, value in attributes.items():
            now = vars(m).get(key, _MISSING)
            if now is not value and not _same(now, value):
                vars(m)[key] = value
                if _number(value) and _number(now):
                    written.append((m, key, value, now))
    return written


def written_refusal(written: list[tuple[nn.Module, str, Any, Any]], root: nn.Module) -> str:
    """Why a trace that changed attributes (:func:`put_back` put them back) is refused."""
    paths = {id(m): path for path, m in root.named_modules()}
    listed = ", ".join(
        f"{type(m).__name__} at {paths.get(id(m)) or 'the root'}: self.{key} ({old!r} -> {new!r})"
        for m, key, old, new in written[:4]
    )
    return (
        f"functionalize: the code between units changes numbers its modules hold while torch.fx traces it "
        f"({listed}). "
        "fx runs that code once, at functionalize, so a counter it advances (a warm-up on the model's own "
        "step count) would count once and every branch on it stay as traced, where a torch loop runs it at "
        "every call. Keep the count outside forward (pass it with the batch), or make the module that writes "
        "it a unit (a unit runs as written; its changes to its own state are watched by the step). The "
        "attributes were put back."
    )


def drawn_refusal(root: nn.Module) -> str:
    """Why a trace that drew from Python's ``random``, numpy's or torch's global generator outside the
    ops it traces (put back) is refused."""
    return (
        f"functionalize: the code between units of {type(root).__name__}.forward draws random numbers that "
        "torch.fx does not trace (Python's random, numpy's generator, or torch's on a tensor made there, as "
        "fairseq's LayerDropModuleList draws in its __iter__): a LayerDrop deciding in the loop over the "
        "blocks? fx runs that code once, at functionalize: the decision drawn then would be kept for every "
        "step (a LayerDrop that never drops). Draw inside a unit (a block wrapped in a module that decides "
        "whether to run it: the step seeds and replays its draws). The generators were put back."
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _torch_code(value: Any) -> bool:
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
    return str(name or "").split(".")[0] == "torch"


def _scalar(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return True
    return isinstance(value, tuple) and len(value) <= 64 and all(_scalar(v) for v in value)


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not (_scalar(a) and _scalar(b)):
        return False
    return bool(a == b)
