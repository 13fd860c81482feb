"""The module functionalize splits: a ``torch.compile``'d model or block as its uncompiled code.

A layer calls its module with the layer's tensors swapped in (``module_call``). A compiled
module does not run on them: ``module.compile()`` compiles the original object's bound
``_call_impl``, so every copy of it (the chain's skeleton, each thread's replica) would still
call the original module, on the original's parameters, and ``torch.compile(module)``'s
wrapper calls the module it wrapped. Dynamo also guards on the parameters it saw: swapping
others in every call would recompile. So functionalize splits the uncompiled module: each
``OptimizedModule`` stands for its ``_orig_mod`` (names without ``_orig_mod.``, as in the
uncompiled model's state_dict) and ``compile()`` on a module is set aside. The user's module is
not changed: the view is a tree of shallow copies sharing its tensors and other attributes.
"""

from __future__ import annotations

import copy

from torch import nn

from ..torch_api import compiled_in_place, compiled_original, drop_compiled_call

__all__ = ["is_compiled", "uncompiled"]


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule of it is ``torch.compile``'d (wrapped or in place)."""
    return any(compiled_original(m) is not None or compiled_in_place(m) for m in module.modules())


def uncompiled(module: nn.Module) -> nn.Module:
    """``module`` itself if nothing in it is compiled, else a view of it that runs uncompiled."""
    if not is_compiled(module):
        return module
    return _view(module, {})


def _view(module: nn.Module, seen: dict[int, nn.Module]) -> nn.Module:
    original = compiled_original(module)
    if original is not None:
        return _view(original, seen)
    if id(module) in seen:  # a submodule under two names stays one module
        return seen[id(module)]
    twin = copy.copy(module)
    seen[id(module)] = twin
    if compiled_in_place(twin):
        drop_compiled_call(twin)
    # Its own containers, so nothing done to the view (a swap, a hook) reaches the user's module.
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    for name, value in vars(module).items():
        if name.startswith(("_forward", "_backward", "_state_dict", "_load_state_dict")) and isinstance(value, dict):
            setattr(twin, name, copy.copy(value))  # hook dicts (OrderedDicts keep their type)
    twin._modules = {k: None if v is None else _view(v, seen) for k, v in module._modules.items()}
    return twin
