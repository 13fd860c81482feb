"""context_parallel: each rank of a mesh axis holds a slice of every sequence; attention exchanges the rest.

Two attentions, both pure differentiable functions over a mesh axis (torchtitan CP; DeepSpeed Ulysses):

* :func:`ring_attention`: keys and values travel around the ring (``ppermute``), an online softmax
  merges the blocks (torch's CPU flash kernel each); causal attention load-balanced over ``2n``
  chunks (``layout.py``).
* :func:`ulysses_attention`: all-to-all from sequence-split to head-split, whole-sequence attention on
  the local heads, all-to-all back; the axis size must divide the (key/value) heads.

:func:`shard_sequence` / :func:`unshard_sequence` cut and join sequences (inputs, positions, labels)
the way both expect; ``volumes.py`` gives the bytes each sends. Both take a :class:`TokenMask`
(:func:`token_mask`): padding and packed sequences.

:func:`context_parallel` is the transform (``spec.py``): a SPLIT over its axis that cuts every
sequence of the batch, no parameter; its attention layers run one of the two functions here (a
transformers attention it does not reproduce, through transformers' ``AttentionInterface``:
``hf_interface.py``), its
position tables are read at the rank's global positions, and every gradient is summed over the axis.
"""

from ...engine.stack.compose import add
from ...engine.step.step import Step
from .layout import chunk_count, local_chunks, shard_order, shard_sequence, unshard_sequence
from .masks import TokenMask, token_mask
from .ring import ring_attention
from .shifted import refuse_shifting_loss
from .spec import CPSpec
from .ulysses import ulysses_attention
from .volumes import ring_attention_bytes, ulysses_attention_bytes

ATTENTIONS = ("ring", "ulysses")


def context_parallel(
    step: Step, axis: str = "cp", attention: str = "ring", balanced: bool = True,
    positions: tuple[str, ...] = ("pos_emb",), dim: int = 1,
) -> Step:
    """Cut every sequence of ``step``'s batch over mesh ``axis``; attention exchanges the rest (torchtitan CP,
    DeepSpeed Ulysses).

    Each rank of ``axis`` takes its part of every sequence of the batch (inputs and targets alike, along
    ``dim``; shift targets on the whole sequence first): with ``balanced``, chunks ``i`` and ``2n - 1 - i``
    of ``2n``, which gives every rank the same causal attention work. A loss that shifts the labels
    itself (transformers' ``ForCausalLMLoss``) and targets that are the input ids themselves are refused:
    they would shift inside each rank's part. Its attention modules (TinyGPT's ``CausalSelfAttention``,
    with qkv, proj, head_dim and a causal mask; Hugging Face attentions on
    ``attn_implementation="sdpa"``: Llama's, and GPT-2's with ``positions=("wpe.weight",)``; another
    class with the same parts is refused) attend over
    the whole sequence by ``attention="ring"`` (key/value slices passed round the ring, ``n - 1`` ppermutes each way) or
    ``"ulysses"`` (all-to-alls to a head split and back; the axis size must divide the query heads, and
    key/value heads it does not divide go as copies within their groups). Any other attention of a
    transformers model (a class of ``transformers.models.*``: Phi-3's, OLMo-2's, Cohere's, StarCoder2's, BERT's
    and ModernBERT's non-causal ones, ...) whose forward calls transformers' ``AttentionInterface`` runs its own
    forward (a wrapper around it, BERT's ``BertAttention``, as written), pointed at an attention
    function registered there that attends over the whole sequence the same way (a copy of the module's
    config in the split layer names it, nothing shared changes); what that function
    cannot compute exactly (a sliding window shorter than the sequence, soft-capped scores, attention sinks,
    attention dropout in training, a model not built on sdpa, an argument it does not know) is refused at
    the Plan or the first step, naming the module and the fix; so is a running sum along the sequence
    outside the attention (RoBERTa's position ids counted from the padding: give them in the batch). A module of
    any class whose forward calls :func:`ring_attention` / :func:`ulysses_attention` over ``axis`` itself
    is kept as written (outside any mesh both are plain attention: its single-device step). Position
    tables (parameters, or fixed buffers, named ``positions``, read at rows ``0 .. t - 1``) are read, and Hugging Face
    rotary embeddings computed, at the rank's global positions. Every parameter is replicated over
    ``axis`` and its gradient summed over it in backward; the loss is seeded by 1 / (dp x cp): a mean
    loss is the whole sequence's when every part holds as
    many counted tokens (for padded labels, count them with ``train_step(..., tokens=...)``).

    A batch dict's padding ``attention_mask`` (2-D) or, with ``attention_mask: None``, its restarting
    ``position_ids`` (packed sequences) mask the attention as transformers reads them: the layer that
    reads the batch all-gathers the rank's part and every attention gets the whole sequence's
    :class:`TokenMask`; position ids the batch gives feed the rotary embeddings as they are.

    It composes with ``shard_params`` over another axis (ZeRO over ``dp``), ``pipeline`` over another
    (each stage cuts its micro-batches' sequences; under a zero-bubble schedule the ring's backward runs
    in both the input and the weight pass), ``tensor_parallel`` over another (each tp rank's heads
    attend over ``cp``; Ulysses cuts the rank's heads, so ``cp`` must divide heads / tp),
    ``expert_parallel`` over another (each rank routes the tokens of its sequence part),
    ``mixed_precision`` and ``remat``.

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import TinyGPT
    >>> torch.manual_seed(0) and None
    >>> model = TinyGPT(vocab=16, d_model=8, n_heads=2, n_layers=1, seq_len=8).double()
    >>> chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    >>> loss = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    >>> step = sw.train_step(chain, loss, sw.optim.sgd(lr=0.1, momentum=0.9))
    >>> cp = sw.context_parallel(step, "cp")
    >>> ids = torch.randint(0, 16, (2, 9))
    >>> batch = (ids[:, :-1], ids[:, 1:])
    >>> sorted({c.op for c in cp.plan(sw.Mesh(cp=2), params, batch).collectives(0)})
    ['all_gather', 'ppermute', 'psum']
    >>> _ = sw.testing.assert_equivalent(cp, step, sw.Mesh(cp=2), [batch, batch], params)
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"context_parallel(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}"
        )
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"context_parallel(axis={axis!r}): the axis is a mesh axis name such as 'cp'")
    if attention not in ATTENTIONS:
        raise ValueError(f"context_parallel(attention={attention!r}): use one of {ATTENTIONS}")
    if not isinstance(balanced, bool):
        raise TypeError(f"context_parallel(balanced={balanced!r}) must be True or False")
    if isinstance(positions, str) or not all(isinstance(p, str) and p for p in positions):
        raise TypeError(f"context_parallel(positions={positions!r}) must be a tuple of parameter names")
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"context_parallel(dim={dim!r}): the sequence dim of the batch's leaves, 1 or more (0 is "
                         "the batch)")
    refuse_shifting_loss(step.loss_fn)  # it would shift the targets inside each rank's part
    spec = CPSpec(axis, attention, balanced, tuple(positions), dim, step.token_weighted)
    spec.resolve(step.base_chain)  # a chain without a known attention is refused now, not at the first step
    return add(step, spec)


__all__ = [
    "CPSpec",
    "TokenMask",
    "chunk_count",
    "context_parallel",
    "local_chunks",
    "ring_attention",
    "ring_attention_bytes",
    "shard_order",
    "shard_sequence",
    "token_mask",
    "ulysses_attention",
    "ulysses_attention_bytes",
    "unshard_sequence",
]
