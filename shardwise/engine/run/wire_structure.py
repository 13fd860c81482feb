"""The structure of a stage output whose shapes the Plan could not predict, sent ahead of its tensors.

Where a stage's code is data-dependent (an MoE block routing on values without expert parallel),
the Plan cannot predict its output on fake tensors, so the receiver cannot know how many tensors
come or what they are rebuilt into. The sender then sends a header first: the tensor count and the
output's pytree structure (an optree ``PyTreeSpec``, pickled), as one uint8 tensor. The receiver
unpickles only what a structure is made of: optree's ``PyTreeSpec`` and the container types optree
flattens (builtins, named tuples, the types registered as pytree nodes in its global namespace, such
as a transformers ``ModelOutput``), from modules already imported (both ranks run the same program);
any other class, or a module not loaded, is refused, so a header can make no code run.
"""

from __future__ import annotations

import builtins
import io
import pickle
import struct
import sys
from typing import Any

import optree
import torch

from ..model.pytrees import GLOBAL_NAMESPACE

_COUNT = struct.Struct("<Q")


def encode(count: int, spec: Any | None) -> torch.Tensor:
    """The header of a transfer of ``count`` tensors rebuilt into ``spec`` (None: a tensor or a flat
    tuple of them, which needs no structure)."""
    body = b"" if spec is None else pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(_COUNT.pack(count) + body), dtype=torch.uint8)


def decode(header: torch.Tensor) -> tuple[int, Any | None]:
    """``(count, spec or None)`` from a header :func:`encode` made."""
    raw = header.to("cpu", torch.uint8).numpy().tobytes()
    if len(raw) < _COUNT.size:
        raise ValueError(f"a pipeline transfer's header holds {len(raw)} bytes, fewer than its count's {_COUNT.size}")
    (count,) = _COUNT.unpack_from(raw)
    body = raw[_COUNT.size:]
    return count, (_StructureUnpickler(io.BytesIO(body)).load() if body else None)


class _StructureUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("optree", "PyTreeSpec"):
            return optree.PyTreeSpec
        found = _container(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"a pipeline transfer's structure names {module}.{name}, which is not a container optree flattens"
            )
        return found


def _container(module: str, name: str) -> type | None:
    """The class ``module.name`` if it is a pytree container: a named tuple or a type registered with optree."""
    found = getattr(builtins if module == "builtins" else sys.modules.get(module), name, None)
    if not isinstance(found, type):
        return None
    named_tuple = issubclass(found, tuple) and hasattr(found, "_fields")
    registered = optree.register_pytree_node.get(found, namespace=GLOBAL_NAMESPACE) is not None
    return found if named_tuple or registered or found is type(None) else None
