"""Random numbers a module draws outside torch: from numpy's global generator or Python's ``random``.

shardwise seeds torch's generators for every compute of a step, so that dropout's masks are the same
on every backend, after a resume, and in remat's recomputation. It cannot seed or replay a draw from
numpy's or Python's generators (transformers' Wav2Vec2 draws its SpecAugment masks with
``np.random``): the recomputation would mask other positions than the forward did, and the gradient
would belong to another forward, without an error. :func:`functionalize` runs the module once on the
example input; a module that drew from either generator there is refused, naming it (``draws``).
numpy is compared only where it is imported already: a module that draws from it has imported it.
"""

from __future__ import annotations

import random
import sys
from typing import Any


def states() -> dict[str, Any]:
    """The state of each generator outside torch a module may draw from, by the name a message gives it."""
    out: dict[str, Any] = {"Python's random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy's global np.random"] = numpy.random.get_state(legacy=False)
    return out


def draws(before: dict[str, Any]) -> list[str]:
    """The generators of ``before`` (from :func:`states`) whose state moved since: drawn from."""
    after = states()
    return [name for name, state in before.items() if not _same(state, after.get(name))]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays (the Mersenne Twister's key)
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)
