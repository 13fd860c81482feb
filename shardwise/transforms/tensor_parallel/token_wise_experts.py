"""Fused experts inside a sequence-parallel block: run on the rank's slice of the sequence, as one op.

A mixture-of-experts block left out of the plan's Regions runs, under sequence parallel, on each rank's
slice of the sequence; its router (a Linear, a softmax and a top k per token) is followed op by op by
the guard (``positions.py``), but its experts' dispatch of the tokens is not followable that way. Experts
whose code is known to compute each token from its own row, indices and weights, dropping none
(``engine/model/token_wise.py``), run as one op: their output holds the tokens their input holds. Their
weights are replicated over the axis and used on per-rank tokens, so their gradients are summed over it
(``match.py``'s ``vary``), as a norm's in the block is. Experts of any other code stay refused by the
guard, naming the mixture.

A whole mixture under another split (expert_parallel's forward, which dispatches the slice's tokens to their
experts' owners over its own axis) runs as one op the same way: its forward calls ``engine/model/
token_wise.py``'s ``run_token_wise``, which hands it to the runner a sequence-parallel block sets while it
runs (:func:`one_ops_in`). Its experts, replicated over this axis and used on per-rank tokens, get their
gradients summed over it too (``vary``).

The router's logits do not survive the slices: Hugging Face's ``output_router_logits=True`` collects each
rank's slice of them for its aux loss, which would be another loss than the whole sequence's; refused here,
while the block runs. ``sw.router_aux_loss`` with sequence parallel is refused where the layers are rewritten
(``spec.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from ...engine.model.hf_collecting import collecting_now
from ...engine.model.token_wise import computes_each_token_alone, token_wise_runner
from . import positions


class TokenWiseExperts:
    """An experts module's forward inside a sequence-parallel block (installed as its ``forward``)."""

    def __init__(self, module: nn.Module, path: str, block: str) -> None:
        self.module, self.path, self.block = module, path, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs.get("hidden_states")
        m = self.module
        return run_as_one_op(lambda: type(m).forward(m, *args, **kwargs), x, self.path, self.block)


def run_as_one_op(run: Callable[[], Any], x: Any, path: str, block: str) -> Any:
    """``run()``, the forward of the module at ``path`` known to compute each token of ``x`` alone, inside
    sequence-parallel ``block``, as one op of the guard; refused while the model collects its routers' logits.

    Another split's forward of a whole mixture (expert_parallel's, dispatching over its own axis) comes here
    through ``engine/model/token_wise.py``'s :func:`run_token_wise`, the runner the block sets
    (:func:`one_ops_in`)."""
    if "router_logits" in collecting_now():
        raise ValueError(
            f"tensor_parallel(sequence_parallel=...): the model collects its routers' logits "
            f"(output_router_logits=True) for its aux loss, and inside sequence-parallel block {block!r} the "
            f"router of {path!r} sees only this rank's slice of the sequence: the aux loss would be the "
            "slice's, another loss than the whole sequence's, without an error. Set config.output_router_logits "
            f"= False before functionalize, or leave {block!r} out of sequence_parallel"
        )
    return positions.per_token(run, x, path)


def one_ops_in(block: str) -> contextlib.AbstractContextManager[None]:
    """While sequence-parallel ``block`` runs: forwards that run through :func:`run_token_wise` (a whole
    mixture split over another axis) run as one op (:func:`run_as_one_op`)."""
    return token_wise_runner(lambda run, x, where: run_as_one_op(run, x, where, block))


def experts_in_blocks(root: nn.Module, blocks: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(subpath, path, block path) of every experts module known to compute each token alone inside the
    sequence-parallel ``blocks`` ((subpath, path) each) of ``root``."""
    found = []
    for sub, path in blocks:
        for name, module in root.get_submodule(sub).named_modules():
            if name and computes_each_token_alone(module):
                found.append((f"{sub}.{name}" if sub else name, f"{path}.{name}", path))
    return found
