"""The one private torch API the threads backend needs, wrapped here and checked by
tests/collectives/test_dispatch_private.py.

The threads backend computes a collective's result (a sum, a concatenation) once, on
the thread of the last rank to arrive. That thread may be inside a
``TorchDispatchMode`` of its own, such as torch's selective-checkpoint mode under
remat, which would then see (and record, or miss on recompute) arithmetic that
belongs to no rank's program. :func:`outside_dispatch_modes` runs that arithmetic
with the thread's modes set aside (``torch.utils._python_dispatch._disable_current_modes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

try:
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError as exc:  # pragma: no cover - only on a torch that removed it
    raise ImportError(
        "shardwise's threads backend needs torch.utils._python_dispatch._disable_current_modes (torch 2.1 to "
        "2.13) to compute collectives outside the arriving rank's dispatch modes; this torch no longer has it"
    ) from exc


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Inside the block no TorchDispatchMode of this thread sees the ops run."""
    with _disable_current_modes():
        yield
