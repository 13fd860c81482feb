"""Where a rank's layers read their parameters during a step (:class:`ParamSource`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..layout.in_flight import InFlightParams
from ..layout.sharding import FlatSharding


@dataclass
class ParamSource:
    """Where a rank's layers read their parameters: ``compute`` (full compute copies), or where ZeRO
    holds shards at rest (``FlatSharding.holds_shards``) the flat units of ``sharding`` gathered from
    ``gather_from`` (this rank's shards), each
    cast to its ``gather_dtypes`` entry (the compute dtype, where a precision policy gives one)
    as its all-gather is issued, before it travels."""

    compute: Mapping[str, Mapping[str, torch.Tensor]] | None = None
    sharding: FlatSharding | None = None
    gather_from: Mapping[str, torch.Tensor] | None = None
    gather_dtypes: Mapping[str, torch.dtype] | None = None
    # ZeRO-1/2 with overlap_gather: the full parameters the last step's all-gathers are still
    # bringing (``compute`` lacks their layers until each bucket's wait_params), and the cast of
    # what a wait brings into compute copies (the precision policy's).
    incoming: InFlightParams | None = None
    cast: Callable[[dict[str, dict[str, torch.Tensor]]], Mapping[str, Mapping[str, torch.Tensor]]] | None = None
    # ZeRO-1/2 under a precision policy that does not narrow (one that narrows holds shards, gathered
    # as ZeRO-3's are): ``compute`` holds this step's own copies, each of which
    # goes once its unit's gradients are taken (``ZeroActions.reduce_scatter``), as the backward
    # frees the activations.
    copies: bool = False

    def gather_dtype(self, unit: str) -> torch.dtype:
        """The dtype a ZeRO-3 unit travels and computes in."""
        assert self.gather_from is not None
        if self.gather_dtypes is not None and unit in self.gather_dtypes:
            return self.gather_dtypes[unit]
        return self.gather_from[unit].dtype

    def gather_input(self, unit: str) -> torch.Tensor:
        """This rank's shard of ``unit`` as its all-gather sends it: a new compute-dtype copy, made
        here rather than for every unit at the step's start, so that each lives only while its
        gather is in flight (as FSDP2's copy-in); the shard itself without a cast."""
        assert self.gather_from is not None
        return self.gather_from[unit].to(self.gather_dtype(unit))
