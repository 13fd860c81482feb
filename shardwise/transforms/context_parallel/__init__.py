"""context_parallel: each rank of a mesh axis holds a slice of every sequence; attention exchanges the rest.

Two attentions, both pure differentiable functions over a mesh axis (torchtitan CP; DeepSpeed Ulysses):

* :func:`ring_attention`: keys and values travel around the ring (``ppermute``), an online softmax
  merges the blocks; causal attention load-balanced over ``2n`` chunks (``layout.py``).
* :func:`ulysses_attention`: all-to-all from sequence-split to head-split, whole-sequence attention on
  the local heads, all-to-all back; the axis size must divide the (key/value) heads.

:func:`shard_sequence` / :func:`unshard_sequence` cut and join sequences (inputs, positions, labels)
the way both expect; ``volumes.py`` gives the bytes each sends.

How the ``context_parallel(step, axis, attention="ring" | "ulysses", balanced=True)`` spec will plug in,
once the engine's role protocols land (nothing of it exists yet):

* Role: a batch SPLIT of the sequence dim (like ``shard_params`` splits the batch dim) plus a REWRITE of
  the attention layers. The split applies :func:`shard_sequence` to every batch leaf that has the
  sequence dim (token ids, labels already shifted on the whole sequence, attention positions); the
  rewrite swaps the attention kernel of the layers it names (HF ``sdpa`` attention via the attention
  interface; TinyGPT's ``CausalSelfAttention``) for one of the two functions here, and feeds rotary
  embeddings the global positions (``shard_sequence(torch.arange(seq_len))``). An attention it cannot
  split (a custom mask, ``eager`` attention with a bias) is refused, naming the layer.
* Parameters: none split; every parameter is replicated over ``axis``, and its gradient, a sum over
  the ranks' tokens, is all-reduced (psum) over ``axis``; under ``shard_params`` the cp axis joins the
  dp axis in that reduction (reduce-scatter over dp x cp), as torchtitan folds cp into FSDP's mesh.
* Loss: token-weighted over the whole sequence: each rank sums its tokens' losses and the count of its
  valid tokens, and the divisor is the psum of the counts over dp and cp (not a mean of rank means).
* Plan: per attention layer, ``n - 1`` ring sends of the key/value slice (or four all-to-alls) forward
  and the same in backward, bytes from ``volumes.py``; the ledger must match.
"""

from .layout import chunk_count, local_chunks, shard_order, shard_sequence, unshard_sequence
from .ring import ring_attention
from .ulysses import ulysses_attention
from .volumes import ring_attention_bytes, ulysses_attention_bytes

__all__ = [
    "chunk_count",
    "local_chunks",
    "ring_attention",
    "ring_attention_bytes",
    "shard_order",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_attention_bytes",
    "unshard_sequence",
]
