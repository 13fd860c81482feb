"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import builtins
import collections
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


class _CountedFile:
    """A file whose reads add their bytes to the reading thread's count (a rank is a thread)."""

    def __init__(self, f: Any, counts: collections.Counter[str]) -> None:
        self._f, self._counts = f, counts

    def read(self, *args: Any) -> Any:
        data = self._f.read(*args)
        self._counts[threading.current_thread().name] += len(data)
        return data

    def readinto(self, buffer: Any) -> Any:
        n = self._f.readinto(buffer)
        self._counts[threading.current_thread().name] += n or 0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CountedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


@pytest.fixture
def count_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[..., collections.Counter[str]]:
    """``count_reads(*modules)``: the bytes each thread reads through those modules' ``open`` from now on."""

    def patch(*modules: ModuleType) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()

        def counting_open(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
            f = builtins.open(file, mode, *args, **kw)  # noqa: SIM115 (the caller closes it)
            return _CountedFile(f, counts) if "r" in mode else f

        for module in modules:
            monkeypatch.setattr(module, "open", counting_open, raising=False)
        return counts

    return patch


class GathersAlive:
    """Per rank (thread), how many results of earlier all-gathers were alive at most when the next began
    (``most``), and how many it issued (``count``)."""

    def __init__(self) -> None:
        self.most: dict[str, int] = {}
        self.count: collections.Counter[str] = collections.Counter()
        self._alive: dict[str, list[weakref.ref[Any]]] = {}

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(x: Any, *args: Any, **kw: Any) -> Any:
            rank = threading.current_thread().name
            held = [r for r in self._alive.setdefault(rank, []) if r() is not None]
            self.most[rank] = max(self.most.get(rank, 0), len(held))
            # A copy only the code under test holds: the threads backend keeps a collective's results
            # until every rank took its own, which a rank's next gather may start before.
            out = real(x, *args, **kw).clone()
            self._alive[rank] = [*held, weakref.ref(out)]
            self.count[rank] += 1
            return out

        return counted


@pytest.fixture
def gathers_alive(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], GathersAlive]:
    """``gathers_alive(module)``: per rank, the results of ``module.all_gather`` alive at each next one."""

    def patch(module: ModuleType) -> GathersAlive:
        seen = GathersAlive()
        monkeypatch.setattr(module, "all_gather", seen.wrap(module.all_gather))
        return seen

    return patch
