"""Which tensors a start from stored weights makes instead of reading, and which stored ones it leaves.

A fine-tune starts a model with a new head from its backbone's weights: a
``BertForSequenceClassification`` from a ``BertForMaskedLM`` save lacks ``classifier.*`` and
``bert.pooler.*`` and holds ``cls.predictions.*`` the new model has not. ``from_pretrained``
initializes the first and drops the second, logging both. A start from weights here refuses any
missing or unexpected tensor by default (a wrong file would otherwise train from random weights
without a word), and takes them only where the call names them: ``new=`` the model's keys the files
lack, made by the model's initializer as ``step.init`` makes them (on a meta build from ``(seed,
path)``, the same on every mesh; an eager build keeps its own values, which every rank must hold
alike), and ``unused=`` the stored keys left unread. A key stored with another shape than the model's (a classifier
for another number of labels) may be named new too, as ``from_pretrained(..., ignore_mismatched_sizes=True)``
makes it; its stored tensor is left unread. Each is a list of keys or ``fnmatch`` patterns
(``"classifier.*"``); a pattern that matches none of the missing (unexpected) keys is refused, so a
typo, or a file that holds the head after all, is heard of. The refusal of a mismatch names the
patterns to pass.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterable, Sequence

from .errors import CheckpointError


def patterns_of(call: str, name: str, value: object) -> tuple[str, ...]:
    """``value`` (one key or pattern, or a list of them) as a tuple of patterns; anything else refused."""
    if isinstance(value, str):
        return (value,) if value else _bad(call, name, value)
    if isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        items = tuple(value)
        if all(isinstance(p, str) and p for p in items):
            return items
    return _bad(call, name, value)


def _bad(call: str, name: str, value: object) -> tuple[str, ...]:
    raise TypeError(
        f"{call}: {name}={value!r} is not a list of state_dict keys or fnmatch patterns "
        f"(e.g. {name}=['classifier.*'])"
    )


def matched(
    where: str, name: str, patterns: Sequence[str], candidates: Collection[str], what: str
) -> set[str]:
    """The ``candidates`` (missing or unexpected keys) some pattern matches; a pattern matching
    none of them is refused."""
    out: set[str] = set()
    for pattern in patterns:
        hits = {key for key in candidates if fnmatch.fnmatchcase(key, pattern)}
        if not hits:
            raise CheckpointError(
                f"{where}: {name}= names {pattern!r}, which matches none of the {what} keys "
                f"{sorted(candidates)[:8]}; " + (
                    "name only the model's keys the files lack or hold with another shape (a key they hold as "
                    f"the model has it is read: drop {pattern!r} if it means one)" if name == "new" else
                    f"name only stored keys the model lacks (drop {pattern!r} if it means none)")
            )
        out |= hits
    return out


def suggested(keys: Collection[str], others: Collection[str]) -> list[str]:
    """Patterns matching exactly ``keys`` and none of ``others``: each key's shortest module prefix
    with ``.*`` under which no other key lies (else the key itself)."""
    out: list[str] = []
    for key in sorted(keys):
        if any(fnmatch.fnmatchcase(key, p) for p in out):
            continue
        parts = key.split(".")
        for n in range(1, len(parts)):
            prefix = ".".join(parts[:n]) + "."
            if not any(o.startswith(prefix) for o in others):
                out.append(prefix + "*")
                break
        else:
            out.append(key)
    return out
