"""Transitional: ``Handle`` moved to ``handle.py``; import it from ``shardwise.collectives``.

Only ``transforms/pipeline/runtime.py`` still imports this path; delete this
module once it imports ``from ...collectives import Handle``.
"""

from .handle import Handle

__all__ = ["Handle"]
