"""PhiMoE's router draws in training: what expert_parallel can split exactly, and what it refuses.

``PhimoeTopKRouter`` (``sparsemixer``) picks each token's two experts in training by Gumbel sampling
among the candidates within ``2 x router_jitter_noise`` (relative) of the best, then draws again for
Heun's gradient estimate; with ``input_jitter_noise`` the block and the router first scale each token by
uniform noise. Those draws come from the generator of whoever runs the router: under expert parallel
each rank draws its own for its own tokens, which are not the draws one device makes for them, so the
step would route other experts than the single-device step, without an error. Refused, naming the setting:

* ``router_jitter_noise = 0`` keeps one candidate, the best (the second, after it, the same), so no draw
  changes the choice: the router's choice and weights (1 each, whose gradient is then zero, as on one
  device) are the single device's; an exact tie (a token whose best two logits are equal) would be
  sampled, and is refused;
* in eval mode (``model.eval()``) sparsemixer draws nothing: the best two, each weighted by its softmax
  over the candidates within the margin (1 where it is the only one), with that softmax's gradient, as on
  one device.

``sparsemixer`` and the router's forward are pinned (``engine/model/reproduced.py``): what is said here
is of that code.
"""

from __future__ import annotations

from typing import Any

import torch

from ...engine.model.reproduced import check_reproduced
from ...engine.stack import in_layer

BLOCK = "PhimoeSparseMoeBlock"


def check_code(block: Any, who: str, where: str) -> None:
    """The router's forward and ``sparsemixer`` must be the code checked (what this module says of them)."""
    from transformers.models.phimoe import modeling_phimoe

    router = type(block.router)
    if who != "expert_parallel":  # router_aux_loss reads the router's logits only (blocks.py checks its class)
        return
    if not (router.__name__ == "PhimoeTopKRouter" and router.__module__ == modeling_phimoe.__name__):
        raise ValueError(
            f"{who}: {where}.router is a {router.__name__} (from {router.__module__}), not PhiMoE's "
            f"PhimoeTopKRouter, whose draws in training {who} knows (it refuses those it cannot make as one "
            f"device does): what yours draws would differ per rank without an error. Use the model's router, "
            f"or leave {who} out"
        )
    check_reproduced(router, who, f"{where}.router")
    check_reproduced(modeling_phimoe, who, f"{where}.router's sparsemixer", method="sparsemixer")


def refuse_draws(block: Any, who: str, where: str) -> None:
    """Refuse a PhiMoE block whose router's choice, in training, depends on random draws."""
    router = block.router  # each draws in its own training mode
    for owner, training, noise in (("block", block.training, block.input_jitter_noise),
                                   ("router", router.training, router.input_jitter_noise)):
        if training and noise > 0:
            raise ValueError(
                f"{who}: {where} has input_jitter_noise={noise}: in training its {owner} scales each token by "
                "uniform noise that each rank would draw for its own tokens, not the noise one device draws for "
                "them; set config.input_jitter_noise = 0"
            )
    if router.training and router.router_jitter_noise > 0:
        raise ValueError(
            f"{who}: {where} has router_jitter_noise={router.router_jitter_noise}: in training its router "
            "(sparsemixer) samples each token's experts among those within that margin of the best, by draws "
            "each rank would make for its own tokens, not those one device makes for them, so the step would "
            "route other experts without an error. Set config.router_jitter_noise = 0 (only the best experts are "
            "candidates: no draw changes the choice; their weights are then 1 and the router gets no gradient, "
            "as on one device), or train the model in eval mode (model.eval(): sparsemixer draws nothing and "
            "takes the best two, each weighted by its softmax over the candidates within the margin)"
        )


def refuse_ties(logits: torch.Tensor, block: Any, who: str, where: str) -> None:
    """In training with ``router_jitter_noise=0`` an exact tie among a token's best two logits is sampled."""
    if not block.router.training or in_layer.predicting_now() or logits.shape[-1] < 2:
        return
    best = torch.topk(logits.detach(), min(3, logits.shape[-1]), dim=-1).values
    tied = (best[:, :-1] == best[:, 1:]).any(dim=-1)
    if bool(tied.any()):
        narrow = logits.dtype in (torch.bfloat16, torch.float16)
        rounded = (f", or logits rounded to {str(logits.dtype).removeprefix('torch.')}, whose few bits tie often: "
                   "bfloat16 ties about 1.5% of a large model's tokens") if narrow else ""
        raise ValueError(
            f"{who}: {where}'s router has {int(tied.sum())} token(s) whose best experts' logits are exactly equal "
            f"(a zero router, a token that repeats{rounded}): in "
            "training sparsemixer samples among them, by draws each rank makes for its own tokens, not one "
            "device's. Train the model in eval mode (model.eval(): the first of the tied experts), compute the "
            "layer in float32 (mixed_precision's overrides=), or give the router weights that separate the experts"
        )
