"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import builtins
import collections
import threading
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
