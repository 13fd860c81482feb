"""Ready tensor-parallel plans for common model families (module paths of Hugging Face models).

Each returns a plain dict of pattern -> style that can be edited like any other plan.
"""

from __future__ import annotations

from .styles import Colwise, HeadsAlong, PerHead, Region, Rowwise, Style


def llama_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """Llama-style decoders (Llama, Mistral, Qwen2): q/k/v and gate/up split on their outputs,
    o/down on their inputs, whole heads per rank (query and key/value heads must both divide by
    the axis size: grouped-query attention keeps its groups), the embedding split on the
    vocabulary, and the head's logits left split for :func:`vocab_parallel_cross_entropy`
    (``vocab_parallel=False``: gathered, for any loss)."""
    return {
        "model.embed_tokens": Rowwise(),
        "model.layers.*.self_attn": Region(heads=("config.num_attention_heads", "config.num_key_value_heads")),
        "model.layers.*.self_attn.[qkv]_proj": Colwise(),
        "model.layers.*.self_attn.o_proj": Rowwise(),
        "model.layers.*.mlp": Region(),
        "model.layers.*.mlp.gate_proj": Colwise(),
        "model.layers.*.mlp.up_proj": Colwise(),
        "model.layers.*.mlp.down_proj": Rowwise(),
        "lm_head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


LLAMA_BLOCKS = "model.layers.*"  # sequence_parallel= for llama_plan


def gpt_oss_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """GPT-OSS (transformers' ``GptOssForCausalLM``): the attention as :func:`llama_plan` splits it, and its
    sinks, one learned logit per query head (``(num_attention_heads,)``), cut as the heads are
    (:class:`PerHead`): each rank holds and trains its own heads' sinks. The MoE MLP (its router and
    stacked experts) stays whole on every rank: tensor parallel splits Linear, Conv1D and Embedding
    modules, not experts held as ``(experts, in, out)`` parameters (``sw.expert_parallel`` splits
    experts over ranks). Sequence parallel over its blocks is refused: the MoE's dispatch of tokens to
    experts would run on slices of the sequence, which is not followed.

    transformers 5's own ``base_model_tp_plan`` for GPT-OSS names only ``embed_tokens``
    (``"embedding_rowwise"``: Rowwise here); transformers 4's split the attention as here and named the
    sinks ``"local_rowwise"``, a cut of their one dim into tp equal contiguous blocks: PerHead's cut."""
    return {
        "model.embed_tokens": Rowwise(),
        "model.layers.*.self_attn": Region(heads=("config.num_attention_heads", "config.num_key_value_heads")),
        "model.layers.*.self_attn.[qkv]_proj": Colwise(),
        "model.layers.*.self_attn.o_proj": Rowwise(),
        "model.layers.*.self_attn.sinks": PerHead(),
        "lm_head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


def gpt2_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """GPT-2 (transformers' ``GPT2LMHeadModel``). ``c_attn`` is one Conv1D computing q, k and v
    side by side (weight ``(hidden, 3 * hidden)``): it is split as three fused blocks, so a rank
    holds the same heads of each, and ``split_size`` (the width the attention cuts the fused
    output at) is divided by the axis size. The token embedding is tied to the head, so both
    split the vocabulary; the position embedding stays whole."""
    return {
        "transformer.wte": Rowwise(),
        "transformer.h.*.attn": Region(heads=("num_heads",), local=("split_size",)),
        "transformer.h.*.attn.c_attn": Colwise(fused=3),
        "transformer.h.*.attn.c_proj": Rowwise(),
        "transformer.h.*.mlp": Region(),
        "transformer.h.*.mlp.c_fc": Colwise(),
        "transformer.h.*.mlp.c_proj": Rowwise(),
        "lm_head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


GPT2_BLOCKS = "transformer.h.*"


def bloom_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """Bloom (transformers' ``BloomForCausalLM``). Its fused ``query_key_value`` is laid out per head (``(heads, 3,
    head_dim)``), so a plain Colwise cuts it at head boundaries, and the attention's ``split_size`` is divided
    with the heads. BloomModel builds one ALiBi bias of every head around the layers, ``alibi`` of shape ``(b *
    H, 1, t)`` (batch and heads folded, batch-major): :class:`HeadsAlong` hands each rank's attention its heads'
    rows. The token embedding, tied to the head, and the head split the vocabulary."""
    attention = Region(heads=("num_heads",), local=("split_size",),
                       arguments={"alibi": HeadsAlong(dim=0, folded_batch=True)})
    return _fused_qkv_layers(attention, vocab_parallel)


BLOOM_BLOCKS = "transformer.h.*"


def mpt_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """MPT (transformers' ``MptForCausalLM``). ``Wqkv`` computes q, k and v as three blocks side by side
    (``Colwise(fused=3)``); MptModel builds one ALiBi bias of every head around the layers, ``position_bias`` of
    shape ``(H, 1, t)``: :class:`HeadsAlong` along dim 0 hands each rank's attention its heads'. The token
    embedding, tied to the head, and the head split the vocabulary."""
    return {
        "transformer.wte": Rowwise(),
        "transformer.blocks.*.attn": Region(heads=("n_heads",), arguments={"position_bias": HeadsAlong(dim=0)}),
        "transformer.blocks.*.attn.Wqkv": Colwise(fused=3),
        "transformer.blocks.*.attn.out_proj": Rowwise(),
        "transformer.blocks.*.ffn": Region(),
        "transformer.blocks.*.ffn.up_proj": Colwise(),
        "transformer.blocks.*.ffn.down_proj": Rowwise(),
        "lm_head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


MPT_BLOCKS = "transformer.blocks.*"


def falcon_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """Falcon (transformers' ``FalconForCausalLM``), with or without ALiBi. Its fused ``query_key_value`` is laid
    out per head (``(heads, 3, head_dim)``), so a plain Colwise cuts it at head boundaries. The grouped-query
    ``new_decoder_architecture`` (Falcon-40B's) lays it out per key/value group (``(num_kv_heads, queries per group
    + 2, head_dim)``): a plain Colwise gives each rank whole groups, the Region divides ``num_kv_heads`` with
    ``num_heads``, and the attention's cut of each group's queries is a cut within each group (the split watch
    follows the groups). The tp size must divide the key/value heads: fewer groups than ranks are refused, naming
    ``config.num_kv_heads``; so is the first layout's ``multi_query=True`` (Falcon-7B's one key/value head for all),
    naming ``config.multi_query`` and the ways out (the attention left out of the plan, or another layout).
    With ``alibi=True`` FalconModel folds one ALiBi bias of every head into the ``attention_mask`` it hands each
    layer, ``(b, H, q, k)``: :class:`HeadsAlong` along dim 1 hands each rank's attention its heads'; without ALiBi
    that mask is ``(b, 1, q, k)``, broadcast over the heads, and handed on whole. The token embedding, tied to the
    head, and the head split the vocabulary."""
    attention = Region(heads=("num_heads", "num_kv_heads"), arguments={"attention_mask": HeadsAlong(dim=1)})
    return _fused_qkv_layers(attention, vocab_parallel)


FALCON_BLOCKS = "transformer.h.*"


def _fused_qkv_layers(attention: Region, vocab_parallel: bool) -> dict[str, Style]:
    """Bloom's and Falcon's module paths (the same but for their attention's Region): one fused
    ``query_key_value`` laid out per head or per key/value group, a plain Colwise."""
    return {
        "transformer.word_embeddings": Rowwise(),
        "transformer.h.*.self_attention": attention,
        "transformer.h.*.self_attention.query_key_value": Colwise(),
        "transformer.h.*.self_attention.dense": Rowwise(),
        "transformer.h.*.mlp": Region(),
        "transformer.h.*.mlp.dense_h_to_4h": Colwise(),
        "transformer.h.*.mlp.dense_4h_to_h": Rowwise(),
        "lm_head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


def tiny_gpt_plan(*, vocab_parallel: bool = True) -> dict[str, Style]:
    """:class:`shardwise.testing.TinyGPT`: fused ``qkv`` Linear, a 2-layer MLP, the head tied to the
    token embedding."""
    return {
        "tok_emb": Rowwise(),
        "blocks.*.attn": Region(heads=("n_heads",)),
        "blocks.*.attn.qkv": Colwise(fused=3),
        "blocks.*.attn.proj": Rowwise(),
        "blocks.*.mlp": Region(),
        "blocks.*.mlp.0": Colwise(),
        "blocks.*.mlp.2": Rowwise(),
        "head": Colwise(output="sharded" if vocab_parallel else "replicated"),
    }


TINY_GPT_BLOCKS = "blocks.*"
