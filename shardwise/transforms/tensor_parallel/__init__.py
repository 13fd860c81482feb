"""tensor_parallel: Megatron column / row parallel layers by name pattern, sequence parallel, and a
vocabulary-parallel loss."""

from __future__ import annotations

from collections.abc import Mapping

from ...engine.stack.compose import add
from ...engine.step.step import Step
from .loss import SplitLogitsLoss, vocab_parallel_cross_entropy, vocab_parallel_logsumexp
from .not_judged import RegionNotJudged
from .plans import (
    BLOOM_BLOCKS,
    FALCON_BLOCKS,
    GPT2_BLOCKS,
    LLAMA_BLOCKS,
    MPT_BLOCKS,
    TINY_GPT_BLOCKS,
    bloom_plan,
    falcon_plan,
    gpt2_plan,
    gpt_oss_plan,
    llama_plan,
    mpt_plan,
    tiny_gpt_plan,
)
from .spec import TPSpec
from .styles import Colwise, HeadsAlong, PerHead, Region, Rowwise, Style

__all__ = [
    "BLOOM_BLOCKS",
    "FALCON_BLOCKS",
    "GPT2_BLOCKS",
    "LLAMA_BLOCKS",
    "MPT_BLOCKS",
    "TINY_GPT_BLOCKS",
    "Colwise",
    "HeadsAlong",
    "PerHead",
    "Region",
    "RegionNotJudged",
    "Rowwise",
    "TPSpec",
    "bloom_plan",
    "falcon_plan",
    "gpt2_plan",
    "gpt_oss_plan",
    "llama_plan",
    "mpt_plan",
    "tensor_parallel",
    "tiny_gpt_plan",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
]


