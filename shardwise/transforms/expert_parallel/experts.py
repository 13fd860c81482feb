"""The experts a rank owns, as fused 3-D weights (Hugging Face's ``MixtralExperts`` layout).

``gate_up_proj`` is [experts, 2 * intermediate, hidden] and ``down_proj`` [experts, hidden,
intermediate]; expert ``e`` maps a row ``x`` to ``down[e] @ (act(gate) * up)`` with
``gate, up = (gate_up[e] @ x).chunk(2)``. Under expert parallelism rank ``r`` of ``n`` owns the
contiguous experts ``r * E/n .. (r+1) * E/n - 1``.

GPT-OSS's experts (``GptOssExperts``) are laid out otherwise and carry biases: :func:`run_gpt_oss_experts`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...collectives import Mesh, axis_index, axis_size

Activation = Callable[[torch.Tensor], torch.Tensor]
# This rank's experts applied to their rows: [local experts, rows, hidden] -> the same shape.
ExpertsFn = Callable[[torch.Tensor], torch.Tensor]


def shard_experts(weight: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """This rank's experts of a fused expert ``weight`` [experts, ...] (a slice along dim 0, no copy).

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.expert_parallel import shard_experts
    >>> sw.launch(lambda: shard_experts(torch.arange(4), "ep", mesh=sw.Mesh(ep=2)).tolist(), world=2, timeout=60)
    [[0, 1], [2, 3]]
    """
    n, r = axis_size(axis, mesh=mesh), axis_index(axis, mesh=mesh)
    experts = weight.shape[0] if weight.ndim else 0
    if weight.ndim == 0 or experts % n:
        raise ValueError(
            f"shard_experts: {experts} experts (dim 0 of the weight of shape {tuple(weight.shape)}) do not divide "
            f"over axis {axis!r} of size {n}; use an expert count that is a multiple of {n}, or a smaller axis"
        )
    per_rank = experts // n
    return weight[r * per_rank : (r + 1) * per_rank]


def run_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Activation) -> torch.Tensor:
    """Expert ``e`` applied to the rows ``x[e]``: x is [experts, rows, hidden], the result too (batched matmuls)."""
    gate, up = torch.bmm(x, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(act(gate) * up, down_proj.transpose(1, 2))


def run_gpt_oss_experts(x: torch.Tensor, experts: Any) -> torch.Tensor:
    """HF ``GptOssExperts.forward`` on the rows ``x[e]`` of each of this rank's experts (x [experts, rows, hidden]):
    ``gate_up_proj`` [E, hidden, 2I] (gate and up interleaved) and ``down_proj`` [E, I, hidden] multiply from the
    right, each plus its bias [E, 2I] / [E, hidden], and the experts' own ``_apply_gate`` (its clamped SwiGLU,
    ``alpha`` and ``limit``) runs between them, called as it is. The rows are weighted after, by the combine."""
    gate_up = torch.bmm(x, experts.gate_up_proj) + experts.gate_up_proj_bias.unsqueeze(1)
    return torch.bmm(experts._apply_gate(gate_up), experts.down_proj) + experts.down_proj_bias.unsqueeze(1)
