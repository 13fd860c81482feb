"""torch's fused inference path for attention (``torch.backends.mha``'s fast path), off where shardwise runs a
model's layers outside training's conditions.

``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` take a fused kernel in
eval mode without gradients, never in training; the encoder also packs a padded batch into a nested tensor
there. functionalize's check runs the module whole and the chain per layer in those conditions, which would
take the path at different levels (the whole encoder, one layer) and round apart (5e-16); and the replays of
the code around the units run the layers before a gap in eval mode without gradients (their output is thrown
away), where the encoder then handed a nested tensor to the units' stand-ins and torch failed at the first step
(``aten::to_padded_tensor`` on a dense tensor; units at some layers of the stack only). Off in both, as in the
training the step does. The switch is process-wide: thread ranks share one count, so the last to leave sets it
back as the first found it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

_LOCK = threading.Lock()


class _Inside:
    """Under _LOCK: how many are inside :func:`without_fused_attention`, and the switch as the first found it."""

    count = 0
    found = True

# The modules whose forward reads the switch (their own, or their layers' through them).
TAKES_THE_FAST_PATH = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder,
                       nn.TransformerDecoderLayer, nn.TransformerDecoder, nn.Transformer)


def holds_fused_attention(module: nn.Module) -> bool:
    """Whether ``module`` or a module in it may take torch's fused attention path."""
    return any(isinstance(m, TAKES_THE_FAST_PATH) for m in module.modules())


@contextlib.contextmanager
def without_fused_attention() -> Iterator[None]:
    """torch's fused attention path off inside (set back as it was found once every thread has left)."""
    with _LOCK:
        if _Inside.count == 0:
            _Inside.found = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _Inside.count += 1
    try:
        yield
    finally:
        with _LOCK:
            _Inside.count -= 1
            if _Inside.count == 0:
                torch.backends.mha.set_fastpath_enabled(_Inside.found)
