"""router_aux_loss: the routers' load-balancing loss added to the step's loss, over the whole batch.

Hugging Face's (``output_router_logits=True``, ``router_aux_loss_coef``; ``load_balancing_loss_func``)
pools every MoE layer's routing: with ``C_e`` the top-k assignments to expert ``e`` and ``P_e`` its
router probabilities summed over every row of every layer, and ``R`` the rows (tokens x layers),
``aux = E * sum_e (C_e / R) * (P_e / R)``, and the loss is ``loss + coef * aux``.

How a step computes it (a REWRITE, outermost: it wraps the layers whatever splits, casts or remat are
inside them):

* every layer carries :class:`~.router_stats.RouterStats` beside its output (``Carried``): its MoE
  blocks report their router's logits (recomputed from the block's input: one small matmul, the same on
  one device and under expert_parallel), added to what came in;
* the loss adds ``coef * aux``. A rank holding one of ``shares`` shares of the micro-batch (the
  engine's ``in_layer.batch_shares``: data-parallel and expert-parallel ranks) sums ``C`` and ``R``
  over the batch's axes (``in_layer.batch_sum``, no gradient) and adds
  ``shares * E * sum_e C_e p_e / R^2``, with ``p`` its own probability sums: the micro-batch's loss, the
  mean over the shares, then holds ``aux`` once, and its gradient is aux's (``aux`` is linear in each
  share's ``p`` once ``C`` is known, and ``C`` carries no gradient, as in HF where top-k has none).
* Under a token-weighted step (``train_step(tokens=)`` a count function or ``"sum"``), which multiplies
  each share's loss by its own token count and divides the sum by the global count, the rank's count
  joins the routing counts' sum, and the loss returns ``WithBatchTerm(loss, coef * E * sum_e C_e p_e /
  R^2 * N)`` (``N`` the micro-batch's count over the batch's axes; ``engine/stack/batch_term.py``): the
  engine adds it beside the weighted loss, not multiplied by the share's count, so after the division
  ``aux`` counts once and its gradient is aux's whatever each share's count (a share of none included).
* Under micro-batches (a pipeline, or shard_params' accumulation) each micro-batch's ``aux`` is over
  its own tokens (on every rank), and the step's is their mean: what HF computes under gradient
  accumulation, not the aux of the whole batch (which no micro-batch can know before it runs). Under a
  token-weighted step each weighs by its share of the counted tokens (``N`` above is its own).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import optree
import torch
import torch.nn.functional as F
from torch import nn

from ...engine.model.chain import Chain, Layer
from ...engine.model.module_call import ThreadReplicas, kept_in_copies
from ...engine.stack import in_layer
from ...engine.stack.batch_term import WithBatchTerm, counted_tokens
from ...engine.stack.compose import REWRITE, add
from ...engine.step.batch_cut import PER_SHARD_MEAN
from ...engine.step.step import Step
from .blocks import Block, find_blocks, refuse_hooks, router_of, top_k_of
from .router_stats import Carried, RouterStats, collecting, report, zeros_like_stats
from .spec import resolve


@dataclass(frozen=True)
class RouterAuxSpec:
    """router_aux_loss in a step's stack (see :func:`router_aux_loss`)."""

    coef: float
    num_experts: int
    per_microbatch: bool = False  # the caller took each micro-batch's aux (HF's accumulation) over the batch's

    name: ClassVar[str] = "router_aux_loss"
    adds_batch_loss: ClassVar[bool] = True  # the aux loss of the whole batch (compose.py)
    role: ClassVar[str] = REWRITE

    def __str__(self) -> str:
        extra = ", per_microbatch=True" if self.per_microbatch else ""
        return f"router_aux_loss(coef={self.coef!r}{extra})"

    def rewrite(self, chain: Chain) -> Chain:
        """Every layer carrying the routing statistics on, its MoE blocks reporting theirs."""
        layers = []
        for i, layer in enumerate(chain):
            fn = _reporting(layer.fn, layer.name)
            layers.append(Layer(layer.name, CarryRouterStats(fn, i == 0, self.num_experts), layer.param_names,
                                layer.buffers, layer.ties, layer.frozen))
        return Chain(layers)

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        return {
            layer.name: "router aux loss: carries the routing statistics of its MoE blocks (and the layers' before) on"
            for layer in chain
        }


