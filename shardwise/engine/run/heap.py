"""Memory a step frees stays with the process for the next step, under glibc's malloc.

A CPU step frees its gradients (and the optimizer's temporaries) at its end, megabytes at the top
of glibc's heap. glibc gives free memory at the top back to the OS once it passes its trim
threshold, and the next step's backward faults the same pages in again: on the 8 x Linear(512)
MLP, 2,016 minor page faults a step, about a third of its time. glibc moves that threshold itself:
when a program frees a chunk it had mapped on its own (one above the mmap threshold, at most
32 MB), it raises the mmap threshold to that chunk's size and the trim threshold to twice it, so
that a program that frees big blocks again and again keeps them. Here the step asks for that once
with a block the size of its gradients (:func:`keep_freed`): from then on a step's freed memory
(below twice that, 64 MB at most) stays in the heap, and what it allocates again reuses it.

A process whose thresholds were fixed (``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
in its environment, ``mallopt``) keeps them: glibc then moves neither. Elsewhere than glibc this
does nothing.
"""

from __future__ import annotations

import ctypes

# glibc moves its thresholds only for a freed mapped chunk of at most 32 MB (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit), the chunk's header and page rounding included.
_LARGEST = (32 << 20) - (64 << 10)
_asked = [0]  # the largest block asked for so far in this process


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (present in glibc only)
    except (OSError, AttributeError, TypeError):  # not glibc (or no C library to open this way)
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def keep_freed(nbytes: int) -> None:
    """Let glibc keep up to ``2 x nbytes`` (at most 64 MB) of freed memory at the top of its heap,
    and take blocks below ``nbytes`` from it, by mapping and freeing one block of ``nbytes``
    (untouched: no page of it is faulted in). Once per size and process."""
    size = min(int(nbytes), _LARGEST)
    if size <= _asked[0]:
        return
    _asked[0] = size
    libc = _glibc()
    if libc is None:
        return
    block = libc.malloc(size)
    if block:
        libc.free(block)
