"""A module's structure and code in words that are the same on every rank and process that built it.

The agreement check at ``Step.init`` compares what each rank built. Shapes and values do not show a
rank whose model computes something else on the same tensors: a ``ReLU`` where the others have a
``GELU``, a ``Dropout(0.5)`` where they have ``Dropout(0.0)``, a forward that calls ``F.relu`` where
theirs calls ``F.gelu``. :func:`module_text` says, per submodule, its class, the digest of its
``forward``'s code, its ``extra_repr()``, its plain attributes and its tensors, so these differ too.

Nothing in it may differ between ranks that built the same model: no memory address (an
``extra_repr`` that shows one has it masked), no file path or line number (a code digest reads the
bytecode, its constants and the names it reads), no set in an order that depends on the process's
string hashes. Objects other than plain values (a Hugging Face config, a logger) are left out: they
show in the shapes and the other attributes, and can hold what is not the computation (a registry
of all the process's loggers), which would refuse ranks that built the same model.
"""

from __future__ import annotations

import dis
import enum
import functools
import hashlib
import inspect
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def module_text(module: nn.Module, describe: Callable[[object], str]) -> str:
    """One line per submodule of ``module`` (itself first): its path, class and ``forward``'s code
    digest, its ``extra_repr()``, its plain attributes and its registered tensors, each value in
    the words of ``describe`` (``stable_text``: a tensor by its shape, dtype and digest)."""
    lines = []
    read_by: dict[type, str] = {}  # each class's forward disassembled once (a model repeats its blocks)
    configs: set[int] = set()  # a Hugging Face config, which every module of a model holds, said once
    for path, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        extra = _ADDRESS.sub("0x...", sub.extra_repr())
        attributes = [f"{k}={_attribute_text(v, describe)}" for k, v in vars(sub).items()
                      if (not k.startswith("_") and plain(v)) or _private_setting(k, v)]
        config = getattr(sub, "config", None)
        if callable(getattr(config, "to_dict", None)) and id(config) not in configs:
            configs.add(id(config))
            attributes.append(f"config={describe(config_settings(config))}")
        # A buffer the module does not persist may be scratch (torch.empty): its values are not compared.
        scratch = sub._non_persistent_buffers_set
        tensors = [f"{n}={_shape_text(t) if n in scratch else describe(t)}"
                   for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]
        forward = _forward_of(cls)
        read = read_by.get(cls)
        if read is None:
            read = read_by[cls] = global_values(forward)
        digest = code_digest(forward) if forward is not None else _script_digest(sub)
        lines.append(
            f"{path or '(root)'}: {qualified_name(cls)}[forward {digest}"
            f"{f'; globals {read}' if read else ''}]({extra}) "
            f"{{{', '.join(attributes)}}} [{', '.join(tensors)}]"
        )
    return "\n".join(lines)


def _forward_of(cls: type) -> object | None:
    """``cls.forward`` as the class holds it, without running a descriptor: a TorchScript module's class
    (``torch.jit.script(Block())``) gives its forward only through an instance, raising when asked on the class."""
    found = inspect.getattr_static(cls, "forward", None)
    return found if isinstance(found, types.FunctionType) else None


def _script_digest(module: nn.Module) -> str:
    """12 hex digits of a TorchScript module's code (its ``code``, TorchScript's own text of its forward); ''
    where it has none."""
    try:
        text = str(getattr(module, "code", ""))
    except (RuntimeError, AttributeError):  # a module scripted without a forward
        text = ""
    return hashlib.sha1(text.encode()).hexdigest()[:12] if text else ""


# What nn.Module keeps in its __dict__ for itself: not a setting of the computation.
_MODULE_OWN = frozenset(vars(nn.Module()))


def _private_setting(key: str, value: object) -> bool:
    """A private attribute holding a numeric setting (``self._t = 2.0`` read as ``x / self._t``, a user's optimizer's
    ``self._lr``): a number (not a bool) or enum, or a short tuple or list of numbers; not nn.Module's own, nor one
    whose name says it is the rank's own (``_rank``: :data:`_RANKS_OWN_WORDS`) or state the object keeps as it runs
    (``_step_count``, ``_last_lr``: :data:`_KEPT_STATE_WORDS`)."""
    return key.startswith("_") and key not in _MODULE_OWN and not _ranks_own(key) and \
        _KEPT_STATE_WORDS.isdisjoint(_words(key)) and _numbers(value)


def private_settings(value: object) -> dict[str, object]:
    """An object's private attributes holding plain settings (:func:`_private_setting`), by name."""
    return {k: v for k, v in getattr(value, "__dict__", {}).items() if _private_setting(k, v)}


def config_settings(config: Any) -> dict[str, object]:
    """A Hugging Face config's settings that a forward reads (``config.final_logit_softcapping``): the plain values of
    its ``to_dict()``, nested ones included, without its bookkeeping (keys starting with '_': the path it was read
    from, the commit) and names that say they are the rank's own."""
    def kept(value: object) -> bool:
        return _scalars(value) or (isinstance(value, Mapping) and all(isinstance(k, str) for k in value))

    settings = config.to_dict()
    out: dict[str, object] = {}
    for key, value in settings.items():
        if not isinstance(key, str) or key.startswith("_") or _ranks_own(key) or not kept(value):
            continue
        out[key] = {k: v for k, v in value.items() if _scalars(v)} if isinstance(value, Mapping) else value
    return out


def _shape_text(t: torch.Tensor) -> str:
    return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype})"