class CarryRouterStats:
    """A layer fn that hands on ``Carried(output, stats)``: the stats that came with its input (none into
    the first layer) plus those its MoE blocks report."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor], Any], Any], first: bool, num_experts: int) -> None:
        self.fn, self.first, self.num_experts = fn, first, num_experts

    @property
    def __wrapped__(self) -> Any:
        return self.fn

    def __call__(self, tensors: dict[str, torch.Tensor], x: Any) -> Carried:
        if self.first:
            value, stats, weights = x, None, _mask_of(x)
        elif isinstance(x, Carried):
            value, stats, weights = x.value, RouterStats(*x.router), x.weights
        else:
            raise TypeError(f"router_aux_loss: a layer got {type(x).__name__}, not the Carried the layer before makes")
        with collecting(weights) as found:
            y = self.fn(tensors, value)
        for s in found:
            stats = s if stats is None else stats + s
        if stats is None:
            floats = [t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            like = floats[0] if floats else torch.empty(())
            stats = zeros_like_stats(self.num_experts, like.dtype, like.device)
        return Carried(y, stats, weights)


def _mask_of(batch: Any) -> torch.Tensor | None:
    """The batch's attention mask (a dict's ``attention_mask``, [batch, sequence] of 0 and 1), flat, or None."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(
            "router_aux_loss: the batch's attention_mask must be a [batch, sequence] tensor of 0 (padding) and 1, "
            f"as HF's aux loss reads it; got {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask)}"
        )
    return mask.reshape(-1)


