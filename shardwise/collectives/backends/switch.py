"""A process-wide setting on by default that a block can turn off for its duration: how the
benchmarks measure a transport against the one it replaces in one run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Switch:
    """On until a block turns it off with :meth:`off` (back to what it was after the block).

    >>> switch = Switch()
    >>> with switch.off():
    ...     switch.on
    False
    >>> switch.on
    True
    """

    def __init__(self) -> None:
        self.on = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
