"""Peak memory per rank on a transformer: an unmodified Hugging Face Llama, torch FSDP2 against shardwise ZeRO-3.

Run it from the repository root:

    python benchmarks/memory_llama.py                          # ~300 MB Llama, worlds 2,4, f32 and bf16
    python benchmarks/memory_llama.py --worlds 2 --variants fsdp2,shardwise --out llama_memory.jsonl

``memory.py`` measures a stack of Linears, whose activations are a few rows. A transformer holds
what a Linear stack does not: an embedding and an untied head over the vocabulary, the logits of
every token, attention and MLP intermediates per layer, RoPE tables. This benchmark measures the
same way as ``memory.py`` (read its docstring: a fresh gloo process pool per variant, or with
``--pools world`` one per world for the test suite's smoke run, glibc's thresholds fixed at 128 KiB
so RSS follows live memory, a warm-up run on a tiny model first, then VmHWM above the baseline, the
largest over ranks), on ``LlamaForCausalLM`` from transformers as it comes: built under
``torch.device("meta")``, AdamW (torch's defaults), a cross-entropy on the logits in float32,
``--steps`` steps of a global batch of ``--batch`` sequences of ``--seq`` tokens.

Variants:

* ``one_process`` (world 1): the whole model built and trained in one process with
  ``torch.optim.AdamW``.
* ``fsdp2``: ``fully_shard`` on every ``LlamaDecoderLayer`` and the root (torchtitan's and the
  FSDP2 docs' recipe), ``to_empty(device="cpu")``, the model's ``_init_weights`` and its RoPE
  table made again; ``torch.optim.AdamW``; each rank steps on its sequences of the batch.
* ``shardwise``: ``sw.functionalize(model, units=LlamaDecoderLayer, example_input=...)`` of the
  meta model, ``sw.shard_params(step, "dp", stage=3)``, ``step.init(params, mesh)`` (each rank
  makes only its shards), the in-place AdamW; the global batch on every rank.
* ``fsdp2_bf16``, ``shardwise_bf16``: the same under bf16 compute with float32 parameters and
  gradient reductions (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)``;
  ``sw.mixed_precision(step, "params=f32,compute=bf16,output=bf16,reduce=f32")``).

Exporting the trained weights for ``from_pretrained`` (``--variants`` with ``export_*``): each
rank's peak *during the export* (VmHWM above the resident size just before it, the model's
state already made; the state is ``step.init``'s / the initialized FSDP2 model, no step taken):

* ``export_save_pretrained``: ``sw.checkpoint.save_pretrained(step, state, directory)`` of the
  ZeRO-3 state: one decoder layer (or the embedding, or the head) gathered at a time, rank 0 writing.
* ``export_full_state_dict``: ``sw.checkpoint.full_state_dict(step, state)`` (every rank gathers the
  whole model) and ``safetensors.torch.save_file`` of it on rank 0.
* ``export_full_state_dict_rank0``: ``sw.checkpoint.full_state_dict(step, state, rank=0)`` (a layer
  gathered at a time, rank 0 keeping each) and ``save_file`` of it on rank 0.
* ``export_fsdp2``: torch's ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
  cpu_offload=True))`` (rank 0 holds the whole model) and ``save_file`` on rank 0.

Their rows carry ``export_peak_bytes`` (the largest over ranks), ``export_peak_bytes_per_rank`` and
``export_ratio_to_model`` (the largest over the parameters' float32 bytes) and ``export_ratio_to_fsdp2``.

Output: one JSON line per (world, variant) with ``peak_bytes`` (VmHWM above the baseline, the
largest over ranks), ``init_peak_bytes``, ``model_bytes`` (the parameters in float32),
``ratio_to_fsdp2`` (to FSDP2's row of the same precision and world) and, for shardwise, the
Plan's ``plan_peak_bytes`` and its figures for rank 0 (``plan``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import add_out_flag, environment, json_lines, note

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, PeakRSS

VARIANTS = ("fsdp2", "shardwise", "fsdp2_bf16", "shardwise_bf16")
EXPORT_VARIANTS = ("export_fsdp2", "export_save_pretrained", "export_full_state_dict",
                   "export_full_state_dict_rank0")  # FSDP2's first: the ratios
BF16_POLICY = "params=f32,compute=bf16,output=bf16,reduce=f32"  # as memory.py's bf16 rows


@dataclass(frozen=True)
class Config:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int
    steps: int
    world: int

    def llama(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
            max_position_embeddings=self.seq, tie_word_embeddings=False,
        )

    @property
    def model_bytes(self) -> int:
        h, i, kv = self.hidden, self.intermediate, self.hidden // self.heads * self.kv_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        return 4 * (2 * self.vocab * h + self.layers * per_layer + h)


TINY = Config(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=64, seq=8, batch=4, steps=1, world=1)


def meta_llama(cfg: Config) -> Any:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(cfg.llama())


def batch_of(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


def ce_f32(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy over every token, in float32 whatever the logits' dtype."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def fsdp2_model(cfg: Config, bf16: bool) -> Any:
    """The meta model, ``fully_shard`` per decoder layer and whole, materialized and initialized."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (cfg.world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    model = meta_llama(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    model.apply(model._init_weights)
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)  # to_empty left it uninitialized
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)
    return model


