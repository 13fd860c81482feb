"""Meshes, backends, differentiable collectives and the communication ledger."""

from .backend import CollectiveError, CollectiveTimeout, Group, RankAborted
from .context import current_mesh, use_mesh
from .issue import Handle
from .launch import RankFailed, launch
from .ledger import CommRecord, Ledger, OpSummary, comm_ledger
from .mesh import Mesh
from .ops import (
    all_gather,
    all_gather_async,
    all_to_all,
    all_to_all_async,
    axis_index,
    axis_size,
    broadcast,
    broadcast_async,
    pmean,
    ppermute,
    ppermute_async,
    psum,
    psum_async,
    psum_scatter,
    psum_scatter_async,
    pvary,
)
from .p2p import recv, send

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "CommRecord",
    "Group",
    "Handle",
    "Ledger",
    "Mesh",
    "OpSummary",
    "RankAborted",
    "RankFailed",
    "all_gather",
    "all_gather_async",
    "all_to_all",
    "all_to_all_async",
    "axis_index",
    "axis_size",
    "broadcast",
    "broadcast_async",
    "comm_ledger",
    "current_mesh",
    "launch",
    "pmean",
    "ppermute",
    "ppermute_async",
    "psum",
    "psum_async",
    "psum_scatter",
    "psum_scatter_async",
    "pvary",
    "recv",
    "send",
    "use_mesh",
]
