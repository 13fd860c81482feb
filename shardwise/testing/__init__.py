"""Verification tools, public: the equivalence checker, the Plan held to a run, and hypothesis strategies.

>>> from shardwise.testing import assert_equivalent
"""

from .equivalence import (
    DEFAULT_RTOL,
    EquivalenceReport,
    NotEquivalentError,
    assert_equivalent,
    compare_histories,
    record_history,
)
from .plan_check import PlanNotRunError, assert_plan_is_run

__all__ = [
    "DEFAULT_RTOL",
    "EquivalenceReport",
    "NotEquivalentError",
    "PlanNotRunError",
    "assert_equivalent",
    "assert_plan_is_run",
    "compare_histories",
    "record_history",
]
