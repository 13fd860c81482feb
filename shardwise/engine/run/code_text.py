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

import enum
import functools
import hashlib
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
    for path, sub in module.named_modules(remove_duplicate=False):
        cls = type(sub)
        extra = _ADDRESS.sub("0x...", sub.extra_repr())
        attributes = [f"{k}={_attribute_text(v, describe)}" for k, v in vars(sub).items()
                      if not k.startswith("_") and plain(v)]
        # A buffer the module does not persist may be scratch (torch.empty): its values are not compared.
        scratch = sub._non_persistent_buffers_set
        tensors = [f"{n}={_shape_text(t) if n in scratch else describe(t)}"
                   for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]
        lines.append(
            f"{path or '(root)'}: {qualified_name(cls)}[forward {code_digest(cls.forward)}]({extra}) "
            f"{{{', '.join(attributes)}}} [{', '.join(tensors)}]"
        )
    return "\n".join(lines)


def _shape_text(t: torch.Tensor) -> str:
    return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype})"


def _attribute_text(value: object, describe: Callable[[object], str]) -> str:
    if isinstance(value, torch.Tensor):  # a plain attribute, perhaps a preallocated cache: not its values
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
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(_constant_text(c) for c in const)) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(_constant_text(c) for c in const) + ")"
    return repr(const)


def qualified_name(value: object) -> str:
    """``value``'s module and qualified name (of its type, for an instance without one)."""
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    name = name or type(value).__qualname__
    return f"{module}.{name}" if module else str(name)
