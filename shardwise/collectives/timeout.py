"""The one timeout: how long any rank waits for any other, on every backend.

``launch(main, world, timeout=...)`` sets it for the threads and processes
backends; under torchrun it is the timeout given to
``torch.distributed.init_process_group(timeout=...)``, or
:data:`DEFAULT_TIMEOUT_S` when none was given (see
``backends/current.py``). It bounds every collective and point-to-point wait,
the creation of the per-axis process groups, and the launcher's own waits:
the end of ``main`` is a last rendezvous, so a rank that has not finished
``timeout`` seconds after the first one did is reported as hung.

The default is 5 minutes, a sixth of torch's 30. A healthy wait lasts as long
as the slowest rank's work between two collectives: a step, or one rank alone
writing a checkpoint shard or loading a data shard before the next
collective, which 5 minutes covers on one machine. A dead or diverged peer,
meanwhile, costs 5 minutes instead of half an hour. Longer one-off work (a
first-step compile on a large model, a slow network filesystem) needs a
larger timeout; tests use a second or two.
"""

from __future__ import annotations

import math

DEFAULT_TIMEOUT_S = 300.0


def check_timeout(where: str, timeout: object) -> float:
    """``timeout`` as positive finite seconds, or a ValueError naming ``where`` it was given."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{where}(timeout={timeout!r}): timeout must be a number of seconds")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"{where}(timeout={timeout!r}): timeout must be positive, finite seconds")
    return float(timeout)