def tensor_parallel(
    step: Step, axis: str = "tp", plan: Mapping[str, Style] | None = None, *, sequence_parallel: str | None = None
) -> Step:
    """Split the parameters of ``step``'s layers over mesh ``axis`` as ``plan`` says (Megatron-LM).

    ``plan`` maps module path patterns (fnmatch over ``model.named_modules()`` paths) to
    :class:`Colwise`, :class:`Rowwise` and :class:`Region` (``sw.tp``), and parameter path patterns to
    :class:`PerHead` (a parameter of one value per head, GPT-OSS's attention sinks); a Region's ``arguments``
    name its module's arguments of one slice per head (:class:`HeadsAlong`: ALiBi's bias, which Bloom, MPT
    and Falcon build around the layers), cut to the rank's heads at each call; modules it does not
    name keep their parameters whole on every rank. Each rank of ``axis`` holds its slice of every
    split parameter and computes with it; the layers run unchanged, and the communication goes
    through shardwise's differentiable collectives (an all-reduce where a Rowwise output is summed
    and where a Region's input gradient is, in backward), listed in the Plan with their bytes.
    Every rank of ``axis`` takes the same batch; the step equals ``step`` on it.

    ``sequence_parallel`` is a pattern naming the transformer blocks (``"model.layers.*"``): between
    their tensor-parallel regions, the residual stream, norms and dropout run on each rank's slice
    of the sequence (Megatron-SP), and the all-reduces become all-gathers and reduce-scatters. The
    sequence is split at the first block's input and gathered at the last one's output; a
    vocabulary-split embedding's lookups are reduce-scattered into the first block and the head's
    input gradient is reduce-scattered out of the last, as torch's DTensor plan does. A Hugging Face
    mixture-of-experts block the plan leaves whole runs on the slice too, its experts replicated
    (transformers' fused experts, whose code is known to compute each token alone and drop none), or
    split over another axis by ``expert_parallel`` (Megatron's TP + SP + EP: its block forward, which
    dispatches the slice's tokens over that axis, runs as one per-token op; the experts' gradients are
    summed over ``axis``).

    A split parameter is for its own module's forward alone (a Linear subclass's own forward runs, its weight
    followed to its product with the input): model code that reads one elsewhere (a parent's
    ``self.up.weight.norm()``, a regularizer over ``self.parameters()``) would get the rank's slice, and is
    refused at the layer's first forward, naming the parameter and the line; a Linear
    computed by ``torch.nn.utils.parametrize`` (``weight_norm``) takes no style. That watch runs on each
    layer's first call only (the Plan's prediction, or the first step): a read that happens only on a later
    call (a branch taken from the second step on) is not seen, and computes with the slice without an error.

    When the head leaves the logits split (``Colwise(output="sharded")``), ``loss_fn`` must compute
    its cross-entropy with :func:`vocab_parallel_cross_entropy`; a step whose loss does not is refused.

    Every step checks that the gradients of the replicated parameters came out equal on every
    rank of ``axis`` (``check_replicas``: a 520-byte all-gather of their sums and sums of
    magnitudes in 32 bins, and of the batch's fingerprint), and refuses to update when they did not: a
    replicated parameter used on per-rank values without its gradient being summed would otherwise
    drift apart silently (and ranks given different batches are told so). Random ops on
    replicated values draw the same stream on every rank of ``axis`` (dropout on the residual stream
    agrees); inside a Region, up to the Rowwise that sums its output, and in a sequence-parallel
    block, each rank draws its own (its heads', its slice of the sequence's).

    It composes with ``shard_params`` (2-D: ZeRO over another axis shards each rank's slices),
    ``pipeline`` (3-D), ``mixed_precision`` (sums travel in the reduce dtype, gathers in the compute dtype) and
    ``remat`` (a recomputed forward issues its collectives again); the global gradient norm counts
    a replicated parameter once.

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import mlp
    >>> model = mlp([8, 32, 8])
    >>> chain, params = sw.functionalize(model)
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> tp = sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    >>> plan = tp.plan(sw.Mesh(tp=2), params, (torch.randn(4, 8), torch.randn(4, 8)))
    >>> " ".join(str(a) for a in plan.for_rank(0))  # doctest: +NORMALIZE_WHITESPACE
    'F(0) F(1) F(2) psum(2, axis=tp) loss B(2) B(1) B(0) finish_grads check_replicas
    reduce_metrics(axis=tp) wait_check update wait_metrics'

    Layer 2's partial outputs (4 x 8 float32: 128 bytes) are summed, and so are the metrics (the loss,
    the squared norm, the batch's fingerprint and the step's digest, each with a weighted copy: 24 bytes):

    >>> plan.comm_bytes()[("tp", "psum")]
    (152, 152)
    """
    if not isinstance(step, Step):
        raise TypeError(f"tensor_parallel(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"tensor_parallel(axis={axis!r}): the axis is a mesh axis name such as 'tp'")
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"tensor_parallel(plan={plan!r}): give a dict of module path patterns to styles, e.g. "
            "{'model.layers.*.mlp.up_proj': sw.tp.Colwise(), 'model.layers.*.mlp.down_proj': sw.tp.Rowwise()}, "
            "or a ready one such as sw.tp.llama_plan()"
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"tensor_parallel: plan key {pattern!r} is not a module path pattern")
        if isinstance(style, HeadsAlong):
            raise TypeError(
                f"tensor_parallel: plan[{pattern!r}] = {style!r}; HeadsAlong() describes an argument of a Region's "
                "module, not a module or a parameter: give it in the Region's arguments, e.g. "
                "sw.tp.Region(heads=('num_heads',), arguments={'alibi': sw.tp.HeadsAlong(dim=0, folded_batch=True)})"
            )
        if not isinstance(style, (Colwise, Rowwise, Region, PerHead)):
            raise TypeError(
                f"tensor_parallel: plan[{pattern!r}] = {style!r}; a style is sw.tp.Colwise(), sw.tp.Rowwise() "
                "or sw.tp.Region() on a module, or sw.tp.PerHead() on a parameter holding one value per head"
            )
    if sequence_parallel is not None and (not isinstance(sequence_parallel, str) or not sequence_parallel):
        raise TypeError(
            f"tensor_parallel(sequence_parallel={sequence_parallel!r}): a module path pattern naming the "
            "transformer blocks, such as 'model.layers.*', or None"
        )
    spec = TPSpec(axis, tuple(plan.items()), sequence_parallel)
    spec.resolved(step.base_chain)  # a plan that cannot work is refused now, not at the first step
    loss_fn = step.loss_fn if isinstance(step.loss_fn, SplitLogitsLoss) else SplitLogitsLoss(step.loss_fn, axis)
    return add(step, spec, loss_fn=loss_fn)
