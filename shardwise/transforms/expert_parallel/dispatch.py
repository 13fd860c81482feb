"""Dispatch tokens to the ranks that own their experts, run the local experts, combine the results back.

1. Route (``router.py``) and give every assignment a slot in its expert's queue (``capacity.py``).
2. Exchange counts: one all-gather of each rank's assignments made and kept per expert and its token
   count. Every rank then knows ``slots``, the most kept assignments any rank sends any expert.
3. Dispatch: each rank lays its kept assignments out as [experts, slots, hidden] (zeros in unused
   slots) and one tiled ``all_to_all`` sends expert ``e``'s rows to the rank that owns ``e``.
4. The owner runs its experts on everything it received, [local experts, ranks * slots, hidden], in
   batched matmuls (padding rows too, whose results are never read: GShard's fixed-shape compute).
5. Combine: the inverse ``all_to_all`` brings each row back; each token sums its kept assignments'
   rows times their router weights.

Both all-to-alls are shardwise's differentiable ones (their transposes, in backward, are all-to-alls
the other way), so gradients reach the tokens, the router and the owners' expert weights; the
expert weights' gradients are complete on their owner (no reduction over the axis), while replicated
parameters (the router, everything dense) get per-rank gradients that a psum over the axis completes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...collectives import Mesh, current_mesh
from ...engine.stack import in_layer
from . import comm, own_block
from .aux_loss import load_balancing_loss
from .capacity import assign_slots, expert_capacity
from .experts import Activation, ExpertsFn, run_experts
from .router import Routing, check_router, route


class MoEOutput(NamedTuple):
    """The combined ``output`` [tokens, hidden] of this rank's tokens, and what the routing did globally."""

    output: torch.Tensor
    aux_loss: torch.Tensor | None  # invariant over the axis: see aux_loss.py (None: not asked for)
    tokens_per_expert: torch.Tensor  # [num_experts] int64: top-k assignments to each expert, every rank
    dropped: int  # assignments dropped for capacity, every rank (0 while predicting on fake tensors)
    slots: int  # rows per (rank, expert) in each all-to-all: what its bytes are made of


