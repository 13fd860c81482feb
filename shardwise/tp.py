"""Tensor parallel's pieces: the styles a plan maps module paths to, ready plans, the vocabulary-parallel loss.

``sw.tensor_parallel(step, axis, plan)`` takes a plan: a dict from module paths
(fnmatch patterns on ``model.named_modules()``) to ``Colwise()``, ``Rowwise()``
or ``Region()`` (its ``arguments`` of one slice per head: ``HeadsAlong()``), and parameter paths to
``PerHead()``. ``llama_plan``, ``gpt2_plan``, ``gpt_oss_plan``, ``bloom_plan``, ``mpt_plan``,
``falcon_plan`` and ``tiny_gpt_plan`` are ready ones; ``docs/tensor_parallel.md`` says what each style does.
A Region whose first call cannot be judged by its values warns :class:`RegionNotJudged` (once per module class
and cause).

>>> import shardwise as sw
>>> sorted(sw.tp.tiny_gpt_plan().items())[:2]
[('blocks.*.attn', Region(heads=('n_heads',), local=())), ('blocks.*.attn.proj', Rowwise())]
"""

from .transforms.tensor_parallel import (
    BLOOM_BLOCKS,
    FALCON_BLOCKS,
    GPT2_BLOCKS,
    LLAMA_BLOCKS,
    MPT_BLOCKS,
    TINY_GPT_BLOCKS,
    Colwise,
    HeadsAlong,
    PerHead,
    Region,
    RegionNotJudged,
    Rowwise,
    bloom_plan,
    falcon_plan,
    gpt2_plan,
    gpt_oss_plan,
    llama_plan,
    mpt_plan,
    tiny_gpt_plan,
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
)

# A warning names its class by its module: the public one, not where it happens to live.
RegionNotJudged.__module__ = __name__

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
    "bloom_plan",
    "falcon_plan",
    "gpt2_plan",
    "gpt_oss_plan",
    "llama_plan",
    "mpt_plan",
    "tiny_gpt_plan",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
]
