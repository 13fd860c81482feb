"""What a Hugging Face model is collecting from its layers while they run: the one place shardwise reads
transformers' output capturing, a private part of it (``transformers.utils.output_capturing``).

transformers 5's ``@capture_outputs`` forward sets a collector (a context variable) holding a list per
output it was asked for (``router_logits`` under ``output_router_logits=True``, ``attentions``,
``hidden_states``), and hooks on its layers append to them while they run. Split into units, the layers run
one by one outside that forward, and the code after them finds the lists empty: SwitchTransformers'
z-loss failed inside transformers (``torch.cat`` of an empty list), other models returned short tuples.
``tests/engine/test_hf_collecting.py`` fails loudly when transformers changes this.
"""

from __future__ import annotations

import sys

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
