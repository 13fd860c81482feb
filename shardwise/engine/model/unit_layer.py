"""One unit of the call-recording split (``capture.py``) as a layer on the carry."""

from __future__ import annotations

from collections.abc import Hashable

from torch import Tensor, nn

from ..torch_api import storage_key
from .carry import (
    Layout,
    Slot,
    absent_marker,
    hidden_of_output,
    output_parts,
    with_hidden,
)
from .module_call import ThreadReplicas
from .reuse import module_signature


def own_copies(carry: tuple[Tensor, ...], params: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """``carry`` with each tensor that lives in the memory of the layer's parameters copied (autograd
    follows the copy back to them). A parameter the code before the units hands on as it is, or a view
    of it (DeBERTa's rel_embeddings table, given to every layer), would otherwise travel as the
    parameter's own memory: ZeRO-3 frees a unit's gathered parameters after its forward, and the next
    layer read a freed buffer."""
    own = {storage_key(t) for t in params.values() if isinstance(t, Tensor)}
    if not own:
        return carry
    return tuple(t.clone() if isinstance(t, Tensor) and storage_key(t) in own else t for t in carry)


class UnitFn:
    """One unit on the carry: ``unit(hidden, **its arguments)``; the carry with the new hidden state."""

    def __init__(
        self, unit: nn.Module, path: str, index: int, layout: Layout, slot: Slot,
        writes: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.replicas = ThreadReplicas(unit, prefix=path + ".")
        self.path, self.index, self.layout, self.slot = path, index, layout, slot
        self.writes = writes  # (output index, carry index): what it hands the later units (carry_writes)
        # Read off the model's own unit (its skeleton is a copy: the config it shares with the other
        # units would compare unequal): units of one kind, called alike, compute alike.
        signature = module_signature(unit)
        self._reuse_key = None if signature is None else (UnitFn, signature, slot, layout.units[index], writes)

    def reuse_key(self) -> Hashable | None:
        """Equal for units that compute alike (see ``engine/model/reuse.py``)."""
        return self._reuse_key

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rest_args, rest_kwargs = self.layout.units[self.index].rebuild(carry)
        args, kwargs = with_hidden(carry[0], self.slot, rest_args, rest_kwargs)
        out = self.replicas.get().call(tensors, args, kwargs)
        new = [hidden_of_output(self.path, out), *carry[1:]]
        if not self.writes:
            return tuple(new)
        for k, where in self.writes:
            part = (output_parts(out) or ())[k]  # a tuple or ModelOutput, as recorded
            new[where] = absent_marker() if part is None else part
        # What it hands on may be (a view of) its own parameter, which ZeRO-3 frees after this forward.
        return own_copies(tuple(new), tensors)

    def __repr__(self) -> str:
        return f"functional_call({type(self.replicas.module).__name__})"
