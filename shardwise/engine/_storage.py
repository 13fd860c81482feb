"""Free a tensor's memory and refill it later, unseen by autograd (what FSDP does).

A gathered parameter buffer is used by a layer's forward, whose autograd graph
keeps views of it until that layer's backward. To really free the memory in
between, the storage is resized to zero bytes, and re-allocated and refilled
with the same values right before the backward. Autograd's version counter
would take the refill for a modification of a saved tensor, so the refill
runs under torch's ``_unsafe_preserve_version_counter``: a private API, used
here and nowhere else, checked by tests/engine/test_storage.py.
"""

from __future__ import annotations

import torch

try:
    _preserve_version = torch.autograd._unsafe_preserve_version_counter
except AttributeError as exc:  # pragma: no cover - only on a torch that removed it
    raise ImportError(
        "shardwise needs torch.autograd._unsafe_preserve_version_counter (present in torch 2.1 to 2.13) to "
        "free sharded parameters between forward and backward; this torch no longer has it"
    ) from exc


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def free_storage(buffer: torch.Tensor) -> None:
    """Release ``buffer``'s memory; every view of it stays valid as an object but holds no data."""
    buffer.untyped_storage().resize_(0)


def refill_storage(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """Re-allocate a freed ``buffer`` and copy ``values`` in, keeping its autograd version."""
    if buffer.storage_offset() != 0 or not buffer.is_contiguous():
        raise ValueError("refill_storage needs a contiguous buffer that starts its storage")
    with torch.no_grad(), _preserve_version(buffer):
        buffer.untyped_storage().resize_(nbytes(buffer))
        buffer.copy_(values)


def owns_storage(t: torch.Tensor) -> bool:
    """True when ``t`` is exactly its whole storage (so resizing the storage resizes only ``t``)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes(t)
