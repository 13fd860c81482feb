"""Hooks on the model itself, which a split model never runs: refused.

``functionalize`` splits a model into layers (an ``nn.Sequential``'s children, or ``units=``) that the step calls
one by one; the model's own ``__call__`` never runs, and with it neither the hooks registered on the model
(``model.register_forward_pre_hook`` normalizing the input, a forward hook scaling the output, a full backward
hook) nor a ``forward`` set on the instance (``model.forward = ...``, as accelerate wraps a model). The step
trained another model than torch's loop, on one device too (the review: 0.56 of the loss), without an error. The
same hooks on a submodule run with it, and a model kept whole (one layer) runs its own ``__call__``.
"""

from __future__ import annotations

from torch import nn

from .fx_split import FunctionalizeError

_HOOKS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}


# Hooks that only look (transformers' DebugUnderflowOverflow, the Trainer's --debug underflow_overflow, puts one on
# every module, the root too): not refused; on the root they do not run, which changes nothing the step computes.
_LOOKING = ("transformers.debug_utils",)


def _only_looks(hook: object) -> bool:
    owner = getattr(hook, "__self__", hook)
    module = getattr(hook, "__module__", None) or type(owner).__module__
    return str(module).startswith(_LOOKING) or type(owner).__module__.startswith(_LOOKING)


def refuse_root_hooks(model: nn.Module) -> None:
    """Refuse hooks registered on ``model`` itself, or a forward set on the instance, when it is split."""
    found = [f"{kind} {getattr(hook, '__qualname__', type(hook).__name__)}"
             for attr, kind in _HOOKS.items() for hook in getattr(model, attr, {}).values() if not _only_looks(hook)]
    if "forward" in vars(model):
        found.append(f"a forward set on the instance ({getattr(vars(model)['forward'], '__qualname__', '?')})")
    if found:
        raise FunctionalizeError(
            f"functionalize: {type(model).__name__} has {', '.join(found)} on the model itself, and the split "
            "model's layers are called one by one, never through the model's own call: it would not run, and the "
            "step would train another model than torch's loop. Register it on the submodule it belongs to (a "
            "pre-hook on the first layer, a forward hook on the last), do its work in the batch or the loss, or "
            "remove it (model.forward = type(model).forward.__get__(model) undoes an instance's forward)"
        )
