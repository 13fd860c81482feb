"""Random numbers a module draws outside torch: from numpy's global generator or Python's ``random``.

Both are process-global, as torch's default generators are, and shardwise treats them alike (transformers'
Wav2Vec2 / HuBERT draw their SpecAugment masks with ``np.random``, LayerDrops draw ``random.random()``):

* every compute of a step runs with them seeded from the compute's seed (``engine/run/rng.py``: the
  same draws on every backend, run to run and after a resume), and the user's own streams go on after
  the step from seeds drawn from them as it began (:func:`fork`, :func:`rejoin`): reproducible from
  their state before the step, whatever the step drew. Not their state as it was, which torch's
  generators get back: saving and setting numpy's state costs about 150 us a step (1 to 2% of a
  10 ms CPU step), drawing two seeds and seeding a few;
* remat's recomputation replays them: the state a checkpointed layer's forward found is set again
  for its recomputation, and the compute's own state is put back after it. A layer whose first
  forward under remat drew from neither is not watched again (saving and comparing their state
  cost a 6-block GPT's remat step 2.6%): one that starts drawing only later is not replayed;
* :func:`functionalize` runs the module and its chain from the same state of them.

numpy is seeded, saved and restored only where it is imported already (a module that draws from it has
imported it; torch imports it where it is installed). A generator *object* of a module's own
(``random.Random()``, ``np.random.RandomState()``, ``np.random.default_rng()``) is not global: the
step cannot seed it per compute (each rank draws from the chain's copy of it, taken when the module
was split). functionalize does not refuse it: without remat the step draws from it as a plain torch
loop would (two runs of the module could not tell a draw of rare effect from none anyway). remat
could not replay it, so a layer whose first forward under remat draws from one that its module holds
(:func:`own_generators`: as an attribute, in a container or on a helper object it holds, or by a global
name its forward reads) is refused there, as a ``torch.Generator`` of its own is
(``transforms/remat/own_generators.py``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

#: (Python's random state, numpy's global state or None where numpy is not imported)
HostState = tuple[Any, Any]


def capture() -> HostState:
    """The state of both generators, to :func:`restore` later."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def restore(state: HostState) -> None:
    """Set both generators to ``state`` (from :func:`capture`)."""
    python, numpy_state = state
    random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def fork() -> tuple[int, int | None]:
    """A seed drawn from each of the user's streams (Python's, numpy's where imported), for
    :func:`rejoin` to go on from after a block that seeds them its own way."""
    numpy = sys.modules.get("numpy")
    return random.getrandbits(64), None if numpy is None else int(numpy.random.randint(0, 1 << 32, dtype=numpy.uint64))


def rejoin(seeds: tuple[int, int | None]) -> None:
    """Seed the generators with the seeds :func:`fork` drew: the user's streams go on from there."""
    random.seed(seeds[0])
    numpy = sys.modules.get("numpy")
    if numpy is not None and seeds[1] is not None:
        numpy.random.seed(seeds[1])


def moved(state: HostState) -> bool:
    """Whether either generator was drawn from since ``state`` (from :func:`capture`)."""
    python, numpy_state = capture()
    return python != state[0] or not _same(numpy_state, state[1])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays (the Mersenne Twister's key)
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def own_generators(module: Any) -> list[tuple[str, Any]]:
    """(path, generator) of every generator object of its own (``random.Random``, numpy's ``RandomState``
    and ``Generator``) that ``module`` (an ``nn.Module``) or a submodule holds: as an attribute, in a
    list, tuple or dict it holds, or on a plain object it holds (two levels down); and those the
    forwards reach by a global name (a module-level generator, or one in a module-level dict)."""
    kinds: tuple[type, ...] = (random.Random,)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += (numpy.random.RandomState, numpy.random.Generator)
    found: dict[int, tuple[str, Any]] = {}
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            _collect(value, f"{path}.{name}" if path else name, kinds, found, depth=2)
        forward = getattr(type(sub), "forward", None)
        code, names = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
        for name in getattr(code, "co_names", ()):
            if name in names:
                _collect(names[name], f"global {getattr(forward, '__module__', '?')}.{name}", kinds, found, depth=1)
    return list(found.values())


def _collect(value: Any, path: str, kinds: tuple[type, ...], found: dict[int, tuple[str, Any]], depth: int) -> None:
    """Generators of ``kinds`` in ``value``, looking ``depth`` levels into containers and plain objects."""
    if isinstance(value, kinds):
        if not isinstance(value, random.SystemRandom):  # (that one has no state)
            found.setdefault(id(value), (path, value))
        return
    if depth <= 0 or isinstance(value, (str, bytes, type)) or callable(value) or hasattr(value, "shape"):
        return  # classes, functions, tensors and arrays hold no generator of the layer's
    if isinstance(value, dict):
        items: Any = ((f"{path}[{k!r}]", v) for k, v in list(value.items())[:64])
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value[:64]))
    elif hasattr(value, "__dict__") and not isinstance(value, types.ModuleType) and not _is_module(value):
        items = ((f"{path}.{k}", v) for k, v in list(vars(value).items())[:64])
    else:
        return
    for where, inner in items:
        _collect(inner, where, kinds, found, depth - 1)


def _is_module(value: Any) -> bool:
    return any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(value).__mro__)


def state_of(generator: Any) -> Any:
    """The state of a generator from :func:`own_generators`."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy's Generator
        return generator.bit_generator.state
    return generator.get_state(legacy=False)


def same_state(a: Any, b: Any) -> bool:
    """Whether two states from :func:`state_of` are equal."""
    return _same(a, b)


def seed(python_seed: int, numpy_seed: int) -> None:
    """Seed Python's ``random`` and, where imported, numpy's global generator (its seed: 32 bits)."""
    random.seed(python_seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(numpy_seed & 0xFFFFFFFF)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """The block leaves both generators as it found them."""
    state = capture()
    try:
        yield
    finally:
        restore(state)


class Replay:
    """A region run more than once (remat's checkpointed layer): its first run notes the state of both
    generators; every later run (a recomputation) starts from that state, and puts back after it the
    state it found, so that the compute around it draws on as if the recomputation had not run. A
    region whose first run drew nothing draws nothing when run again on the same inputs: its later
    runs are left alone (saving and setting numpy's state costs tens of microseconds each)."""

    __slots__ = ("_drew", "_first")

    def __init__(self) -> None:
        self._first: HostState | None = None
        self._drew = True

    @property
    def drew(self) -> bool:
        """Whether its first run drew from either generator (True until that run ends)."""
        return self._drew

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        if self._first is None:
            self._first = capture()
            yield
            self._drew = moved(self._first)
            return
        if not self._drew:
            yield
            return
        around = capture()
        restore(self._first)
        try:
            yield
        finally:
            restore(around)
