"""Peak memory per rank of an encoder-decoder (BART) under ZeRO-3: one layer, split per layer, torch FSDP2.

Run it from the repository root:

    python benchmarks/memory_encdec.py                   # 6 + 6 layers, d_model 512: 179 MB, worlds 2,4
    python benchmarks/memory_encdec.py --worlds 2 --out memory_encdec.jsonl

What is measured
----------------
``BartForConditionalGeneration`` (tiny vocabulary, ``d_model`` 512, 6 encoder and 6 decoder layers, FFN
2048: 44.7 M float32 parameters, 179 MB; parameters dominate), wrapped to return its logits, a float32
cross entropy on a global batch of ``batch`` sequences of ``seq`` tokens, SGD (shardwise's with
``inplace=True``: it writes the new parameters into the state given, as ``torch.optim.SGD`` does; the
functional one holds the old and the new shards at once at the update), ``steps`` steps. Each
variant runs in a fresh gloo :class:`ProcessPool` of its own (``--pools world`` runs a world's variants
in one pool instead: the test suite's smoke run, whose figures are not to be compared), after one run on
a tiny BART (the imports and one-time setup are not the model's), with glibc's mmap and trim
thresholds at 128 KiB in the ranks (``LIVE_MALLOC``: freed tensors return to the system at once, RSS
follows live memory; torch's CPU allocator caches nothing), as ``memory.py``. Every rank builds the
whole model, seeded, then:

* ``shardwise_whole``: ``sw.functionalize(model)`` (``units=None``: one layer), ``shard_params(stage=3)``:
  ZeRO-3 gathers the whole model at once;
* ``shardwise_split``: ``units=(BartEncoderLayer, BartDecoderLayer)``: ``embed``, 6 encoder layers, the
  bridge, 6 decoder layers, ``head``, ZeRO-3 gathering one layer at a time;
* ``fsdp2``: ``fully_shard`` on every encoder and decoder layer, then on the root (FSDP2's recipe),
  ``torch.optim.SGD``; each rank steps on its slice of the batch.

Output: one JSON line per (world, variant): ``step_peak_bytes`` (the steps' VmHWM above the resident
size after init and the model's release, the largest over ranks; what training holds beyond the shards
is its difference from the shards' size), ``held_bytes`` (that resident size above the baseline before
the model was built: the shards and the state), ``model_bytes``, ``ratio_to_fsdp2`` (step peak over
FSDP2's).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import add_out_flag, environment, json_lines, note
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, PeakRSS, status_bytes

VARIANTS = ("fsdp2", "shardwise_whole", "shardwise_split")


@dataclass(frozen=True)
class Config:
    d_model: int
    layers: int
    batch: int
    seq: int
    steps: int
    world: int
    vocab: int = 1024


class LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).logits


def build(cfg: Config) -> LogitsOnly:
    import transformers as T

    torch.manual_seed(0)  # every rank builds the same weights
    return LogitsOnly(T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=cfg.vocab, d_model=cfg.d_model, encoder_layers=cfg.layers, decoder_layers=cfg.layers,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=4 * cfg.d_model,
        decoder_ffn_dim=4 * cfg.d_model, max_position_embeddings=cfg.seq, dropout=0.0, attention_dropout=0.0,
        use_cache=False)))


def batch_of(cfg: Config, rows: slice | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    labels = torch.randint(4, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    if rows is not None:
        ids, labels = ids[rows], labels[rows]
    return {"input_ids": ids, "labels": labels}, labels


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def fsdp2(cfg: Config, base: PeakRSS) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (cfg.world,))
    model = build(cfg)
    bart = model.model.model
    for layer in [*bart.encoder.layers, *bart.decoder.layers]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rows = cfg.batch // cfg.world
    x, y = batch_of(cfg, slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows))
    held, stepping = _held(base), PeakRSS()
    for _ in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(**x), y).backward()
        opt.step()
    return {"held_bytes": held, "step_peak_bytes": stepping.peak()}


def shardwise_zero3(cfg: Config, base: PeakRSS, split: bool) -> dict[str, Any]:
    import transformers as T

    model = build(cfg)
    bart = T.models.bart.modeling_bart
    units = (bart.BartEncoderLayer, bart.BartDecoderLayer) if split else None
    chain, params = sw.functionalize(model, units=units, example_input=batch_of(replace(cfg, batch=2))[0])
    del model
    step = sw.shard_params(sw.train_step(chain, cross_entropy, sw.optim.sgd(1e-3, inplace=True)), "dp", stage=3)
    state = step.init(params, sw.Mesh(dp=cfg.world))
    del params
    batch = batch_of(cfg)
    held, stepping = _held(base), PeakRSS()
    for _ in range(cfg.steps):
        state, _ = step(state, batch)
    return {"held_bytes": held, "step_peak_bytes": stepping.peak(), "layers": len(chain.names)}


def _held(base: PeakRSS) -> int:
    gc.collect()
    return status_bytes("VmRSS") - base.base


PROGRAMS = {
    "fsdp2": fsdp2,
    "shardwise_whole": lambda cfg, base: shardwise_zero3(cfg, base, split=False),
    "shardwise_split": lambda cfg, base: shardwise_zero3(cfg, base, split=True),
}


def warmed(variant: str, cfg: Config) -> dict[str, Any]:
    """The variant after a run of it on a tiny BART (imports and one-time setup are not the model's);
    what lives before the measured run is frozen out of the collector's reach (as memory.py): each
    reading's ``gc.collect()`` walks only what the variant made, not torch's and transformers' objects
    (those collections were an eighth of the ranks' time)."""
    gc.collect()
    gc.freeze()
    try:
        PROGRAMS[variant](replace(cfg, d_model=16, layers=1, seq=8, steps=1, vocab=64), PeakRSS())
        gc.collect()
        gc.freeze()
        return PROGRAMS[variant](cfg, PeakRSS())
    finally:
        gc.unfreeze()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6, help="layers per stack (default 6)")
    parser.add_argument("--batch", type=int, default=4, help="global batch of sequences (default 4)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--pools", choices=("variant", "world"), default="variant",
                        help="variant: a fresh pool of processes per variant, so that none inherits another's "
                             "memory; world: one pool per world for all its variants (a smoke run: start-up "
                             "costs less, the figures are not comparable) (default: variant)")
    add_out_flag(parser)
    args = parser.parse_args()
    os.environ.update(LIVE_MALLOC)  # the ranks start with it (glibc reads it at process start)
    with json_lines(args.out) as emit:
        for world in [int(w) for w in args.worlds.split(",")]:
            cfg = Config(args.d_model, args.layers, args.batch, args.seq, args.steps, world)
            model_bytes = sum(p.numel() for p in build(cfg).parameters()) * 4
            reference = None
            shared = ProcessPool(world, timeout=1800) if args.pools == "world" else None
            with shared or contextlib.nullcontext():
                for variant in [v for v in VARIANTS if v in args.variants.split(",")]:
                    note(f"memory_encdec: world {world}, {variant}")
                    row = measured(cfg, variant, model_bytes, shared)
                    if variant == "fsdp2":
                        reference = row["step_peak_bytes"]
                    elif reference:
                        row["ratio_to_fsdp2"] = round(row["step_peak_bytes"] / reference, 3)
                    emit({**row, **environment(), "malloc": "128KiB thresholds", "pools": args.pools})


def measured(cfg: Config, variant: str, model_bytes: int, pool: ProcessPool | None) -> dict[str, Any]:
    """The variant's row on a fresh pool of ``cfg.world`` processes, or on ``pool`` where one is given."""
    with contextlib.nullcontext(pool) if pool else ProcessPool(cfg.world, timeout=1800) as ranks:
        per_rank = ranks.run(warmed, variant, cfg)
    row: dict[str, Any] = {
        "bench": "memory_encdec", "variant": variant, "world": cfg.world, "model_bytes": model_bytes,
        "held_bytes": max(r["held_bytes"] for r in per_rank),
        "step_peak_bytes": max(r["step_peak_bytes"] for r in per_rank),
        "step_peak_bytes_per_rank": [r["step_peak_bytes"] for r in per_rank],
    }
    if "layers" in per_rank[0]:
        row["layers"] = per_rank[0]["layers"]
    return row


if __name__ == "__main__":
    main()
