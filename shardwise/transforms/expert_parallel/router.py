"""Top-k routers: which experts each token goes to, with what weight.

Both are Hugging Face's: softmax over all experts, then the top k. ``"softmax_topk_renormalized"``
rescales the k weights to sum to one (Mixtral's ``MixtralTopKRouter``, Qwen2-MoE with
``norm_topk_prob=True``); ``"softmax_topk"`` keeps them as they are (Qwen2-MoE's default).

>>> import torch
>>> r = route(torch.tensor([[0.0, 1.0, 2.0]]), top_k=2, router="softmax_topk_renormalized")
>>> r.experts.tolist(), round(float(r.weights.sum()), 6)
([[2, 1]], 1.0)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ROUTERS = ("softmax_topk", "softmax_topk_renormalized")


class Routing(NamedTuple):
    """Each token's ``top_k`` experts (best first) and their weights, and the softmax over all experts (None
    for a model's own routing that has none: DeepSeek-V3's sigmoid scores)."""

    experts: torch.Tensor  # [tokens, top_k] int64
    weights: torch.Tensor  # [tokens, top_k]
    probs: torch.Tensor | None = None  # [tokens, num_experts]


def check_router(router: object) -> str:
    if router not in ROUTERS:
        raise ValueError(
            f"unknown router {router!r}: choose one of {ROUTERS} (softmax over the experts, then the top k, "
            "renormalized to sum to one or not); a router that is neither needs its own routing function"
        )
    assert isinstance(router, str)
    return router


def route(logits: torch.Tensor, top_k: int, router: str) -> Routing:
    """The routing of ``logits`` [tokens, num_experts]; half precision computes in float32, as HF does."""
    router = check_router(router)
    work = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    probs = torch.softmax(logits.to(work), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if router == "softmax_topk_renormalized":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights, probs)
