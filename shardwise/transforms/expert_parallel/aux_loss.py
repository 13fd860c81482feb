"""The router's load-balancing loss (Switch Transformer, as Hugging Face's ``load_balancing_loss_func``),
over the global batch of every rank of the axis.

``loss = E * sum_e f_e * P_e``: ``f_e`` is the share of all top-k assignments that chose expert ``e``
and ``P_e`` the mean router probability of ``e``, both over every token of every rank (not a mean of
per-rank losses). The assignment counts come from the dispatch's count exchange; the probability sums
are one psum. The result is *invariant* over the axis (one value, on every rank): add it to each rank's
loss and its gradient counts once, since psum's transpose is the identity; count its value once too.
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
    if not in_layer.one_device(mesh):  # one device: the sum is this rank's; predicting, the psum is recorded
        local = prob_sums
        prob_sums = in_layer.collective("psum", axis, local, "moe aux loss", run=lambda: psum(local, axis, mesh=mesh),
                                        predicted=local.clone)
    share = global_counts.to(probs.dtype) / global_tokens
    return num_experts * torch.sum(share * prob_sums / global_tokens)
