"""Verification tools, public: the equivalence checker and hypothesis strategies.

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

__all__ = [
    "DEFAULT_RTOL",
    "EquivalenceReport",
    "NotEquivalentError",
    "assert_equivalent",
    "compare_histories",
    "record_history",
]
