"""Random streams of a step: dropout reproducible on every backend, run to run and on resume.

torch's ops draw from its process-global default generators (``F.dropout``
takes no generator), which thread ranks share. So every compute of a step
(a stage's forward or backward on one micro-batch) runs with the default
generator of its device seeded from ``(state seed, step, rank, stage,
micro-batch, kind)``: the same masks on threads, processes and torchrun, the
same after a save and resume (the seed and the step count live in the
TrainState), and remat's recomputation replays them (torch's checkpoint
restores the state it saw in forward).

Python's ``random`` and numpy's global generator (where numpy is imported) are
process-global too, and a module may draw from them (Wav2Vec2's SpecAugment
masks, a LayerDrop's ``random.random()``): each compute seeds them as well, from
seeds of their own derived from the compute's (``mix``: not torch's stream), and
everything below (the lock, the lending, ``preserved``) covers them with torch's
(``engine/model/host_random.py``; remat replays them itself).

Thread ranks share one generator, so their computes take turns while it is
seeded and used (a lock around each compute on the threads backend). A layer
that runs a collective inside its compute lends the generators while it waits
(the threads backend's blocking-wait hook): it saves their state, lets the
peer it waits for compute, and takes them back as they were, so its stream
continues undisturbed. The step leaves the user's own generator state as it
found it (:func:`preserved`).

Every wait for the generators is bounded by the launch's one timeout: a rank
whose compute holds them longer (a layer stuck, or slower than the timeout
allows) makes the ranks waiting for them fail with a CollectiveTimeout that
names it, instead of hanging the launch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ...collectives.backends.blocking import on_blocking_wait
from ...collectives.backends.current import current_backend
from ...collectives.backends.rank_lock import RankLock
from ...collectives.errors import CollectiveTimeout
from ..model import host_random

_SHARED = RankLock()  # thread ranks share torch's default generators; a stopped rank cannot leak it
_HOLDER = threading.local()  # the device this thread's compute holds the generators for, if any
_OWNER: list[int | None] = [None]  # the rank holding _SHARED (thread ranks share this module)
MASK = (1 << 63) - 1


START = 0x9E3779B97F4A7C15  # mix's state before its first value
# Mixed into a compute's seed for the seeds of Python's random and numpy's global generator.
_PYTHON, _NUMPY = 1, 2


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): distinct inputs give unrelated streams."""
    return mixed(START, *values) & MASK


def mixed(state: int, *values: int) -> int:
    """The rounds of :func:`mix` from ``state`` (its start, or what ``mixed`` gave for the first
    values), before the final mask: ``mix(a, b, c) == mixed(mixed(START, a, b), c) & MASK``, so a
    step that mixes the same first values for every compute mixes them once."""
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 27
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state


def ranks_share_generators() -> bool:
    """Whether the calling rank shares torch's generators with other ranks (thread ranks do)."""
    return current_backend().name == "threads"


def default_generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a compute on ``device`` draws from: the CPU's, and the GPU's."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    return gens


def seed_all(generators: list[torch.Generator], seed: int) -> None:
    """Seed ``generators`` (a compute's :func:`default_generators`) with ``seed``, and Python's
    ``random`` and numpy's global generator with seeds derived from it."""
    for gen in generators:
        gen.manual_seed(seed)
    host_random.seed(mixed(seed, _PYTHON), mixed(seed, _NUMPY))


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device, shared: bool) -> Iterator[None]:
    """Run the block with ``device``'s default generator (and the CPU's) seeded with ``seed``, and
    the host's generators (Python's ``random``, numpy's) with seeds derived from it."""
    if seed is None:
        yield
        return
    with _holding("to seed them for a compute") if shared else contextlib.nullcontext():
        seed_all(default_generators(device), seed)
        _HOLDER.device = device if shared else None
        try:
            yield
        finally:
            _HOLDER.device = None


@contextlib.contextmanager
def _holding(why: str) -> Iterator[None]:
    """Hold the shared generators for the block (released at its end if still held: a wait
    inside it may have lent them and failed to take them back)."""
    _acquire(why)
    try:
        yield
    finally:
        if getattr(_HOLDER, "held", False):
            _release()


def _acquire(why: str) -> None:
    """Take the shared generators, waiting at most the launch's timeout."""
    backend = current_backend()
    if not _SHARED.acquire(timeout=backend.timeout):
        owner = _OWNER[0]
        holder = "another rank" if owner is None else f"rank {owner}"  # None: it let go just now
        raise CollectiveTimeout(
            f"rank {backend.rank} waited {backend.timeout:g} s for torch's shared random "
            f"generators ({why}): {holder} holds them while it computes (thread ranks take turns "
            f"with them under dropout), and its compute ran longer than the timeout. If {holder}'s "
            "layer is just slow, raise launch(timeout=...); else find what it is stuck in"
        )
    _OWNER[0], _HOLDER.held = backend.rank, True


def _release() -> None:
    _OWNER[0], _HOLDER.held = None, False
    _SHARED.release()


@contextlib.contextmanager
def _lend_while_blocked() -> Iterator[None]:
    """Around a blocking wait of a thread rank that holds the generators: let the others compute,
    and take the generators back in the state this rank left them."""
    device = getattr(_HOLDER, "device", None)
    if device is None:
        yield
        return
    states = [gen.get_state() for gen in default_generators(device)]
    host = host_random.capture()
    _HOLDER.device = None
    _release()
    try:
        yield
    finally:
        _acquire("to take them back after a collective inside its compute")
        for gen, state in zip(default_generators(device), states, strict=True):
            gen.set_state(state)
        host_random.restore(host)
        _HOLDER.device = device


on_blocking_wait(_lend_while_blocked)


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """The block (a prediction on fake tensors: a stage's boundary, the output's shapes, what the forward
    keeps) leaves torch's CPU generator, Python's ``random`` and numpy's as it found them. Model code
    runs its host draws for real there (a LayerDrop's ``random.random()``, a mask from ``np.random``);
    thread ranks share those generators, so it also holds them (unless this rank does already), as a
    compute does: between another rank's seeding and its draws, a prediction's draws shifted them, and
    a step's first run differed from the next."""
    shared = ranks_share_generators() and not getattr(_HOLDER, "held", False)
    with _holding("to predict on fake tensors") if shared else contextlib.nullcontext():
        cpu, host = torch.get_rng_state(), host_random.capture()
        try:
            yield
        finally:
            torch.set_rng_state(cpu)
            host_random.restore(host)


@contextlib.contextmanager
def preserved(device: torch.device, shared: bool, active: bool) -> Iterator[None]:
    """The block leaves the default generators as it found them, and the host's (Python's ``random``,
    numpy's) going on from seeds drawn from them as it began (``host_random.fork``): a step's streams
    are its own.

    Across thread ranks, which share the generators and run at once, "as found" is the state
    when this rank's step began: their own draws outside the steps are not reproducible anyway.
    """
    if not active:
        yield
        return
    with _holding("to save their state") if shared else contextlib.nullcontext():
        states = [gen.get_state() for gen in default_generators(device)]
        host = host_random.fork()
    try:
        yield
    finally:
        with _holding("to restore their state") if shared else contextlib.nullcontext():
            for gen, state in zip(default_generators(device), states, strict=True):
                gen.set_state(state)
            host_random.rejoin(host)
