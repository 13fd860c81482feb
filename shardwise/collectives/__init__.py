"""Meshes, backends, differentiable collectives and the communication ledger."""

from .backends.base import Group
from .errors import CollectiveError, CollectiveTimeout, RankAborted, RankFailed, RankHung
from .handle import Handle
from .launch import launch
from .ledger import CommRecord, Ledger, OpSummary, comm_ledger
from .mesh import Mesh
from .mesh_context import current_mesh, use_mesh
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
    "RankHung",
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
