"""A forward's own ``F.embedding(..., scale_grad_by_freq=True)`` refused at a step that cuts the batch, on the
layer's first call, where functionalize saw no call (engine/model/functional_frequencies.py).

functionalize sees such a call only where it runs a layer on an example input; without one (or for a
meta-built model's unit reused from an identical one) nothing tells it before a step runs the layer, and a
forward is never run once more to find it (its Python may count its calls). So a step that cuts the batch
(``compose.cutting_the_batch``: ZeRO's shares, accumulation's or a pipeline's micro-batches, expert or
context parallel's parts) watches each layer's first call on each rank thread with functional_frequencies'
TorchFunctionMode, and refuses at the op itself, before it runs, with the words the transform's refusal uses
when functionalize saw the call. Every rank that runs the layer makes the same call at the same point of its
forward, so all of them refuse there alike, before any collective after it (a pipeline's other stages learn
it as any rank's failure, as for the other first-call refusals). Later calls cost a set lookup; the one-device
step, tensor_parallel alone and a pipeline of one micro-batch watch nothing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ..model.functional_frequencies import layer_paths, watching
from ..model.whole_batch import FREQUENCIES, WholeBatch
from ..stack.compose import refuse_frequencies
from .thread_token import thread_token

# layer -> the threads whose first call of it a batch-cutting step watched (a rank thread runs its own copy).
_WATCHED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class FrequencyWatch:
    """One rank's step's watch; ``cut``: the transform that cuts the batch, in the words of its refusal
    (``"shard_params (data parallel over axis 'dp')"``), or None where the step does not cut it."""

    def __init__(self, cut: str | None) -> None:
        self.cut = cut
        self._seen: set[str] = set()  # the layers this step has called (asked of every call: a set lookup)

    def around(self, name: str, chain: Any) -> contextlib.AbstractContextManager[Any] | None:
        """The watch around layer ``name``'s call, on its first call on this thread under a batch-cutting
        step; None otherwise."""
        if self.cut is None or name in self._seen:
            return None
        self._seen.add(name)
        layer = chain[name]
        with _LOCK:
            if thread_token() in _WATCHED.get(layer, ()):
                return None
        return _watched(layer, name, self.cut)


@contextlib.contextmanager
def _watched(layer: Any, name: str, cut: str) -> Iterator[None]:
    """Refuse a frequency-scaled call in ``layer``'s call at the op; a call that ends (not refused, not
    failed) marks the layer watched on this thread."""

    def refuse(path: str, call: str) -> None:
        refuse_frequencies(WholeBatch(path, FREQUENCIES, call), cut)

    with watching(layer_paths(layer), name, refuse):
        yield
    with _LOCK:
        _WATCHED.setdefault(layer, set()).add(thread_token())
