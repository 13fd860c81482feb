"""What the loss of one micro-batch holds, predicted on fake tensors: the figures the Plan adds to what the
layers keep (``engine/plan/accounting.py`` leaves out the chain's output, which no later layer keeps).

The executor's loss action (``engine/run/loss_action.py``) takes the last stage's output, runs ``loss_fn``
on it and drops it, and the stage's backward starts from the loss: the loss's backward makes the output's
gradient, which flows into the last layer's. For a language model the output is the logits, and the loss
holds two or three tensors of their size at once (the logits until the loss returns, cross-entropy's
log-softmax kept for backward, the gradients of both in its backward): 64 MiB each for 2048 tokens of a
8192-word vocabulary, 2 GiB for 4096 tokens of Llama-3's. Each figure is counted once per storage, at
its full size; the batch's storages (the targets) are left out, counted with the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import optree
import torch

from ..stack.batch_term import WithBatchTerm
from ..torch_api import live_bytes, storage_key


class LossMemory(NamedTuple):
    """``kept``: what the loss keeps for its backward (its saved tensors: the output among them where it
    keeps it), held from the loss to the last stage's backward of that micro-batch, as a layer's kept
    bytes are. ``extra``: the most the loss holds beyond ``kept`` at one moment, from its forward to the
    output's gradient (the output itself while the loss runs, its intermediates, its backward's
    gradients). ``guessed``: why the figures are a guess (the loss could not run on fake tensors), else
    empty. ``grads``: the output's gradients, which the loss's backward leaves to the last layer's."""

    kept: int
    extra: int
    guessed: str = ""
    grads: int = 0


def loss_memory(
    loss_fn: Callable[[Any, Any], Any], output: Any, targets: Any, batch: Collection[int]
) -> LossMemory:
    """The loss's figures for ``output`` (the chain's last output, fake, cut from its graph as the
    executor's stage boundary cuts it) and ``targets`` (fake), run inside a ``fake_tensors`` block;
    ``batch``: the storage keys counted elsewhere (the batch's, and the output's that the last layer keeps
    for its own backward). A loss that fails on fake tensors (it reads a value:
    ``.item()``, a branch on a tensor) gets a guess: what cross-entropy holds, the output, a tensor of its size
    kept and the output's gradient."""
    outputs = [t for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    own = {storage_key(t): t.untyped_storage().nbytes() for t in outputs if storage_key(t) not in batch}
    needing = [t for t in outputs if t.requires_grad]
    kept: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:  # sizes only: holding the tensors would keep them past their node
        kept.setdefault(storage_key(t), t.untyped_storage().nbytes())

    try:
        with live_bytes() as seen:
            seen.add(sum(own.values()))  # the output, made before: alive as the loss starts
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_noting(note), _same):
                loss = _loss_of(loss_fn(output, targets))
            kept = {key: n for key, n in kept.items() if key not in batch}
            # The executor holds the output no longer once the loss returned: what the loss keeps of it stays.
            seen.add(-sum(n for key, n in own.items() if key not in kept))
            grads: tuple[torch.Tensor | None, ...] = ()
            if loss is not None and loss.requires_grad and needing:
                grads = torch.autograd.grad(loss, needing, allow_unused=True)
            made = sum({storage_key(g): g.untyped_storage().nbytes() for g in grads if g is not None}.values())
            del grads
    except Exception as err:
        made = sum(t.untyped_storage().nbytes() for t in needing)
        why = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        return LossMemory(made, sum(own.values()) + made, why, made)
    return LossMemory(sum(kept.values()), max(seen.peak - sum(kept.values()), 0), "", made)


# (accounting.observing's hooks, without its observer for layer wrappers, which a loss has none of: accounting
# imports this module, so this one cannot import it.)
def _noting(note: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    return pack


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _loss_of(got: Any) -> torch.Tensor | None:
    """The tensor the step's backward starts from: the mean loss, a token sum's total (``tokens="sum"``'s
    pair), a :class:`WithBatchTerm`'s loss."""
    if isinstance(got, WithBatchTerm):
        got = got.loss
    if isinstance(got, (tuple, list)) and got:
        got = got[0]
    return got if isinstance(got, torch.Tensor) else None
