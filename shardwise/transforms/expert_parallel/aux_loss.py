"""The router's load-balancing loss (Switch Transformer, as Hugging Face's ``load_balancing_loss_func``),
over the global batch of every rank of the axis.

``loss = E * sum_e f_e * P_e``: ``f_e`` is the share of all top-k assignments that chose expert ``e``
and ``P_e`` the mean router probability of ``e``, both over every token of every rank (not a mean of
per-rank losses). The assignment counts come from the dispatch's count exchange; the probability sums
are one psum. The result is *invariant* over the axis (one value, on every rank): add it to each rank's
loss and its gradient counts once, since psum's transpose is the identity; count its value once too.

Inside a step that cuts the batch (``expert_parallel``'s own block, ``shard_params`` over another axis) the
engine takes the mean of the shares' losses (each seeded 1 / shares): the counts and probability sums are
then over every share of the batch (each batch axis besides this one summed too), and the gradient reaching
a rank's probabilities is scaled by the number of shares, so that the mean of the shares' losses holds the
whole batch's aux once, with its gradient. (Before, each rank's part of it came out 1 / ep of one device's,
and under data parallel x ep the loss held the aux of the ep group's tokens alone.)
"""

from __future__ import annotations

import torch

from ...collectives import Mesh, psum
from ...engine.stack import in_layer


def load_balancing_loss(
    probs: torch.Tensor, global_counts: torch.Tensor, global_tokens: int | torch.Tensor, axis: str, *,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """``E * sum(f * P)`` from this rank's router ``probs`` [tokens, E] and the global assignment counts [E]."""
    num_experts = probs.shape[-1]
    prob_sums = probs.sum(dim=0)
    shares = in_layer.batch_shares()
    if shares.shares > 1:  # the engine means the shares' losses: each share's gradient counts x shares (above)
        prob_sums = prob_sums * shares.shares - (prob_sums * (shares.shares - 1)).detach()
    if not in_layer.one_device(mesh):  # one device: the sum is this rank's; predicting, the psum is recorded
        prob_sums = _summed(prob_sums, axis, mesh)
    others = tuple(a for a in shares.axes if a != axis)  # the batch's other axes (data parallel's)
    if others:
        global_counts, global_tokens = global_counts.detach(), torch.as_tensor(global_tokens).detach()
        for other in others:
            global_counts = _summed(global_counts, other, None)
            global_tokens = _summed(global_tokens, other, None)
            prob_sums = _summed(prob_sums, other, None)
    share = global_counts.to(probs.dtype) / global_tokens
    return num_experts * torch.sum(share * prob_sums / global_tokens)


def _summed(x: torch.Tensor, axis: str, mesh: Mesh | None) -> torch.Tensor:
    return in_layer.collective("psum", axis, x, "moe aux loss", run=lambda: psum(x, axis, mesh=mesh), predicted=x.clone)
