"""Peak resident memory of this process, as the kernel counts it (Linux): for memory benchmarks
and tests that measure what a rank really holds.

``PeakRSS()`` resets the kernel's high-water mark (VmHWM) to the current resident size and
remembers that size; ``peak()`` is VmHWM above it since. Run ranks with glibc's mmap and trim
thresholds fixed low (``LIVE_MALLOC``) so that freed tensors go back to the system at once and
RSS follows live memory; torch's CPU allocator caches nothing.

>>> import sys
>>> if sys.platform.startswith("linux"):
...     meter = PeakRSS()
...     assert meter.peak() >= 0
"""

from __future__ import annotations

import gc

__all__ = ["LIVE_MALLOC", "PeakRSS", "status_bytes"]

# glibc reads these at process start: set them in the environment of the processes to measure.
LIVE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``"VmRSS"``, ``"VmHWM"``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {key!r}")


class PeakRSS:
    """The high-water mark of resident memory from now on, above the resident size now."""

    def __init__(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel resets VmHWM to the current VmRSS
        self.base = status_bytes("VmRSS")

    def peak(self) -> int:
        return status_bytes("VmHWM") - self.base

    def now(self) -> int:
        """Resident memory now, above the base."""
        return status_bytes("VmRSS") - self.base