def moe_dispatch_combine(
    tokens: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    axis: str,
    *,
    top_k: int,
    router: str = "softmax_topk_renormalized",
    capacity_factor: float | None = None,
    act: Activation = F.silu,
    mesh: Mesh | None = None,
    slots: int | None = None,
    aux_loss: bool = True,
    routing: Routing | None = None,
    experts: ExpertsFn | None = None,
) -> MoEOutput:
    """A mixture-of-experts layer on this rank's ``tokens`` [n, hidden] with the experts split over ``axis``.

    ``router_logits`` [n, num_experts] are the router's scores of these tokens; ``gate_up_proj``
    [E/ep, 2 * intermediate, hidden] and ``down_proj`` [E/ep, hidden, intermediate] are this rank's
    experts (:func:`shard_experts` cuts them from the full fused weights). ``capacity_factor=None``
    drops nothing and equals the single-device layer exactly; otherwise ``capacity.py`` states which
    assignments are dropped. Ranks may hold different numbers of tokens.

    Outside any mesh (no ``with mesh:``, no ``mesh=``: functionalize's example run, the step on one device)
    the axis has one index: every expert is here and this is the single-device layer, so a block that calls
    it is a single-device model too; inside a mesh that lacks ``axis`` it is refused. A block of one's own
    (fused ``experts.gate_up_proj`` / ``experts.down_proj``) whose forward calls it is split by
    ``expert_parallel`` as written: its experts arrive cut, and ``slots=None`` gets the step's bound.

    ``slots``: the rows per (rank, expert) of each all-to-all, fixed (the expert_parallel step passes its
    bound, so that its Plan states the bytes exactly and the layer runs on fake tensors); None sizes them
    by the routing (the most kept assignments any rank sends one expert). A routing that needs more than
    ``slots`` is refused. ``aux_loss=False`` skips the load-balancing loss (and its psum).

    ``routing``: the experts [n, top_k] and weights [n, top_k] a model's own router chose (DeepSeek-V3's
    sigmoid scores plus a correction bias, over groups of experts), used as they are instead of ``router``'s
    softmax over ``router_logits`` (which then give only the expert count); it has no softmax for the
    load-balancing loss, so ``aux_loss`` must be False.

    ``experts``: this rank's experts applied to the rows each received ([local experts, rows, hidden] to the
    same), in place of :func:`run_experts` of ``gate_up_proj`` and ``down_proj`` with ``act``: experts of
    another layout (GPT-OSS's, transposed, interleaved, with biases: :func:`run_gpt_oss_experts`). The two
    weights then give only this rank's expert count (their dim 0), which must be ``E / ep``.

    >>> import torch, shardwise as sw
    >>> from shardwise.transforms.expert_parallel import moe_dispatch_combine, shard_experts
    >>> gen = torch.Generator().manual_seed(0)
    >>> x, router = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    >>> gate_up, down = torch.randn(4, 6, 4, generator=gen), torch.randn(4, 4, 3, generator=gen)
    >>> def main():
    ...     with sw.Mesh(ep=2) as mesh:
    ...         mine = x[4 * mesh.rank : 4 * mesh.rank + 4]  # each rank its tokens, half the experts
    ...         local = [shard_experts(w, "ep") for w in (gate_up, down)]
    ...         return moe_dispatch_combine(mine, mine @ router.T, *local, "ep", top_k=2)
    >>> results = sw.launch(main, world=2, timeout=60)
    >>> results[0].output.shape, results[0].tokens_per_expert.sum().item(), results[0].dropped
    (torch.Size([4, 4]), 16, 0)
    """
    ep = _axis_size(axis, mesh)
    num_experts = _check(tokens, router_logits, gate_up_proj, down_proj, axis, top_k, ep, experts is None)
    check_router(router)
    local_experts = num_experts // ep
    n, hidden = tokens.shape
    routing = route(router_logits, top_k, router) if routing is None else _given(routing, n, top_k, aux_loss)
    capacity = expert_capacity(n, top_k, num_experts, capacity_factor)
    split = own_block.current()
    if split is not None and slots is None:  # a block of one's own under expert_parallel: the bound, as known ones
        slots = max(1, n if capacity is None else min(capacity, n))
    slot_of = assign_slots(routing.experts, num_experts, capacity)

    stats = torch.cat([slot_of.counts, slot_of.kept_counts, torch.tensor([n], device=slot_of.counts.device)])
    every = comm.gather_counts(stats, axis, "moe counts", mesh)  # [ep, 2E + 1], integers: no gradient
    counts, kept_counts = every[:, :num_experts].sum(0), every[:, num_experts : 2 * num_experts]
    predicting = in_layer.predicting_now()
    width = _width(kept_counts, slots, predicting)

    token_ids = torch.arange(n, device=tokens.device).unsqueeze(1).expand(n, top_k)
    row = routing.experts * width + slot_of.position.clamp(max=width - 1)  # dropped: any row, weight 0
    # A dropped assignment goes to one extra row, cut off before sending: fixed shapes, no boolean
    # indexing (the layer also runs on fake tensors); each kept row is written once.
    dest = torch.where(slot_of.kept, row, num_experts * width).reshape(-1)
    laid = tokens.new_zeros(num_experts * width + 1, hidden).index_add(0, dest, tokens[token_ids.reshape(-1)])
    received = comm.exchange(laid[:-1], axis, "moe dispatch", mesh)

    by_expert = received.view(ep, local_experts, width, hidden).transpose(0, 1).reshape(local_experts, -1, hidden)
    computed = run_experts(by_expert, gate_up_proj, down_proj, act) if experts is None else experts(by_expert)
    by_source = computed.view(local_experts, ep, width, hidden).transpose(0, 1).reshape(-1, hidden)
    back = comm.exchange(by_source, axis, "moe combine", mesh)

    weights = routing.weights.to(tokens.dtype) * slot_of.kept
    output = (back[row] * weights.unsqueeze(-1)).sum(dim=1)
    aux = None
    if aux_loss:
        assert routing.probs is not None  # a given routing without them is refused with aux_loss (_given)
        aux = load_balancing_loss(routing.probs, counts, every[:, -1].sum(), axis, mesh=mesh)
    dropped = 0 if predicting else int((every[:, :num_experts] - kept_counts).sum())
    if dropped and split is not None and not split.drop_per_rank:
        raise ValueError(
            f"expert_parallel: {split.where} calls moe_dispatch_combine(capacity_factor={capacity_factor!r}), which "
            f"would drop {dropped} token assignments over its experts' capacity, counted per rank over the rank's "
            "own tokens. Which ones drop depends on how the mesh cuts the batch, and the single-device step counts "
            "the capacity over the whole batch: this step would train another model, without an error. Pass "
            "expert_parallel(..., drop_per_rank=True) to drop them knowingly, or a larger capacity_factor (None "
            "drops nothing)"
        )
    return MoEOutput(output, aux, counts, dropped, width)