def _attribute_text(value: object, describe: Callable[[object], str]) -> str:
    if isinstance(value, torch.Tensor):  # a plain attribute, perhaps scratch (torch.empty's values are a rank's own)
        return _shape_text(value)
    if isinstance(value, types.MethodType):  # by its class and code, not by all of the object it is bound to
        return f"{qualified_name(type(value.__self__))}.{value.__name__}[code {code_digest(value)}]"
    return describe(value)


def plain(value: object) -> bool:
    """A value that configures a computation alike on every rank: a number, string, dtype, enum, a
    tensor (read as a constant), a function or class, or a container of these."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return True
    if isinstance(value, torch.device):  # a rank's own device (cuda:<local rank>) differs by design
        return False
    if isinstance(value, torch.dtype | torch.Size | torch.Tensor):
        return True
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | types.MethodType | type):
        return True
    if isinstance(value, functools.partial):
        return plain(value.func) and plain(value.args) and plain(value.keywords)
    if isinstance(value, list | tuple | set | frozenset):
        return all(plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(plain(k) and plain(v) for k, v in value.items())
    return False


def code_digest(function: object) -> str:
    """12 hex digits of ``function``'s bytecode, constants and the names it reads (``F.gelu`` reads
    ``gelu``), with those of the functions defined inside it and of the functions it wraps
    (``functools.wraps``' ``__wrapped__``: a decorated forward's own code is the decorator's); ''
    for what has no Python code."""
    digest = hashlib.sha1()
    seen: set[int] = set()
    found = False
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if isinstance(code, types.CodeType):
            _add_code(digest, code)
            found = True
        function = getattr(function, "__wrapped__", None)
    return digest.hexdigest()[:12] if found else ""


# A global, private attribute or config key whose value is this rank's own by design (its rank, its device, whether
# it is the one that logs, where it writes, when it started): not compared, by the words of its name.
_RANKS_OWN_WORDS = frozenset({
    "rank", "device", "local", "node", "host", "gpu", "cuda", "pid", "port", "worker", "master", "main", "log",
    "logger", "logging", "path", "dir", "file", "time", "timestamp", "stamp", "date", "seed", "verbose", "debug", "id",
})
# A private attribute an object advances as it runs (a scheduler's ``_step_count``, ``_last_lr``, a cache): state,
# not a setting, by the words of its name.
_KEPT_STATE_WORDS = frozenset({"count", "step", "steps", "last", "prev", "cache", "cached", "calls", "seen",
                               "history", "state", "n", "num"})


def _words(name: str) -> set[str]:
    """``name``'s words, lower-cased: split at underscores and at camelCase humps (``IS_MASTER``, ``logPath``)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {w.lower() for w in spaced.split("_") if w}


def _ranks_own(name: str) -> bool:
    return not _RANKS_OWN_WORDS.isdisjoint(_words(name))


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def global_values(function: object, depth: int = 0) -> str:
    """The numeric values (numbers, not bools; enums; tuples and lists of numbers) of the module globals
    ``function``'s code reads (``torch.tanh(x / TEMP)``, a schedule's ``WARMUP``), by name, sorted, with those its
    nested functions read and those of the module's functions it calls (one level down); '' where it reads none.
    A process that set one otherwise builds the same code, which the code digest alone cannot tell. Left out: a
    name that says it is the rank's own (``RANK``, ``device``, ``IS_MASTER``, ``log_path``: :data:`_RANKS_OWN_WORDS`),
    and bools and strings (a flag or a path a rank sets for itself to log: not told apart from a setting)."""
    found: dict[str, str] = {}
    seen: set[int] = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        fn = getattr(function, "__func__", function)
        code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if isinstance(code, types.CodeType) and isinstance(names, dict):
            for name in _globals_read(code):
                if name in found or name not in names or _ranks_own(name):
                    continue
                value = names[name]
                if _numbers(value):
                    found[name] = _constant_text(value)
                elif isinstance(value, types.FunctionType) and depth < 1 and value.__module__ == fn.__module__:
                    inner = global_values(value, depth + 1)
                    if inner:
                        found[name] = f"<{inner}>"
        function = getattr(function, "__wrapped__", None)
    return ", ".join(f"{k}={v}" for k, v in sorted(found.items()))


def _globals_read(code: types.CodeType) -> list[str]:
    names = [i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS and isinstance(i.argval, str)]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _globals_read(const)
    return names


def _scalars(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        return True
    return isinstance(value, list | tuple | set | frozenset) and len(value) <= 64 and all(
        v is None or isinstance(v, bool | int | float | complex | str | bytes | enum.Enum) for v in value)


def _numbers(value: object) -> bool:
    """A number (not a bool) or enum, or a short tuple or list of numbers: a setting a rank would not set for itself."""
    def number(v: object) -> bool:
        return isinstance(v, int | float | complex | enum.Enum) and not isinstance(v, bool)

    return number(value) or (isinstance(value, list | tuple) and 0 < len(value) <= 64 and all(map(number, value)))


def _add_code(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # a nested function or lambda: its repr has an address
            _add_code(digest, const)
        else:
            digest.update(_constant_text(const).encode())


def _constant_text(const: object) -> str:
    """A code constant's repr, with a frozenset's items sorted (``x in {'a', 'b'}`` compiles to one,
    whose order depends on the process's string hashes)."""
    if isinstance(const, frozenset | set):  # (a set's order follows the process's string hashes too)
        return f"{type(const).__name__}({{" + ", ".join(sorted(_constant_text(c) for c in const)) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(_constant_text(c) for c in const) + ")"
    return repr(const)


def qualified_name(value: object) -> str:
    """``value``'s module and qualified name (of its type, for an instance without one)."""
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    name = name or type(value).__qualname__
    return f"{module}.{name}" if module else str(name)
