"""An unmodified Hugging Face Llama trained 3-D: ZeRO-3 over dp, a 1F1B pipeline over pp, tensor
parallel over tp, on 8 thread ranks.

    pip install -e ".[hf]"
    python examples/tensor_parallel.py --steps 40

The model is a ``LlamaForCausalLM`` built from a small config with random weights (nothing is
downloaded), split per decoder layer by ``sw.functionalize``. Three transforms make its step
distributed on ``Mesh(dp=2, pp=2, tp=2)``:

* ``tensor_parallel`` with ``sw.tp.llama_plan()``: q/k/v and gate/up split on their outputs,
  o/down on their inputs (whole heads per rank, grouped-query attention keeps its groups), the
  embedding and the head split on the vocabulary, and sequence parallel over the decoder layers
  (``"model.layers.*"``): norms and the residual stream run on each rank's slice of the sequence;
* ``pipeline``: the decoder layers in two stages, 1F1B over 2 micro-batches;
* ``shard_params`` stage 3: ZeRO-3 over dp shards each rank's tensor-parallel slices.

The loss is ``sw.tp.vocab_parallel_cross_entropy``: the head leaves the logits split over the
vocabulary, and it computes the cross-entropy from the slices without gathering them (on the
single-device step it is plain cross-entropy). The composed step is first checked in float64
against the single-device step with ``sw.testing.assert_equivalent``, then trained in float32 on
a synthetic language.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shardwise as sw
from shardwise.tp import LLAMA_BLOCKS

MESH = {"dp": 2, "pp": 2, "tp": 2}
MICROBATCHES = 2


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of the model's logits, whole or split over the vocabulary."""
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def batches(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A synthetic language: each token is followed by (token * 3 + 1) % vocab most of the time."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq + 1):
            follow = (ids[:, t - 1] * 3 + 1) % vocab
            noise = torch.randint(0, vocab, (batch,), generator=g)
            ids[:, t] = torch.where(torch.rand(batch, generator=g) < 0.9, follow, noise)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def build(args: argparse.Namespace, example: torch.Tensor, *, float64: bool) -> tuple[sw.Step, sw.Step, dict]:
    """The 3-D step, the single-device step it must equal, and the parameters (float64 or float32)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model = model.double() if float64 else model.float()
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=example)
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(args.lr, momentum=0.9), clip_norm=1.0)
    composed = sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=LLAMA_BLOCKS)
    composed = sw.pipeline(composed, "pp", schedule="1f1b", microbatches=MICROBATCHES)
    composed = sw.shard_params(composed, "dp", stage=3)
    return composed, step, params


def train(step: sw.Step, params: dict, data: list) -> list[float]:
    """The SPMD program on every rank; rank 0 prints the loss (the global one, the same on every rank)."""
    mesh = sw.Mesh(MESH)
    state = step.init(params, mesh)
    losses = []
    for i, batch in enumerate(data):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if mesh.rank == 0:
            print(f"step {i + 1:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default in its help."""


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--check-steps", type=int, default=2, help="float64 steps compared with the single device")
    parser.add_argument("--steps", type=int, default=40, help="float32 training steps after the check")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=32, help="model width")
    parser.add_argument("--n-layers", type=int, default=2, help="decoder layers (at least one per pipeline stage)")
    parser.add_argument("--n-heads", type=int, default=4, help="query heads (the tp size must divide them)")
    parser.add_argument("--n-kv-heads", type=int, default=2, help="key/value heads (the tp size must divide them)")
    parser.add_argument("--seq-len", type=int, default=16, help="a multiple of the tp size (sequence parallel)")
    parser.add_argument("--batch", type=int, default=8, help="a multiple of dp x micro-batches")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mesh = sw.Mesh(MESH)

    check = batches(args.vocab, args.batch, args.seq_len, args.check_steps, seed=1)
    composed, reference, params = build(args, check[0][0], float64=True)
    print(composed.describe())
    plan = composed.plan(mesh, params, check[0])
    tp_bytes = {op: sent[0] for (axis, op), sent in plan.comm_bytes().items() if axis == "tp"}
    print(f"tp bytes sent by rank 0 per step: {tp_bytes}")
    print(sw.testing.assert_equivalent(composed, reference, mesh, check, params))

    data = batches(args.vocab, args.batch, args.seq_len, args.steps, seed=2)
    composed, _, params = build(args, data[0][0], float64=False)
    losses = sw.launch(train, world=mesh.size, args=(composed, params, data))[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    return losses


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
