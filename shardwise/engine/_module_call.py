"""Call a module with given tensors in place of its parameters and buffers, cheaply.

``torch.func.functional_call`` walks the module's named parameters and buffers on
every call (to untie aliases, check keys and swap), about 20 us per call on a small
module: in a pipeline of many small layers and micro-batches that is a visible
share of the step. :class:`ModuleCall` does that walk once, remembering for each
qualified name the submodule and the slot of its ``_parameters`` / ``_buffers``
dict (the private containers ``functional_call`` itself swaps through), and then
only swaps the tensors in and out around ``module(x)``. The module's code runs
unchanged on the same tensors, so the result is bitwise ``functional_call``'s.

Semantics are ``functional_call(module, tensors, (x,), strict=True,
tie_weights=True)``: ``tensors`` must name every parameter and buffer once (an
alias of a tied tensor under its first name only) and the given tensor is used
under every alias. Any other key set goes to ``functional_call`` itself, which
handles it or raises its own error. A module that does not keep a tensor in those
dicts (one reparametrized with a property, say) is not handled here and always
takes ``functional_call``. tests/engine/test_module_call.py fails loudly if torch
changes where modules keep their tensors.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

_Slot = tuple[dict[str, Any], str, str]  # (the submodule's _parameters or _buffers, attribute, key in tensors)


class ModuleCall:
    """``functional_call(module, tensors, (x,), strict=True)``, with the name walk done once."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._slots, self._keys = _slots_of(module)

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        if self._slots is None or tensors.keys() != self._keys:
            return functional_call(self.module, tensors, (x,), strict=True)
        slots = self._slots
        originals = [container[attr] for container, attr, _ in slots]
        try:
            for container, attr, key in slots:
                container[attr] = tensors[key]
            return self.module(x)
        finally:
            for (container, attr, _), original in zip(slots, originals, strict=True):
                container[attr] = original


def _slots_of(module: nn.Module) -> tuple[list[_Slot] | None, frozenset[str]]:
    """Every (container, attribute, key) to swap, or None if a tensor is not kept in a container."""
    first_name: dict[int, str] = {}  # id(tensor) -> the name functional_call's caller gives it
    slots: list[_Slot] = []
    for kind, named in (
        ("_parameters", module.named_parameters(remove_duplicate=False)),
        ("_buffers", module.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            owner_path, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            container = getattr(owner, kind, None)
            if not isinstance(container, dict) or container.get(attr) is not tensor:
                return None, frozenset()
            key = first_name.setdefault(id(tensor), name)
            slots.append((container, attr, key))
    return slots, frozenset(first_name.values())

