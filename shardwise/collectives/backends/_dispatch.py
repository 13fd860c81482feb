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
from typing import Any

try:
    from torch._C import _len_torch_dispatch_stack
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError as exc:  # pragma: no cover - only on a torch that removed it
    raise ImportError(
        "shardwise's threads backend needs torch.utils._python_dispatch._disable_current_modes and the "
        "dispatch mode stacks' lengths (torch._C._len_torch_dispatch_stack, "
        "torch._ops._len_torch_dispatch_stack_pre_dispatch; torch 2.1 to 2.13) to compute collectives "
        "outside the arriving rank's dispatch modes; this torch no longer has them"
    ) from exc


def outside_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """Inside the block no TorchDispatchMode of this thread sees the ops run. Without one (the
    usual case) nothing is set aside: taking the stacks apart and back costs about 10 us, paid by
    every collective of the threads backend."""
    if _len_torch_dispatch_stack() == 0 and _len_torch_dispatch_stack_pre_dispatch() == 0:
        return contextlib.nullcontext()
    return _disable_current_modes()
