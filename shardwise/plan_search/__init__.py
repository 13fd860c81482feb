"""plan_search: the best parallel layouts of a step on a cluster, ranked by the simulated Plan,
bounded by the predicted memory, certified by the equivalence checker.

Sits on top, beside ``testing`` (which it uses to certify): it imports the engine's public
modules, the transforms and ``testing``, never the CLI. One module per concern:
``candidate`` (a layout as data, applied with the real transforms), ``space`` (what to try),
``compute`` (single-device costs, measured or from FLOPs), ``rank`` (one candidate planned,
checked against the budget and simulated), ``certify``, ``result`` (the ranking, refusals,
frontier and table), ``plot`` and ``driver`` (:func:`search`). ``sw.search`` is the function;
the other names are imported from here (``from shardwise.plan_search import Space``).

>>> from shardwise.plan_search import Candidate
>>> str(Candidate(dp=2, tp=2, zero_stage=1))
'dp2 x tp2 zero1'
"""

from .candidate import Candidate
from .certify import certify
from .compute import FlopCompute, LayerCosts, MeasuredCompute, params_per_layer
from .driver import search
from .plot import plot_frontier
from .rank import Priced, Refused
from .result import SearchResult, frontier
from .space import Space
from .units import parse_bytes

__all__ = [
    "Candidate",
    "FlopCompute",
    "LayerCosts",
    "MeasuredCompute",
    "Priced",
    "Refused",
    "SearchResult",
    "Space",
    "certify",
    "frontier",
    "params_per_layer",
    "parse_bytes",
    "plot_frontier",
    "search",
]
