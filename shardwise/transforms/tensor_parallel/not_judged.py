"""A Region whose first call the probe (region_probe.py) could not judge says so: a warning, once per module class and
cause in a process (the threads backend runs every rank in one process: one warning, not one per rank; a 32-layer
model's attentions under cp x tp: one warning, not 32)."""

from __future__ import annotations

import gc
import threading
import warnings

import torch

# What goes unchecked when a Region is not judged: the probe is the only check of these values.
UNCHECKED = ("per-head values its forward computes from the divided head counts through Python (math.sqrt, "
             "math.log2, range, float, .tolist(): ALiBi's get_slopes(self.n_head)) go unchecked for it, and so "
             "does an op across its heads")


class RegionNotJudged(UserWarning):
    """A tensor-parallel Region's first call was not judged by its values (``docs/tensor_parallel.md``: a per-head
    value computed from the rank's head count trains another model without an error). Said once per Region class and
    cause in a process, naming the Region, the cause and what to do. Silence it as any warning, by its class:

    >>> import warnings, shardwise as sw
    >>> warnings.filterwarnings("ignore", category=sw.tp.RegionNotJudged)  # for the whole program
    >>> with warnings.catch_warnings():  # or for a block
    ...     warnings.filterwarnings("ignore", category=sw.tp.RegionNotJudged)
    ...     warnings.warn("not shown", sw.tp.RegionNotJudged)
    >>> warnings.filters.pop(0)[2] is sw.tp.RegionNotJudged  # (this example's program-wide filter, taken back)
    True
    """


_said: set[tuple[object, str]] = set()
_lock = threading.Lock()


def say_not_judged(label: str, cls: str, cause: str, reason: str, advice: str, kind: object = None) -> None:
    """Warn that Region ``label`` (a ``cls``) was not judged, because ``reason`` (``cause`` is its short key),
    and what to do; once per (module class, cause) in the process (``kind``: the class itself, so that another
    class of the same name says so too; by default its name): the other Regions of that class are the same case
    (every layer's attention, another model of that class in a sweep), and one warning per layer would bury the
    rest (Python's default filter would show a second model's identical ones only once anyway)."""
    key = (cls if kind is None else kind, cause)
    with _lock:
        if key in _said:
            return
        _said.add(key)
    warnings.warn(
        f"tensor_parallel: Region {label!r} (a {cls}; said once in this process for every {cls} Region with this "
        f"cause) was not judged by its values on its first call: {reason}. "
        f"{UNCHECKED[0].upper()}{UNCHECKED[1:]}. {advice}",
        RegionNotJudged,
        stacklevel=2,
    )


def forget_said() -> None:
    """Warn again for every Region and cause (a test's fresh process)."""
    with _lock:
        _said.clear()


class NotJudged(Exception):
    """Why a Region's first call is not judged: ``cause`` (a short key: one warning per module class and key), the
    ``reason`` in words and the ``advice``."""

    def __init__(self, cause: str, reason: str, advice: str) -> None:
        super().__init__(reason)
        self.cause, self.reason, self.advice = cause, reason, advice


_CHECK = "or check the step against one device (sw.testing.assert_equivalent)"


def subclassed(names: list[str]) -> NotJudged:
    return NotJudged(
        "subclass", f"it was called on tensor subclasses ({', '.join(names)}), which its float64 copies do not copy",
        f"Run the first step on plain tensors to have it judged, {_CHECK}",
    )


def stateful(names: list[str]) -> NotJudged:
    return NotJudged(
        "state", f"it was called with {', '.join(names)} (an object that may hold state: a key/value cache, which "
        "its copies would change)",
        "Make the first call without it (a step without a cache: use_cache=False, past_key_values=None) to have the "
        f"Region judged, {_CHECK}",
    )


def gathered(path: str, what: str) -> NotJudged:
    return NotJudged(
        "gathered", f"it holds {what} {path!r}, whose values no rank computes alone",
        "Compute per-head tables at init (a buffer or parameter marked sw.tp.PerHead()) or from a whole count kept "
        f"in an attribute the Region does not divide, {_CHECK}",
    )


def drew() -> NotJudged:
    return NotJudged(
        "random", "its copies drew random numbers in eval mode (the module calls torch.rand / randn / ... itself), "
        "so their values do not compare",
        "Draw only in training mode (dropout modules, F.dropout(..., training=self.training)) to have it judged, "
        f"{_CHECK}",
    )


def unrelated(found: str) -> NotJudged:
    return NotJudged(
        "unrelated", f"{found} (split otherwise than one dim into tp parts)",
        "No style splits a tensor so today: please report it with the Region's plan",
    )


def reached_split(path: str) -> NotJudged:
    return _another_transform(f"its copies reached the rank's split module {path!r}")


def reached_collective(err: BaseException) -> NotJudged:
    return _another_transform(f"its copies reached a collective ({first_line(err)})")


def _another_transform(what: str) -> NotJudged:
    return NotJudged(
        "another transform", f"{what} through another transform's rewrite (context_parallel's attention under "
        "tensor_parallel), which they cannot run alone",
        "It is judged under tensor_parallel alone: run the same model and plan once without context_parallel "
        "(a tensor_parallel step's first call, or sw.testing.assert_equivalent of it against one device)",
    )


def failed(err: BaseException) -> NotJudged:
    return NotJudged(
        "failed", f"its copies could not run ({type(err).__name__}: {first_line(err)})",
        "They run the call's input again alone, in float64, on whole and split copies: an argument already laid "
        "out by the rank's heads (a per-head bias an earlier layer computed), code that refuses float64 or a "
        f"collective inside stops them; {_CHECK}",
    )


def out_of_memory(message: str, input_bytes: int) -> NotJudged:
    return NotJudged(
        "out of memory", f"its float64 copies did not fit in memory ({message}); the call's input tensors hold "
        f"{input_bytes / 2**20:.3g} MiB, and its three copies of the module run on the batch's first sample in "
        "float64, the whole copies with tp times the rank's parameters",
        "Free memory before the first step, or make the first batch (its first sample) smaller: the step went on "
        "and later calls are not judged",
    )


def owner_shared(dotted: str, owner: object) -> NotJudged:
    return NotJudged(
        "shared count", f"its count {dotted!r} is held by a {type(owner).__name__} that its copies cannot be given "
        "a copy of (every rank's thread may read it while they hold the whole count)",
        f"Hold the count on the module or on an object in one of its attributes (self.config), {_CHECK}",
    )


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, at most 200 characters."""
    line = (str(err).strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def give_back_memory() -> None:
    """After the copies failed for memory, and their references went with the exception: free them now (the
    twin modules' cycles too) and hand the device's cache back, before the step goes on."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
