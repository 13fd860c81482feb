"""How a verb answers: text for people or one JSON object (``--json``) for programs."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any


def one_line(message: str) -> str:
    """A message of several lines (a deadlock's ranks, say) as the one line every error of the command is."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return "".join(line + ("" if i == len(lines) - 1 else " " if line.endswith(":") else "; ")
                   for i, line in enumerate(lines))


class CommandFailed(Exception):
    """The command ran and the answer is "no" (an invalid schedule, a divergence): exit status 1.

    ``data`` is what ``--json`` prints on stdout for it; the message goes to stderr either way.
    """

    def __init__(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.data = dict(data or {})


class Output:
    """Prints a verb's result as text, or as one JSON object when ``as_json``."""

    def __init__(self, as_json: bool, prog: str = "shardwise") -> None:
        self.as_json = as_json
        self.prog = prog

    def emit(self, data: Mapping[str, Any], text: str) -> None:
        if self.as_json:
            print(json.dumps({"ok": True, **data}, indent=1, default=str))
        else:
            print(text)

    def fail(self, failure: CommandFailed) -> None:
        self.fail_quietly(str(failure), failure.data)
        print(f"{self.prog}: error: {one_line(str(failure))}", file=sys.stderr)

    def fail_quietly(self, error: str, data: Mapping[str, Any]) -> None:
        """The ``"ok": false`` object on stdout under ``--json`` (the message is on stderr already)."""
        if self.as_json:
            print(json.dumps({"ok": False, "error": error, **data}, indent=1, default=str))
