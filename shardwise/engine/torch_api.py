"""The private torch APIs shardwise relies on, each wrapped here and checked by tests/engine/test_storage.py.

Free a tensor's memory and refill it later, unseen by autograd (what FSDP does).

A gathered parameter buffer is used by a layer's forward, whose autograd graph
keeps views of it until that layer's backward. To really free the memory in
between, the storage is resized to zero bytes, and re-allocated and refilled
with the same values right before the backward. Autograd's version counter
would take the refill for a modification of a saved tensor, so the refill
runs under torch's ``_unsafe_preserve_version_counter``: a private API, used
here and nowhere else, checked by tests/engine/test_storage.py. ``storage_key`` reads
a storage's private ``_cdata`` address, ``version_of`` a tensor's version counter, and ``fake_tensors``
runs code on fake tensors
(``torch._subclasses.FakeTensorMode``): shapes, dtypes and kernel choices of the real
device, no data and no arithmetic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

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


def version_of(t: torch.Tensor) -> int:
    """How many in-place writes ``t``'s memory has seen (autograd's version counter, the private
    ``_version``): a layer that wrote into one of its buffers changed it."""
    return t._version


def storage_key(t: torch.Tensor) -> int:
    """Identifies the memory a tensor lives in: views and detached copies share it. The storage
    implementation's address (``_cdata``, private) is used because meta tensors all have data
    pointer 0 while each still has a storage of its own."""
    return t.untyped_storage()._cdata


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (made inside :func:`fake_tensors`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def data_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise where a computation reads data to decide a shape (``nonzero``, a
    mixture-of-experts' routing, ``.item()``): whoever runs a model on fake tensors catches these
    and falls back to real (stand-in) tensors. Private torch classes, named in this one place."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DataDependentOutputException, DynamicOutputShapeException)


@contextlib.contextmanager
def fake_tensors(meta_device: torch.device | str = "cpu") -> Iterator[Callable[[Any], Any]]:
    """Inside the block, ``fake(t)`` turns a real tensor into a fake one on the same device, and
    a meta tensor (a parameter of a meta-built model) into a fake one on ``meta_device``.

    Unlike ``device="meta"``, a fake CPU tensor dispatches to the CPU kernels' choices
    (scaled_dot_product_attention picks the same backend), so what a layer saves is the same.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.is_meta:  # made inside the mode: a fake tensor, no memory
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=meta_device)
            return mode.from_tensor(t)

        yield fake
