"""The executor's loss action: the loss of the last stage's output for one micro-batch, a mean over
its rows or (``train_step(tokens=...)``) a sum over its tokens with their count. A mixin of
:class:`~shardwise.engine.run.executor.Executor`, whose fields it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..layout.state_layout import Placement
from ..model.chain import Chain
from ..model.given_params import Given
from ..plan.actions import Action
from ..stack.batch_term import WithBatchTerm, counting_tokens
from .cut_graphs import refuse_fake_loss
from .grad_leaves import float_leaves
from .loss_reads import watching_given_reads
from .loss_rows import LossProbe

if TYPE_CHECKING:
    from .stage_backward import Saved


def _no_tokens(mean: torch.Tensor, output: Any) -> torch.Tensor:
    """The summed loss of a micro-batch without tokens: exactly 0, with zero gradients.

    Its mean over no tokens is NaN (0/0), and NaN x 0 is NaN, in the value and in the gradient:
    the global step divides by the global count, to which this shard adds nothing. Summing an
    empty slice of each output keeps the loss on the graph (so backward runs as on any rank)."""
    zero = mean.detach().new_zeros(())
    for leaf in float_leaves(output):
        zero = zero + leaf.flatten()[:0].sum().to(zero.dtype)
    return zero


class LossAction:
    """compute_loss."""

    chain: Chain
    loss_fn: Callable[[Any, Any], torch.Tensor]
    placement: Placement
    microbatches: Sequence[tuple[Any, Any]]
    loss_probe: LossProbe | None
    given_params: Given | None
    tokens: Any
    losses: list[torch.Tensor]
    counts: list[torch.Tensor]
    _saved: dict[tuple[int, int], Saved]
    _outputs: dict[tuple[int, int], Any]
    _generators: list[torch.Generator]
    _seed_prefix: int | None
    _shared_rng: bool

    if TYPE_CHECKING:
        def _earlier_layers_own_params(self, s: int) -> bool: ...

    def compute_loss(self, action: Action) -> None:
        m = action.mb
        s = self.placement.last
        saved = self._saved[(s, m)]
        inputs, targets = self.microbatches[m]
        output = self._outputs.pop((s, m))
        if self.loss_probe is not None and m == 0:
            # Set back what the probe drew only where no other rank draws meanwhile: this compute holds
            # the shared generators (it was seeded), or they are this rank's own.
            restore = self._seed_prefix is not None or not self._shared_rng
            self.loss_probe.check(self.loss_fn, output, inputs, targets, self._generators, restore)
        # A count function's count is known before the loss: a loss term of the whole batch reads it there.
        counted = None if self.tokens is None or self.tokens == "sum" else self._count(
            self.tokens(inputs, targets), "train_step(tokens=count_fn): count_fn(inputs, targets)")
        with torch.enable_grad(), counting_tokens(counted), watching_given_reads(self.loss_fn, self.given_params):
            got = self.loss_fn(output, targets)
        if isinstance(got, WithBatchTerm) and self.tokens is None:
            raise ValueError(
                "loss_fn returned a WithBatchTerm (a term of the whole batch beside a token-weighted loss), but the "
                "step's loss is a mean (train_step(tokens=None)): return the mean loss"
            )
        if type(got) is not torch.Tensor:  # (a fake tensor is a subclass: the common case costs no call)
            refuse_fake_loss(got)
        loss = self._token_sum(got, counted, output) if self.tokens is not None else got
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean loss over the batch), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        if not loss.requires_grad and self._earlier_layers_own_params(s + 1):
            raise ValueError(
                "the loss does not depend on any parameter: the chain's output carries no tensor that the "
                f"parameters reach (layer {self.chain.names[-1]!r} returned {type(output).__name__}); return the "
                "activations as tensors or pytrees of tensors, and compute the loss from them"
            )
        self.losses.append(loss.detach())
        saved.outputs = [loss]

    def _token_sum(self, got: Any, counted: torch.Tensor | None, output: Any) -> torch.Tensor:
        """The micro-batch's summed token loss (``counted``: its count under a count function, given
        before the loss ran); its token count goes to ``counts``. A :class:`WithBatchTerm`'s term is
        added as it is, not weighed by the count (``stack/batch_term.py``)."""
        term = None
        if isinstance(got, WithBatchTerm):
            got, term = got.loss, got.term
        if self.tokens == "sum":
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise ValueError(
                    "train_step(tokens='sum'): loss_fn must return a pair (sum of the token losses, number of "
                    f"tokens), got {type(got).__name__}; "
                    "e.g. cross_entropy(..., reduction='sum'), (labels != -100).sum()"
                )
            total, count = got[0], self._count(got[1], "train_step(tokens='sum'): loss_fn's second value")
        else:
            assert counted is not None, "a count function's count is taken before the loss"
            if not isinstance(got, torch.Tensor):
                raise ValueError(f"loss_fn must return the mean loss over the tokens, got {type(got).__name__}")
            total, count = (got * counted.to(got.dtype) if bool(counted != 0) else _no_tokens(got, output)), counted
        if term is not None:
            total = total + term.to(total.dtype)
        self.counts.append(count.to(torch.float64 if total.dtype == torch.float64 else torch.float32))
        return total

    @staticmethod
    def _count(count: Any, what: str) -> torch.Tensor:
        """``count`` as a 0-dim tensor; ``what`` names where it came from, for the refusal."""
        try:
            count = torch.as_tensor(count).detach()
        except (TypeError, RuntimeError, ValueError) as err:
            beside = ": metrics beside the loss have no place in it" if what.endswith("second value") else ""
            raise ValueError(
                f"{what} is the token count of the micro-batch, a scalar tensor or number, but gave a "
                f"{type(count).__name__} ({err}); return the count alone (e.g. (targets != -100).sum()){beside}"
            ) from err
        if count.dim() != 0 or count.dtype.is_complex:
            raise ValueError(
                f"{what} is the token count of the micro-batch, a scalar, but gave a {count.dtype} tensor of shape "
                f"{tuple(count.shape)}; return its total (e.g. (targets != -100).sum(), not per row)"
            )
        return count
