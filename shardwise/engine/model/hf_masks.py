"""transformers' attention-mask decisions made on a meta build's recording as on real tensors.

transformers leaves out a mask SDPA does not need (no padded row: its ``is_causal`` does it) unless
``is_tracing(tensor)`` says the mask's inputs are being traced, which it says of any fake tensor
(``transformers.masking_utils`` reads ``is_tracing``, a private helper; ``tests/engine/test_hf_masks.py``
fails loudly when transformers changes it). The recording of a model built on the meta device runs the code
after its first unit on fake tensors (``recording.py``): an encoder-decoder's decoder mask (BART's, Marian's)
was made there, where the real run leaves it None, and a pipeline's Plan predicted a tensor between stages that
the run does not pass (a false refusal). While that fake run goes on, ``masking_utils`` is given an
``is_tracing`` blind to fake tensors: a decision that reads no data (no padding mask) is made as at run time,
and one that reads data raises on the fake tensor, so the recording runs again on real stand-ins
(``functionalize.py``), whose decisions are the run's.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_MODULE = "transformers.masking_utils"
_blind = contextvars.ContextVar("shardwise_masks_blind_to_fake", default=False)
_installed: set[int] = set()  # id of each masking_utils module given the wrapper (once: thread ranks share it)
_lock = threading.Lock()


def _is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _wrapped(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_tracing(tensor: Any = None) -> bool:
        if _blind.get() and _is_fake(tensor):
            return bool(original(None))  # dynamo, jit and stream capture still count
        return bool(original(tensor))

    is_tracing.__wrapped__ = original  # type: ignore[attr-defined]
    return is_tracing


@contextlib.contextmanager
def mask_decisions_as_at_run_time() -> Iterator[None]:
    """Inside the block, on this thread, transformers' mask decisions treat fake tensors as real data."""
    module = sys.modules.get(_MODULE)
    if module is not None and callable(getattr(module, "is_tracing", None)):
        with _lock:  # the wrapper stays: it reads the context variable, so no thread undoes another's
            if id(module) not in _installed:
                setattr(module, "is_tracing", _wrapped(module.is_tracing))  # noqa: B010 - a module of transformers
                _installed.add(id(module))
    token = _blind.set(True)
    try:
        yield
    finally:
        _blind.reset(token)
