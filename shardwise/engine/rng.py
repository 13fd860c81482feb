"""Random streams of a step: dropout reproducible on every backend, run to run and on resume.

torch's ops draw from its process-global default generators (``F.dropout``
takes no generator), which thread ranks share. So every compute of a step
(a stage's forward or backward on one micro-batch) runs with the default
generator of its device seeded from ``(state seed, step, rank, stage,
micro-batch, kind)``: the same masks on threads, processes and torchrun, the
same after a save and resume (the seed and the step count live in the
TrainState), and remat's recomputation replays them (torch's checkpoint
restores the state it saw in forward).

Thread ranks share one generator, so their computes take turns while it is
seeded and used (a lock around each compute on the threads backend). A layer
that runs a collective inside its forward would then wait for a peer that
waits for the lock: the threads backend's collectives time out with the
rank's name rather than hang, and the lock is taken only on that backend.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ..collectives.backends.current import current_backend

_SHARED = threading.Lock()  # thread ranks share torch's default generators
_MASK = (1 << 63) - 1


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): distinct inputs give unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 27
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state & _MASK


def ranks_share_generators() -> bool:
    """Whether the calling rank shares torch's generators with other ranks (thread ranks do)."""
    return current_backend().name == "threads"


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device, shared: bool) -> Iterator[None]:
    """Run the block with ``device``'s default generator (and the CPU's) seeded with ``seed``."""
    if seed is None:
        yield
        return
    with _SHARED if shared else contextlib.nullcontext():
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
