"""An unmodified Hugging Face GPT-2, split per block, trained with ZeRO-3 and with a pipeline.

    pip install -e ".[hf]"
    python examples/hf_gpt2.py --steps 50

The model is built from a small config with random weights (nothing is downloaded).
``sw.functionalize(model, units=GPT2Block)`` records which blocks forward calls and
with which arguments, and cuts the model into ``embed`` (token and position
embeddings, the attention mask), one layer per block, and ``head`` (final norm, the
output head tied to the token embedding, and the model's own loss on ``labels``).
Both distributed steps are first checked against the single-device step with
``sw.testing.assert_equivalent``, then the ZeRO-3 step trains on a synthetic language.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import shardwise as sw


def own_loss(out, targets):  # type: ignore[no-untyped-def]
    """The model computes its loss from ``labels`` in the batch; there are no separate targets."""
    return out.loss


def batches(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[tuple[dict[str, torch.Tensor], None]]:
    """A synthetic language: each token is followed by (token * 3 + 1) % vocab most of the time."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            follow = (ids[:, t - 1] * 3 + 1) % vocab
            noise = torch.randint(0, vocab, (batch,), generator=g)
            ids[:, t] = torch.where(torch.rand(batch, generator=g) < 0.9, follow, noise)
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, None))
    return out


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="training steps after the check")
    parser.add_argument("--check-steps", type=int, default=2, help="steps compared with the single-device step")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=32, help="model width")
    parser.add_argument("--n-layers", type=int, default=2, help="GPT-2 blocks")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.n_layers,
        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    data = batches(args.vocab, args.batch, args.seq_len, max(args.steps, args.check_steps), seed=1)
    chain, params = sw.functionalize(model, units=GPT2Block, example_input=data[0][0])
    print(chain.summary(params).splitlines()[0] + ":", ", ".join(chain.names))

    step = sw.train_step(chain, own_loss, sw.optim.adamw(args.lr, weight_decay=0.01))
    zero3 = sw.shard_params(step, "dp", 3)
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    check = data[: args.check_steps]
    print("ZeRO-3 at dp=2:", sw.testing.assert_equivalent(zero3, step, sw.Mesh(dp=2), check, params))
    print("1F1B at pp=2:  ", sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), check, params))

    def train(state):  # type: ignore[no-untyped-def]
        losses = []
        for batch in data[: args.steps]:
            state, metrics = zero3(state, batch)
            losses.append(float(metrics["loss"]))
        return losses

    mesh = sw.Mesh(dp=2)
    losses = sw.launch(lambda: train(zero3.init(params, mesh)), world=mesh.size)[0]
    print(f"ZeRO-3 training: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
