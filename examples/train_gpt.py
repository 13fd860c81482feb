"""Train a small GPT data-parallel with ZeRO-3 (FSDP) sharding on a synthetic language.

Threads (the default; ranks are threads of this process):

    python examples/train_gpt.py --world 2 --steps 300

Processes on torch.distributed with gloo, started by torchrun:

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 300

The language is a fixed random Markov chain over the vocabulary, with a few
likely successors per token, so the loss falls from ln(vocab) towards the
chain's entropy and you can watch it learn.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import shardwise as sw
from shardwise.testing.models import TinyGPT


@dataclass(frozen=True)
class Config:
    steps: int = 300
    world: int = 2
    stage: int = 3
    batch: int = 16
    seq_len: int = 64
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    lr: float = 3e-3
    seed: int = 0


HELP = {  # what --help says of each Config field, beside its default
    "steps": "training steps",
    "world": "ranks (threads; under torchrun, the processes torchrun started)",
    "stage": "ZeRO stage: 1 shards the optimizer state, 2 also gradients, 3 also parameters",
    "batch": "global batch size (a multiple of --world)",
    "seq_len": "tokens per sample",
    "vocab": "vocabulary size of the synthetic language",
    "d_model": "model width",
    "n_heads": "attention heads",
    "n_layers": "transformer blocks",
    "lr": "peak learning rate (linear warm-up, cosine decay)",
    "seed": "seed of the model and of the language",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default in its help."""


def markov_language(vocab: int, successors: int, seed: int) -> torch.Tensor:
    """A transition matrix where each token has ``successors`` likely next tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -8.0)
    for token in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:successors]
        logits[token, nxt] = torch.randn(successors, generator=gen)
    return logits.softmax(-1)


def sample_batch(transitions: torch.Tensor, batch: int, seq_len: int, step: int, seed: int):
    """The same global batch on every rank (seeded by the step); shard_params splits it."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(transitions.shape[0], (batch,), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_step(cfg: Config):
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.vocab, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.seq_len)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    schedule = sw.optim.warmup_cosine(cfg.lr, warmup_steps=max(1, cfg.steps // 10), total_steps=cfg.steps)
    step = sw.train_step(chain, lm_loss, sw.optim.adamw(schedule, weight_decay=0.01), clip_norm=1.0)
    return sw.shard_params(step, "dp", stage=cfg.stage), params


def train(cfg: Config, built: tuple[sw.Step, dict] | None = None) -> list[float]:
    """The SPMD program: every rank runs this; rank 0 shows the progress bar.

    Thread ranks get the step built once, before they start: building the model in each of
    them would race on torch's global generator and give ranks different weights (which
    ``step.init`` refuses). Processes build their own, each from the same seed.
    """
    step, params = built if built is not None else build_step(cfg)
    mesh = sw.Mesh(dp=cfg.world)
    state = step.init(params, mesh)
    transitions = markov_language(cfg.vocab, successors=4, seed=cfg.seed)
    losses = []
    with tqdm(total=cfg.steps, desc="train", unit="step", disable=mesh.rank != 0) as bar:
        for i in range(cfg.steps):
            state, metrics = step(state, sample_batch(transitions, cfg.batch, cfg.seq_len, i, cfg.seed))
            losses.append(float(metrics["loss"]))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update()
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    for field, default in Config().__dict__.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default, help=HELP[field])
    cfg = Config(**vars(parser.parse_args(argv)))
    torch.set_num_threads(1)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        import datetime

        import torch.distributed as dist

        # One bound for every wait (shardwise's default): a rank that hangs fails the run in
        # minutes, not after torch's 30-minute default.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        try:
            cfg = Config(**{**cfg.__dict__, "world": dist.get_world_size()})
            losses = train(cfg)
            dist.barrier()  # no rank closes its connections while another still uses them
        finally:
            # A group left for the interpreter's exit to tear down makes torch 2.13's gloo abort
            # the process (SIGABRT) in about 1 run in 20 of this example; destroyed here, in none of 100.
            dist.destroy_process_group()
    else:
        losses = sw.launch(train, world=cfg.world, args=(cfg, build_step(cfg)))[0]
    if losses and (os.environ.get("RANK", "0") == "0"):
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform guess: {math.log(cfg.vocab):.3f})")
    return losses


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