def _axis_size(axis: str, mesh: Mesh | None) -> int:
    """The size of the experts' axis: 1 with no mesh at all (one device: every expert here, the
    single-device layer), else the mesh's, which must hold the axis (and a block of one's own under
    expert_parallel must name the transform's)."""
    split = own_block.current()
    if split is not None and split.axis != axis:
        raise ValueError(
            f"moe_dispatch_combine(axis={axis!r}): {split.where} runs under expert_parallel over axis "
            f"{split.axis!r}, which split its experts; call it over {split.axis!r} (or pass the axis "
            "expert_parallel uses to both)"
        )
    if in_layer.one_device(mesh):
        return 1
    bound = mesh if mesh is not None else current_mesh()
    if bound is not None and axis not in bound.axis_names:
        sizes = ", ".join(f"{a}={bound.axis_size(a)}" for a in bound.axis_names)
        raise ValueError(
            f"moe_dispatch_combine(axis={axis!r}): the mesh {bound!r} has no axis {axis!r} (a misspelled name?). "
            "Under expert_parallel pass its axis; to run the model on this mesh without splitting the experts, "
            f"give the mesh that axis with size 1: sw.Mesh({sizes}, {axis}=1)"
        )
    return in_layer.size(axis, mesh)


def _given(routing: Routing, n: int, top_k: int, aux_loss: bool) -> Routing:
    """A model's own routing, checked against the tokens and ``top_k``."""
    experts, weights = routing.experts, routing.weights
    for name, t in (("experts", experts), ("weights", weights)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n, top_k):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"moe_dispatch_combine: routing.{name} must be [tokens, top_k] = ({n}, {top_k}), got {got}"
            )
    if experts.dtype != torch.int64:
        raise ValueError(f"moe_dispatch_combine: routing.experts must be int64 expert indices, got {experts.dtype}")
    if aux_loss:
        raise ValueError(
            "moe_dispatch_combine: a given routing has no softmax over the experts for the load-balancing loss; "
            "pass aux_loss=False (and add the model's own balancing term, if it has one, to the loss)"
        )
    return routing


def _width(kept_counts: torch.Tensor, slots: int | None, predicting: bool) -> int:
    """The rows per (rank, expert) of the all-to-alls: ``slots`` when fixed, else what the routing needs."""
    if slots is None:
        if predicting:
            raise ValueError("moe_dispatch_combine: on fake tensors the all-to-all needs fixed slots= (its bound)")
        return max(int(kept_counts.max()), 1)  # an empty exchange still needs a shape
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"moe_dispatch_combine: slots={slots!r} must be a positive int (rows per rank and expert)")
    if not predicting and int(kept_counts.max()) > slots:
        raise ValueError(
            f"moe_dispatch_combine: a rank keeps {int(kept_counts.max())} assignments for one expert, more than "
            f"slots={slots}; give slots at least the capacity (or the tokens per rank without one)"
        )
    return slots


def _check(
    tokens: object,
    logits: object,
    gate_up: object,
    down: object,
    axis: str,
    top_k: object,
    ep: int,
    mixtral_layout: bool = True,
) -> int:
    """The number of experts, after checking every argument against the others."""
    for name, t, ndim in (("tokens", tokens, 2), ("router_logits", logits, 2), ("gate_up_proj", gate_up, 3),
                          ("down_proj", down, 3)):
        if not isinstance(t, torch.Tensor) or t.ndim != ndim:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"moe_dispatch_combine: {name} must be a {ndim}-D tensor, got {got}")
    assert isinstance(tokens, torch.Tensor) and isinstance(logits, torch.Tensor)
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    n, hidden = tokens.shape
    num_experts = logits.shape[1]
    if logits.shape[0] != n:
        raise ValueError(f"moe_dispatch_combine: router_logits has {logits.shape[0]} rows but tokens has {n}")
    if num_experts % ep:
        raise ValueError(
            f"moe_dispatch_combine: {num_experts} experts do not divide over axis {axis!r} of size {ep}; "
            f"use an expert count that is a multiple of {ep}, or a smaller axis"
        )
    local = num_experts // ep
    if not mixtral_layout and not gate_up.shape[0] == down.shape[0] == local:
        raise ValueError(
            f"moe_dispatch_combine: with {num_experts} experts over {ep} ranks, this rank's expert weights must "
            f"hold {local} experts on dim 0; got gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)} (cut them with shard_experts)"
        )
    intermediate = down.shape[2]
    mixtral_shapes = gate_up.shape == (local, 2 * intermediate, hidden) and down.shape == (local, hidden, intermediate)
    if mixtral_layout and not mixtral_shapes:
        raise ValueError(
            f"moe_dispatch_combine: with {num_experts} experts over {ep} ranks and hidden {hidden}, this rank's "
            f"gate_up_proj must be ({local}, 2 * intermediate, {hidden}) and down_proj ({local}, {hidden}, "
            f"intermediate); got {tuple(gate_up.shape)} and {tuple(down.shape)} (cut them with shard_experts)"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_dispatch_combine: top_k={top_k!r} must be an int in 1..{num_experts} (the experts)")
    return num_experts
