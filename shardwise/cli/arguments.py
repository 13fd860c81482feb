"""What the command line reads: the mesh grammar and the user's ``FILE:FUNCTION``.

Both raise :class:`UsageError`, which the command reports on one line and
exits 2 for, as argparse does for its own usage errors.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..collectives.mesh import Mesh
from ..engine.step.step import Step


class UsageError(Exception):
    """The command line asked for something that cannot be: exit status 2."""


def parse_mesh(text: str) -> Mesh:
    """``"dp=2,pp=2"`` -> ``Mesh(dp=2, pp=2)``: comma-separated ``axis=size`` pairs, in mesh order.

    >>> parse_mesh("dp=2,pp=2")
    Mesh(dp=2, pp=2)
    >>> parse_mesh("dp=two")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    shardwise.cli.arguments.UsageError: --mesh 'dp=two': size 'two' of axis 'dp' is not a whole number;
    write e.g. --mesh dp=2,pp=2
    """
    example = "write e.g. --mesh dp=2,pp=2"
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, equals, size = (part.strip() for part in item.partition("="))
        if not equals or not name:
            raise UsageError(f"--mesh {text!r}: {item.strip()!r} is not axis=size; {example}")
        if not name.isidentifier():
            raise UsageError(f"--mesh {text!r}: axis name {name!r} must be an identifier such as dp; {example}")
        if name in sizes:
            raise UsageError(f"--mesh {text!r}: axis {name!r} is given twice")
        if not size.isdigit():
            raise UsageError(f"--mesh {text!r}: size {size!r} of axis {name!r} is not a whole number; {example}")
        if int(size) < 1:
            raise UsageError(f"--mesh {text!r}: axis {name!r} has size {size}; sizes are at least 1")
        sizes[name] = int(size)
    return Mesh(sizes)


def positive_seconds(text: str) -> float:
    """``--timeout`` for argparse: a finite number of seconds above 0."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds, e.g. 120")
    return value


def tolerance(text: str) -> float:
    """``--rtol`` / ``--atol`` for argparse: a finite number, 0 or more."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; a tolerance is 0 or more, e.g. 1e-6")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def check_output_file(flag: str, path: str | Path, example: str) -> None:
    """Refuse a file the command could not write (a folder, a missing or read-only folder), before the work it
    would be written after; ``example`` is a file name to suggest in a folder."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder: name a file in it (e.g. {str(target / example)!r})")
    if target.exists():  # a file to replace, or one written into as it is (/dev/stdout): its own permission
        if not os.access(target, os.W_OK):
            raise UsageError(f"{flag} {str(path)!r} is not writable; name another file")
        return
    if target.is_symlink():
        raise UsageError(f"{flag} {str(path)!r} is a link to {os.readlink(target)!r}, which does not exist; name "
                         "the file itself, or make the link's folder first")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: there is no folder {str(folder)!r} to write it in; create it "
                         "or name a file in a folder that exists")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r}: the folder {str(folder)!r} is not writable; name another")


def load_function(target: str) -> Callable[..., Any]:
    """Import ``FILE:FUNCTION`` by path and return the function.

    The file is imported as a module named after it, with its folder first on
    ``sys.path``, as ``python FILE`` would see it: so its own imports work and
    rank processes (``--backend processes``) can import it again.
    """
    file, colon, name = target.rpartition(":")
    if not colon or not file or not name:
        raise UsageError(f"{target!r}: write FILE:FUNCTION, e.g. train.py:make_step")
    path = Path(file).resolve()
    if not path.is_file():
        raise UsageError(f"{target!r}: no such file {file!r}")
    if path.suffix != ".py":
        raise UsageError(f"{target!r}: {file!r} is not a Python file (.py)")
    module_name = path.stem
    if not module_name.isidentifier():
        raise UsageError(f"{target!r}: rename {path.name!r} to a valid module name (letters, digits, _)")
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
        raise UsageError(
            f"{target!r}: a module named {module_name!r} is already imported from "
            f"{getattr(loaded, '__file__', 'a built-in')}; rename {path.name!r}"
        )
    if loaded is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"{target!r}: cannot import {file!r}")
        sys.path.insert(0, str(path.parent))
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = loaded  # before running it: dataclasses and pickle look it up there
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[module_name]
            raise
    function = getattr(loaded, name, None)
    if function is None:
        own = sorted(n for n, v in vars(loaded).items()
                     if callable(v) and getattr(v, "__module__", None) == module_name and not n.startswith("_"))
        raise UsageError(f"{target!r}: {file!r} has no function {name!r}; it defines {own}")
    if not callable(function):
        raise UsageError(f"{target!r}: {name!r} is a {type(function).__name__}, not a function")
    return function


def call_for(target: str, function: Callable[..., Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    """Call the user's function with no arguments; it must return a tuple ``names`` long, a shardwise Step where
    a name says step (``step``, ``reference``): in another order the command would fail far from the cause."""
    result = function()
    if not isinstance(result, tuple | list) or len(result) != len(names):
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple | list) else "")
        raise UsageError(f"{target} must return ({', '.join(names)}), got {got}")
    for i, (name, value) in enumerate(zip(names, result, strict=True)):
        if name in ("step", "reference") and not isinstance(value, Step):
            steps = [j for j, v in enumerate(result) if isinstance(v, Step)]
            where = f" (a Step is element {', '.join(map(str, steps))}: in another order?)" if steps else ""
            raise UsageError(
                f"{target} must return ({', '.join(names)}): element {i} ({name}) is a {type(value).__name__}, "
                f"not a shardwise Step{where}"
            )
    return tuple(result)