class RouterAuxLoss:
    """``loss_fn(output, targets) + coef * aux``, aux counted once over the batch's shares (module docstring).
    ``tokens``: the step's ``train_step(tokens=...)`` (None: a mean loss; ``"per_shard_mean"`` is one too)."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], coef: float, num_experts: int, tokens: Any = None) -> None:
        self.loss_fn, self.coef, self.num_experts = loss_fn, coef, num_experts
        self.token_weighted = tokens is not None and not (isinstance(tokens, str) and tokens == PER_SHARD_MEAN)
        self.summed = isinstance(tokens, str) and tokens == "sum"

    def __call__(self, output: Any, targets: Any) -> Any:
        if not isinstance(output, Carried):
            raise TypeError(
                f"router_aux_loss: the loss got {type(output).__name__}, not the Carried output of the rewritten "
                "chain; call the step, not its loss_fn on a plain output"
            )
        loss = self.loss_fn(output.value, targets)
        stats = RouterStats(*output.router)
        if self.token_weighted:
            return self._with_tokens(loss, stats)
        whole = in_layer.batch_sum(torch.cat([stats.counts, stats.rows.reshape(1)]), "router aux counts")
        counts, rows = whole[:-1], whole[-1]
        share = in_layer.batch_shares().shares * self.num_experts * torch.sum(counts * stats.probs) / (rows * rows)
        return loss + (self.coef * share).to(loss.dtype)

    def _with_tokens(self, loss: Any, stats: RouterStats) -> WithBatchTerm:
        """Under a token-weighted step, which multiplies each share's loss by its own token count and
        divides the sum by the global count: this share's part of ``coef * aux`` times the micro-batch's
        global count, added beside the weighted loss (not multiplied by the share's count), so that it
        counts once and its gradient is aux's, whatever each share's count (none included)."""
        mine = self._own_count(loss, stats)
        mine = mine.to(device=stats.counts.device, dtype=stats.counts.dtype)
        summed = torch.cat([stats.counts, stats.rows.reshape(1), mine.reshape(1)])
        whole = in_layer.batch_sum(summed, "router aux counts")
        counts, rows, tokens = whole[:-2], whole[-2], whole[-1]
        part = self.num_experts * torch.sum(counts * stats.probs) / (rows * rows)
        return WithBatchTerm(loss, self.coef * part * tokens)

    def _own_count(self, loss: Any, stats: RouterStats) -> torch.Tensor:
        """This share's token count: loss_fn's own under tokens='sum', the step's count function's otherwise."""
        if self.summed:
            if not (isinstance(loss, (tuple, list)) and len(loss) == 2):
                raise ValueError(
                    "train_step(tokens='sum'): loss_fn must return a pair (sum of the token losses, number of "
                    f"tokens), got {type(loss).__name__}; e.g. cross_entropy(..., reduction='sum'), "
                    "(labels != -100).sum()"
                )
            return torch.as_tensor(loss[1]).detach()
        counted = counted_tokens()
        if counted is None:
            if in_layer.predicting_now():  # the Plan's prediction on fake tensors: any count does
                return torch.zeros((), device=stats.rows.device)
            raise RuntimeError(
                "router_aux_loss: the step weighs its loss by train_step(tokens=<count function>), whose count "
                "the engine gives its loss while a step runs; call the step, not its loss_fn"
            )
        return counted

    def __repr__(self) -> str:
        return f"RouterAuxLoss({self.loss_fn!r}, coef={self.coef!r})"


class ReportRouter:
    """A MoE block's forward that first reports its router's logits of the block's input, then runs the
    forward it had (another transform's, such as expert_parallel's, or the class's)."""

    def __init__(self, module: nn.Module, block: Block, inner: Any) -> None:
        self.module, self.block, self.inner = module, block, inner

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        m: Any = self.module
        if self.block.kind == "MixtralSparseMoeBlock" and m.training and m.jitter_noise > 0:
            raise ValueError(
                f"router_aux_loss: a MixtralSparseMoeBlock has router_jitter_noise={m.jitter_noise}, which scales "
                "each token by random noise before its router in training: the aux loss, computed from the block's "
                "input, would not be HF's (of the jittered logits); set config.router_jitter_noise = 0"
            )
        if self.block.kind == "PhimoeSparseMoeBlock" and m.training:
            for noise in (m.input_jitter_noise, m.router.input_jitter_noise):
                if noise > 0:  # the draws of sparsemixer do not change the logits HF's loss reads; this does
                    raise ValueError(
                        f"router_aux_loss: a PhimoeSparseMoeBlock has input_jitter_noise={noise}, which scales each "
                        "token by random noise before its router in training: the aux loss, computed from the "
                        "block's input, would not be HF's (of the jittered logits); set config.input_jitter_noise = 0"
                    )
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        where = f"the {type(m).__name__} at {self.block.path or 'the layer'}"
        refuse_hooks(m, self.block.kind, "router_aux_loss", where)
        if self.block.kind == "TopKMoE":
            logits = m.gate(flat)
        else:  # the logits HF records for its loss: the router's linear map (GPT-OSS's with its bias)
            router = router_of(m, self.block.kind)
            logits = F.linear(flat, router.weight, getattr(router, "bias", None))
        report(logits, top_k_of(m, self.block.kind), self.block.kind)
        if self.inner is not None:
            return self.inner(hidden_states, *args, **kwargs)
        return type(m).forward(m, hidden_states, *args, **kwargs)


def _reporting(fn: Any, layer: str) -> Any:
    """A copy of the layer fn whose module's MoE blocks report their routing (the fn itself without any).
    Another transform's wrapper (expert_parallel's gradient sums, remat, casts) is copied around the
    copy of the module fn it holds as ``fn``."""
    if not hasattr(fn, "replicas"):
        inner = getattr(fn, "fn", None)
        if inner is None:
            return fn
        new_inner = _reporting(inner, layer)
        if new_inner is inner:
            return fn
        outer = copy.copy(fn)
        object.__setattr__(outer, "fn", new_inner)  # a frozen dataclass's field too (remat's)
        return outer
    replicas = fn.replicas
    module = replicas.module
    if not isinstance(module, nn.Module):
        return fn
    prefix = str(getattr(replicas, "prefix", ""))
    blocks = find_blocks(module, prefix.rstrip(".") or layer, prefix, who="router_aux_loss")
    if not blocks:
        return fn
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    copied = copy.deepcopy(module, memo={**kept_in_copies(module), **{id(t): t for _, t in named}})
    for b in blocks:
        target = copied.get_submodule(b.path) if b.path else copied
        target.forward = ReportRouter(target, b, vars(target).get("forward"))
    new_fn = copy.copy(fn)
    new_fn.replicas = ThreadReplicas(copied, replicas.prefix)
    return new_fn


def router_aux_loss(step: Step, coef: float, *, per_microbatch: bool = False) -> Step:
    """Add the routers' load-balancing loss, times ``coef``, to ``step``'s loss: Hugging Face Mixtral's and
    Qwen2-MoE's ``output_router_logits=True`` with ``router_aux_loss_coef=coef``, over the whole batch.

    ``aux = E * sum_e f_e * P_e`` pools every MoE block of the chain (TopKMoE, HF MixtralSparseMoeBlock,
    Qwen2MoeSparseMoeBlock, OlmoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, JambaSparseMoeBlock, GptOssMLP
    (its router's logits with their bias), PhimoeSparseMoeBlock; all with ``E`` experts): ``f_e``
    is the share of the top-k assignments that went to expert ``e`` and ``P_e`` its mean router
    probability, over every token of every block. On
    one device it is HF's loss; under ``expert_parallel`` and ``shard_params`` (each, or both) it is counted once over
    the whole batch (the routing counts are summed over the batch's axes; the Plan lists those sums after
    the loss), so the step equals the single-device one. Under micro-batches (``pipeline``,
    ``shard_params(accumulation=)``) no micro-batch can know the whole batch's routing before it runs:
    each micro-batch's aux would be over its own tokens and the step's their mean, which is HF's under
    gradient accumulation but another loss than the single-device step's (the aux is not linear in the
    batch). Such a stack is refused unless ``per_microbatch=True`` says that is the loss you want; where
    the batch is also cut over ranks, a micro-batch is the same part of every rank's share, so which rows
    share a micro-batch, and that loss, depend on the mesh.
    A token-weighted step (``train_step(tokens=)`` a count function or ``"sum"``: padded labels on a batch
    the step cuts) adds the aux once beside its weighted loss, not multiplied by any rank's token count,
    so it too equals the single-device step (under micro-batches, each one's aux weighs by its share of
    the counted tokens); ``tokens="per_shard_mean"`` adds it once beside the shares' mean losses.

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import TopKMoE
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), TopKMoE(8, 8, num_experts=4, top_k=2)).double()
    >>> chain, params = sw.functionalize(model)
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> with_aux = sw.router_aux_loss(step, 0.01)
    >>> batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    >>> _, plain = step(step.init(params), batch)
    >>> _, metrics = with_aux(with_aux.init(params), batch)
    >>> bool(metrics["loss"] > plain["loss"])
    True
    >>> ep = sw.expert_parallel(with_aux, "ep")
    >>> _ = sw.testing.assert_equivalent(ep, with_aux, sw.Mesh(ep=2), [batch, batch], params)
    >>> zero = sw.shard_params(with_aux, "dp", 3)  # FSDP of the MoE, every expert on each rank
    >>> _ = sw.testing.assert_equivalent(zero, with_aux, sw.Mesh(dp=2), [batch, batch], params)
    """
    if not isinstance(step, Step):
        raise TypeError(f"router_aux_loss(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ValueError(f"router_aux_loss(coef={coef!r}): give a number >= 0 (HF Mixtral's default is 0.02)")
    blocks_of = resolve(step.base_chain, "router_aux_loss", trainable=False)  # it reads only the routers
    experts = {b.num_experts for blocks in blocks_of.values() for b in blocks}
    if len(experts) != 1:
        raise ValueError(
            f"router_aux_loss: the chain's MoE blocks have {sorted(experts)} experts; HF's loss pools every "
            "block's routing over one set of experts, so they must all have the same number"
        )
    num_experts = experts.pop()
    if not isinstance(per_microbatch, bool):
        raise TypeError(f"router_aux_loss(per_microbatch={per_microbatch!r}): True or False")
    spec = RouterAuxSpec(float(coef), num_experts, per_microbatch)
    return add(step, spec, loss_fn=RouterAuxLoss(step.loss_fn, float(coef), num_experts, step.tokens))
