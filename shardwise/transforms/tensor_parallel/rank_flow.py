"""What one rank's forward through a tensor-parallel layer carries from one styled module to the next.

Per thread (a threads-backend rank is a thread): the flow (:data:`flow`: how many Regions it is inside,
whether the last split module left its output split, the paths a Region reads) and the random streams (a
rank draws its own stream on per-rank values, the shared one on replicated values). The styled modules'
forwards (``modules.py``) and the layer functions around them (``layer_rewrite.py``) both read and set them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ...engine.run.rng import default_generators, mix
from ...engine.stack import in_layer

# What this rank's layers have run, per thread (rank): .regions, how many Regions it is inside;
# .split_output, whether the last split module it ran left its output split (a sharded Colwise);
# .splits, while a Region reads its paths, the split layers' outputs it ran (label, grad_fn node);
# .sides, while a layer asks where its Regions use their replicated parameters (layer_rewrite.VaryFn), the answers.
flow = threading.local()


def split_by() -> str:
    """The module that left the output split (see output_is_split), for errors."""
    return str(getattr(flow, "split_by", "a Colwise"))


def output_is_split() -> bool:
    """Whether the last split module this rank ran left its output split (the logits of a head)."""
    return bool(getattr(flow, "split_output", False))


def split_width() -> int | None:
    """The width of the split output (the rank's slice of the vocabulary), where the last split module left one."""
    width = getattr(flow, "split_width", None)
    return width if output_is_split() else None


def forget_split_output() -> None:
    """The end of a forward (the loss): nothing is split any more."""
    flow.split_output, flow.split_width = False, None


# -- random streams: per rank on per-rank values, shared on replicated ones ------------------------
_streams = threading.local()  # .saved: the shared streams' state while this rank draws its own


@contextlib.contextmanager
def rank_stream(axis: str, args: tuple[Any, ...], kwargs: dict[str, Any], sticky: bool) -> Iterator[None]:
    """Inside the block the default generators draw this rank's own stream (see start_rank_stream),
    until a Rowwise sums the region's output (then the shared stream goes on, as on every rank:
    dropout on the replicated residual stream agrees); ``sticky`` (a sequence-parallel block, whose
    values are all per-rank) keeps the rank's stream to the end of the block."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    if not start_rank_stream(axis, tensors[0].device if tensors else torch.device("cpu"), sticky):
        yield  # predicting, or already inside a stream of this rank's
        return
    try:
        yield
    finally:
        back_to_shared(force=True)


def start_rank_stream(axis: str, device: torch.device, sticky: bool = False) -> bool:
    """From here this rank draws its own stream, seeded from one draw of the shared one (so the shared
    streams stay alike on every rank, and a recomputation, from the state torch's checkpoint restores,
    replays both), until back_to_shared. Alone (not sticky) it is what a Colwise that entered the
    region itself begins, with no Region around it to say where per-rank values begin: a Rowwise
    ends it, or the end of the layer (layer_rewrite.VaryFn). False when it did not begin one (predicting, or one
    already runs)."""
    if in_layer.predicting_now() or getattr(_streams, "saved", None) is not None:
        return False
    gens = default_generators(device)
    base = int(torch.empty((), dtype=torch.int64).random_().item())
    _streams.saved, _streams.gens, _streams.sticky = [g.get_state() for g in gens], gens, sticky
    for i, g in enumerate(gens):
        g.manual_seed(mix(base, in_layer.index(axis), i))
    return True


def back_to_shared(force: bool = False) -> None:
    """The shared streams again, where this rank left them (after a Rowwise sums a region's output)."""
    saved = getattr(_streams, "saved", None)
    if saved is None or (_streams.sticky and not force):
        return
    for g, state in zip(_streams.gens, saved, strict=True):
        g.set_state(state)
    _streams.saved = None
