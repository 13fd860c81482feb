"""A number for the calling thread that no other thread of the process ever gets.

``threading.get_ident()`` is reused: a thread started after another ended may get its number. A watch
that remembers the threads that ran a layer's first call (forward_state.py, frequency_watch.py) would then
take a new rank thread of a later ``launch``, whose copy of the module is new (a thread-local one), for
one it has watched, and skip the checks of its first call: a launch refused for state set from a rank's
share of the batch trained without an error when run again in the same process.
"""

from __future__ import annotations

import itertools
import threading

_local = threading.local()
_numbers = itertools.count()  # (next() on it is one bytecode-free C call: atomic under the GIL)


def thread_token() -> int:
    """This thread's number: the same for its whole life, never another thread's."""
    token = getattr(_local, "token", None)
    if token is None:
        token = _local.token = next(_numbers)
    return token
