"""What a Hugging Face model is collecting from its layers while they run: the one place shardwise reads
transformers' output capturing, a private part of it (``transformers.utils.output_capturing``).

transformers 5's ``@capture_outputs`` forward sets a collector (a context variable) holding a list per
output it was asked for (``router_logits`` under ``output_router_logits=True``, ``attentions``,
``hidden_states``), and hooks on its layers append to them while they run. Split into units, the layers run
one by one outside that forward, and the code after them finds the lists empty: SwitchTransformers'
z-loss failed inside transformers (``torch.cat`` of an empty list), other models returned short tuples.
``tests/engine/test_hf_collecting.py`` fails loudly when transformers changes this. The hooks go on at a
model's first call, which marks the model (``_output_capturing_hooks_installed``): a thread's copy of a model
that drops the hooks added after it was split must clear that mark, or its calls capture nothing.
"""

from __future__ import annotations

import sys

from torch import nn

_MODULE = "transformers.utils.output_capturing"


def collecting_now() -> tuple[str, ...]:
    """The outputs the running transformers forward collects from its layers, or () (none, or no
    transformers imported)."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return ()
    collector = module._active_collector.get()  # a CompileableContextVar: .get() as a ContextVar's
    if not collector:
        return ()
    return tuple(key for key in collector if not key.startswith("_"))


# The flag transformers sets on a model once its capturing hooks are on its layers (install_all_output_capturing_hooks):
# bookkeeping of the hooks, not state of the model's computation.
_INSTALLED = "_output_capturing_hooks_installed"
BOOKKEEPING = frozenset({_INSTALLED})


def is_capturing_hook(hook: object) -> bool:
    """Whether ``hook`` is one of the forward hooks transformers puts on a model's layers to capture outputs."""
    return getattr(hook, "__module__", None) == _MODULE


def forget_capturing_hooks(module: nn.Module) -> None:
    """Mark ``module``'s models as without their capturing hooks (a thread's copy of a model whose hooks it
    dropped), so that their next call installs them on the copy's own layers, as transformers' first call does."""
    for sub in module.modules():
        if sub.__dict__.get(_INSTALLED):
            setattr(sub, _INSTALLED, False)