def fsdp2(cfg: Config, bf16: bool = False) -> dict[str, Any]:
    peak = PeakRSS()
    model = fsdp2_model(cfg, bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_peak = peak.peak()
    ids, labels = batch_of(cfg)
    rows, rank = cfg.batch // cfg.world, dist.get_rank() if cfg.world > 1 else 0
    ids, labels = ids[rank * rows : (rank + 1) * rows], labels[rank * rows : (rank + 1) * rows]
    for _ in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        ce_f32(model(ids), labels).backward()
        opt.step()
    return {"init_peak_bytes": init_peak, "peak_bytes": peak.peak()}


def one_process(cfg: Config) -> dict[str, Any]:
    peak = PeakRSS()
    model = meta_llama(cfg)
    model.to_empty(device="cpu")
    model.apply(model._init_weights)
    rotary = model.model.rotary_emb
    rotary.inv_freq.copy_(rotary.compute_default_rope_parameters(rotary.config)[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_peak = peak.peak()
    ids, labels = batch_of(cfg)
    for _ in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        ce_f32(model(ids), labels).backward()
        opt.step()
    return {"init_peak_bytes": init_peak, "peak_bytes": peak.peak()}


def shardwise_step(cfg: Config, bf16: bool) -> tuple[sw.Step, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    example = torch.zeros((1, cfg.seq), dtype=torch.long)  # the split is recorded on it
    chain, params = sw.functionalize(meta_llama(cfg), units=LlamaDecoderLayer, example_input=example)
    step = sw.shard_params(sw.train_step(chain, ce_f32, sw.optim.adamw(1e-3, inplace=True)), "dp", stage=3)
    return (sw.mixed_precision(step, BF16_POLICY) if bf16 else step), params


def shardwise(cfg: Config, bf16: bool = False) -> dict[str, Any]:
    peak = PeakRSS()
    step, params = shardwise_step(cfg, bf16)
    state = step.init(params, sw.Mesh(dp=cfg.world))
    del params
    gc.collect()
    init_peak = peak.peak()
    batch = batch_of(cfg)
    for _ in range(cfg.steps):
        state, _ = step(state, batch)
    return {"init_peak_bytes": init_peak, "peak_bytes": peak.peak()}


PROGRAMS = {
    "one_process": one_process,
    "fsdp2": fsdp2,
    "shardwise": shardwise,
    "fsdp2_bf16": lambda cfg: fsdp2(cfg, bf16=True),
    "shardwise_bf16": lambda cfg: shardwise(cfg, bf16=True),
}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def export_shardwise(cfg: Config, directory: str, whole: bool, to_rank0: bool = False) -> dict[str, Any]:
    """The ZeRO-3 state's weights to ``directory``: streamed (``save_pretrained``) or gathered whole
    (``full_state_dict``, on every rank or with ``to_rank0`` on rank 0 alone, then ``save_file`` on rank 0)."""
    from safetensors.torch import save_file

    step, params = shardwise_step(cfg, bf16=False)
    state = step.init(params, sw.Mesh(dp=cfg.world))
    del params
    gc.collect()
    peak = PeakRSS()
    if whole:
        weights = sw.checkpoint.full_state_dict(step, state, rank=0 if to_rank0 else None)
        if _rank() == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(directory, "model.safetensors"),
                      metadata={"format": "pt"})
        del weights
    else:
        sw.checkpoint.save_pretrained(step, state, directory)
    return {"export_peak_bytes": peak.peak()}


def export_fsdp2(cfg: Config, directory: str) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = fsdp2_model(cfg, bf16=False)
    gc.collect()
    peak = PeakRSS()
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    del weights
    dist.barrier()
    return {"export_peak_bytes": peak.peak()}


EXPORTS = {
    "export_save_pretrained": functools.partial(export_shardwise, whole=False),
    "export_full_state_dict": functools.partial(export_shardwise, whole=True),
    "export_full_state_dict_rank0": functools.partial(export_shardwise, whole=True, to_rank0=True),
    "export_fsdp2": export_fsdp2,
}


def warmed(variant: str, cfg: Config, directory: str | None = None) -> dict[str, Any]:
    """The variant after a run of it on a tiny Llama (imports and one-time setup are not the model's);
    what lives before the measured run is frozen out of the collector's reach (as memory.py)."""
    program = PROGRAMS[variant] if variant in PROGRAMS else functools.partial(EXPORTS[variant], directory=directory)
    gc.collect()
    gc.freeze()
    try:
        program(dataclasses.replace(TINY, world=cfg.world, batch=2 * cfg.world))
        gc.collect()
        gc.freeze()
        return program(cfg)
    finally:
        gc.unfreeze()


def measured(cfg: Config, variant: str, pool: ProcessPool | None = None) -> dict[str, Any]:
    """The variant on a fresh pool of ``cfg.world`` processes, or on ``pool`` where one is given: the
    largest peaks over ranks."""
    try:
        with (contextlib.nullcontext(pool) if pool else ProcessPool(cfg.world, timeout=3600)) as ranks, \
                tempfile.TemporaryDirectory() as directory:
            per_rank = ranks.run(warmed, variant, cfg, directory)
    except sw.collectives.RankFailed as exc:  # one variant failing must not lose the others' rows
        return {"failed": str(exc).splitlines()[0]}
    if variant in EXPORTS:
        peaks = [r["export_peak_bytes"] for r in per_rank]
        return {"export_peak_bytes": max(peaks), "export_peak_bytes_per_rank": peaks,
                "export_ratio_to_model": round(max(peaks) / cfg.model_bytes, 3)}
    return {
        "init_peak_bytes": max(r["init_peak_bytes"] for r in per_rank),
        "peak_bytes": max(r["peak_bytes"] for r in per_rank),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
    }


def plan_figures(cfg: Config, bf16: bool) -> dict[str, int]:
    """The Plan's memory figures for rank 0, made here on the meta parameters (no data)."""
    step, params = shardwise_step(cfg, bf16)
    plan = step.plan(sw.Mesh(dp=cfg.world), params, batch_of(cfg))
    return {key: int(per_rank[0]) for key, per_rank in plan.memory.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per variant (default 2)")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--variants", default=",".join(("one_process", *VARIANTS)),
                        help="comma-separated subset of one_process," + ",".join((*VARIANTS, *EXPORT_VARIANTS))
                        + " (default: one_process and the training variants)")
    parser.add_argument("--pools", choices=("variant", "world"), default="variant",
                        help="variant: a fresh pool of processes per variant, so that none inherits another's "
                             "memory; world: one pool per world for all its variants (a smoke run: start-up "
                             "costs less, the figures are not comparable) (default: variant)")
    add_out_flag(parser)
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(PROGRAMS) - set(EXPORTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join([*PROGRAMS, *EXPORTS])}")
    return args


def main() -> None:
    args = parse_args()
    os.environ.update(LIVE_MALLOC)  # the ranks start with it (glibc reads it at process start)
    shape = Config(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab, args.seq,
                   args.batch, args.steps, 1)
    stated = {"malloc": "128KiB thresholds", "pools": args.pools, "model": dataclasses.asdict(shape)}
    with json_lines(args.out) as emit:
        if "one_process" in args.variants:
            note("# world 1: one_process")
            emit({"bench": "memory_llama", "variant": "one_process", "world": 1, "model_bytes": shape.model_bytes,
                  **measured(shape, "one_process"), **environment(), **stated})
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = dataclasses.replace(shape, world=world)
            reference: dict[Any, int] = {}
            shared = ProcessPool(world, timeout=3600) if args.pools == "world" else None
            with shared or contextlib.nullcontext():
                for variant in (v for v in (*VARIANTS, *EXPORT_VARIANTS) if v in args.variants):
                    note(f"# world {world}: {variant}")
                    emit({**variant_row(cfg, variant, reference, shared), **environment(), **stated})


def variant_row(cfg: Config, variant: str, reference: dict[Any, int], pool: ProcessPool | None) -> dict[str, Any]:
    """The variant's row: its peaks, their ratios to FSDP2's rows of this world (``reference``, which an
    FSDP2 row fills in) and, for shardwise, the Plan's figures."""
    bf16 = variant.endswith("_bf16")
    row: dict[str, Any] = {"bench": "memory_llama", "variant": variant, "world": cfg.world,
                           "model_bytes": cfg.model_bytes, **measured(cfg, variant, pool)}
    if variant.startswith("fsdp2") and "peak_bytes" in row:
        reference[bf16] = row["peak_bytes"]
    if "peak_bytes" in row and bf16 in reference:
        row["ratio_to_fsdp2"] = round(row["peak_bytes"] / reference[bf16], 3)
    if variant == "export_fsdp2" and "export_peak_bytes" in row:
        reference["export"] = row["export_peak_bytes"]
    elif "export_peak_bytes" in row and "export" in reference:
        row["export_ratio_to_fsdp2"] = round(row["export_peak_bytes"] / reference["export"], 3)
    if variant.startswith("shardwise"):
        row["plan"] = plan_figures(cfg, bf16)
        row["plan_peak_bytes"] = row["plan"]["peak"]
    return row


if __name__ == "__main__":
    main()
