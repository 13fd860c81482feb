"""A mixture-of-experts block of one's own, whose forward calls :func:`moe_dispatch_combine` itself.

expert_parallel replaces the forward of the blocks it knows (``blocks.py``). A block of any class that
holds fused experts (``experts.gate_up_proj`` / ``experts.down_proj``) and whose forward already calls
the expert-parallel core is split as written: its experts are cut over the axis like a known block's
(the forward gets this rank's slice), and its forward runs inside :class:`OwnForward`, which tells
the calls it makes what the step's split is (:func:`current`):

* the axis: a call over another axis would route over the wrong ranks, so it is refused;
* the all-to-alls' rows: a call that leaves ``slots=None`` gets the bound a known block's call gets
  (its tokens, or the capacity), so the Plan predicts the step's bytes exactly on fake tensors;
* drops: with a ``capacity_factor`` each rank drops the assignments over the capacity of its own
  tokens, which the single-device step (capacity over the whole batch) would not: a call that drops
  one is refused unless ``expert_parallel(..., drop_per_rank=True)``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch import nn


class OwnSplit(NamedTuple):
    """The expert-parallel split a block of one's own runs under."""

    axis: str
    drop_per_rank: bool
    where: str  # the block's path, for errors


_split: contextvars.ContextVar[OwnSplit | None] = contextvars.ContextVar("shardwise_ep_own_block", default=None)


def current() -> OwnSplit | None:
    """The split of the block of one's own whose forward is running, if any."""
    return _split.get()


@contextlib.contextmanager
def _running(split: OwnSplit) -> Iterator[None]:
    token = _split.set(split)
    try:
        yield
    finally:
        _split.reset(token)


class OwnForward:
    """A block of one's own's forward, as its class wrote it, run inside its split (:func:`current`)."""

    def __init__(self, module: nn.Module, axis: str, drop_per_rank: bool, where: str) -> None:
        self.module, self.split = module, OwnSplit(axis, drop_per_rank, where)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _running(self.split):
            return type(self.module).forward(self.module, *args, **kwargs)
