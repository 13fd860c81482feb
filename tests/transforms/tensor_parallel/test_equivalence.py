"""tensor_parallel is the single-device step on the same batch, alone and composed.

float64 on the threads backend, 3 steps of SGD with momentum (and once AdamW),
relative agreement 1e-12 (parameters, loss and gradient norm, after every step,
on every rank; ``assert_equivalent`` judges each tensor against its layer's
scale). Tensor parallelism changes only the order of floating-point sums: a
split matmul's partial products are summed over the ranks, the vocabulary-
parallel loss sums its log-sum-exp over them. Each reordering perturbs a result
by a few ulps (~1e-16); measured here: at most 3e-16 relative with SGD, 5e-14
with AdamW (Adam divides by a small second moment, which magnifies the rounding
of near-zero gradients). Any real error (a sum missed or doubled, a slice of
the wrong heads, a replicated gradient counted N times in the norm) is of the
order of an update: far above 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT

F64_RTOL = 1e-12
SP = "sp"
NO_SP = "no-sp"


def _tp(problem: Any, sequence_parallel: bool, plan: dict[str, Any] | None = None, axis: str = "tp") -> sw.Step:
    return sw.tensor_parallel(
        problem.step, axis, problem.plan if plan is None else plan,
        sequence_parallel=problem.blocks if sequence_parallel else None,
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_colwise_rowwise_pairs(tp: int, build: dict[str, Callable]) -> None:
    problem = build["mlp"](clip_norm=0.5)
    step = sw.tensor_parallel(problem.step, "tp", problem.plan)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=tp), problem.batches, problem.params, rtol=F64_RTOL)


def test_mlp_with_a_gathered_column_parallel_layer(build: dict[str, Callable]) -> None:
    """A pair, then a Colwise whose output is gathered (every rank goes on with the whole of it)."""
    split = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise(), "4": sw.tp.Colwise(output="replicated")}
    problem = build["mlp"]((8, 16, 16, 8, 4), split)
    step = sw.tensor_parallel(problem.step, "tp", problem.plan)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=2), problem.batches, problem.params, rtol=F64_RTOL)


@pytest.mark.parametrize("vocab_parallel", [True, False], ids=["vocab-parallel", "logits-gathered"])
@pytest.mark.parametrize("sp", [SP, NO_SP])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["tiny_gpt", "llama", "gpt2"])
def test_transformers(family: str, tp: int, sp: str, vocab_parallel: bool, build: dict[str, Callable]) -> None:
    """TinyGPT (fused qkv Linear, tied head), HF Llama (GQA 8/4 heads) and HF GPT-2 (fused c_attn
    Conv1D, tied head), with each family's ready plan."""
    problem = build[family](vocab_parallel=vocab_parallel, clip_norm=1.0)
    step = _tp(problem, sp == SP)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=tp), problem.batches, problem.params, rtol=F64_RTOL)


def test_gathered_logits_take_any_loss(build: dict[str, Callable]) -> None:
    """With the head's output gathered, a plain F.cross_entropy (not the vocab-parallel one) is right."""
    problem = build["tiny_gpt"](vocab_parallel=False)

    def plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    reference = sw.train_step(problem.step.chain, plain, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=4), problem.batches, problem.params, rtol=F64_RTOL)


def test_adamw(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"](optimizer=lambda: sw.optim.adamw(1e-2, weight_decay=0.1), clip_norm=0.5)
    sw.testing.assert_equivalent(_tp(problem, True), problem.step, sw.Mesh(tp=4), problem.batches, problem.params,
                                 rtol=F64_RTOL)


# -- 2-D and 3-D --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["tp-then-zero", "zero-then-tp"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dp_x_tp(stage: int, order: str, build: dict[str, Callable]) -> None:
    """ZeRO over dp shards each rank's tensor-parallel slices; the batch splits over dp only."""
    problem = build["tiny_gpt"](clip_norm=0.5)
    if order == "tp-then-zero":
        step = sw.shard_params(_tp(problem, True), "dp", stage)
    else:
        zero = sw.shard_params(problem.step, "dp", stage)
        step = sw.tensor_parallel(zero, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(dp=2, tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


@pytest.mark.parametrize("mesh_shape", [{"tp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}],
                         ids=["tp2", "dp2xtp2", "pp2xtp2"])
@pytest.mark.parametrize("family", ["tiny_gpt_units", "llama"])
def test_sequence_parallel_ends_across_layers(family: str, mesh_shape: dict[str, int],
                                              build: dict[str, Callable]) -> None:
    """The embedding's lookups leave their layer unsummed and are reduce-scattered in the next (TinyGPT
    split as ``tok_emb | blocks | head``: the position embedding is added in the first block's layer, to
    the partial sums, once), and the last block's output leaves as a slice for the head's layer (the final
    norm on the slice); HF Llama's embed and head layers likewise; under dp (ZeRO-3) and across pipeline
    stages (a partial sum and a slice are what the stages exchange)."""
    problem = build["llama" if family == "llama" else "tiny_gpt"](clip_norm=1.0)
    reference, params = problem.step, problem.params
    if family != "llama":
        chain, params = sw.functionalize(problem.model, units=["tok_emb", "blocks", "head"])
        reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9), clip_norm=1.0)
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    if "dp" in mesh_shape:
        step = sw.shard_params(step, "dp", 3)
    if "pp" in mesh_shape:
        step = sw.pipeline(step, "pp", "1f1b", 2)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(**mesh_shape), problem.batches, params, rtol=F64_RTOL)


def test_dp_x_tp_with_accumulation(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"]()
    step = sw.shard_params(_tp(problem, True), "dp", 3, accumulation=2)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(dp=2, tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


def test_dp_x_tp_x_pp_world_8(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"](clip_norm=0.5)
    step = sw.shard_params(sw.pipeline(_tp(problem, True), "pp", "1f1b", 2), "dp", 3)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(dp=2, pp=2, tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_pp_x_tp(schedule: str, build: dict[str, Callable]) -> None:
    """Zero-bubble splits each backward into input and weight parts: their collectives differ."""
    problem = build["tiny_gpt"]()
    step = sw.pipeline(_tp(problem, True), "pp", schedule, 2)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(pp=2, tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


# -- mixed precision, remat, clipping -----------------------------------------------------------

ALL_F64 = "params=f64,compute=f64,output=f64"
COMPUTE_F32 = "params=f64,compute=f32,output=f64"


def test_mixed_precision_all_f64(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"]()
    step = sw.mixed_precision(sw.shard_params(_tp(problem, True), "dp", 2), ALL_F64)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(dp=2, tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


@pytest.mark.parametrize("order", ["tp-inside", "tp-outside"])
def test_mixed_precision_compute_f32(order: str, build: dict[str, Callable]) -> None:
    """Against the single-device step under the same policy. The layers compute in float32, so the
    reordered sums now round at float32's eps (6e-8): DEFAULT_RTOL[float32] = 1e-5, the project's
    float32 bound (measured: 1.5e-8). The tensor-parallel sums travel in the policy's reduce dtype
    (float64 here, the master dtype), the gathers in the compute dtype."""
    problem = build["tiny_gpt"]()
    reference = sw.mixed_precision(problem.step, COMPUTE_F32)
    if order == "tp-inside":
        step = sw.mixed_precision(_tp(problem, True), COMPUTE_F32)
    else:
        step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, problem.params,
                                 rtol=sw.testing.DEFAULT_RTOL[torch.float32])
    inside = [a for a in step.plan(sw.Mesh(tp=2), problem.params, problem.batches[0]).for_rank(0)
              if a.kind == "inside"]
    sums = {
        w.dtype
        for a in inside
        if a.op in ("psum", "psum_scatter") and a.label != "vocab_parallel_cross_entropy"
        for w in a.wire
    }
    gathers = {w.dtype for a in inside if a.op == "all_gather" and a.label != "vocab_parallel_cross_entropy"
               for w in a.wire}
    assert sums == {"float64"} and gathers == {"float32"}, (sums, gathers)


@pytest.mark.parametrize("sp", [SP, NO_SP])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "everything_saveable"])
def test_remat(policy: str, sp: str, build: dict[str, Callable]) -> None:
    """A recomputed forward issues its collectives again; the result is unchanged. A selective
    policy (dots_saveable) runs torch's selective-checkpoint mode around the layers' collectives."""
    problem = build["tiny_gpt"]()
    step = sw.remat(_tp(problem, sp == SP), getattr(sw.policies, policy))
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=4), problem.batches, problem.params, rtol=F64_RTOL)


@pytest.mark.parametrize("mesh_shape", [{"tp": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "pp": 2, "tp": 2}],
                         ids=["tp4", "dp2xtp2", "dp2xpp2xtp2"])
def test_clip_norm_counts_replicated_parameters_once(mesh_shape: dict[str, int], build: dict[str, Callable]) -> None:
    """The global norm over dp, tp and pp: every tp rank holds the replicated parameters (norms,
    biases of Rowwise layers, the position embedding) whole; counted N times they would raise the
    norm, change the clipping factor and so every update. The clip is active at every step."""
    clip = 0.05
    problem = build["tiny_gpt"](clip_norm=clip)
    state = problem.step.init(problem.params)
    for batch in problem.batches:  # the test can fail only if the clip acts
        state, metrics = problem.step(state, batch)
        assert float(metrics["grad_norm"]) > 2 * clip
    step = _tp(problem, True)
    if "pp" in mesh_shape:
        step = sw.pipeline(step, "pp", "1f1b", 2)
    if "dp" in mesh_shape:
        step = sw.shard_params(step, "dp", 2)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(**mesh_shape), problem.batches, problem.params,
                                 rtol=F64_RTOL)


# -- the state: full parameters and shard specs -------------------------------------------------


def test_full_params_and_leaf_specs(build: dict[str, Callable]) -> None:
    """``full_params`` joins the slices back exactly (bitwise at init, the reference's after a step);
    each LeafSpec says how tp cuts it, and each rank holds exactly its slice of every block."""
    problem = build["tiny_gpt"](steps=1)
    step = _tp(problem, True)
    mesh = sw.Mesh(tp=2)
    reference = problem.step(problem.step.init(problem.params), problem.batches[0])[0].params

    def run() -> tuple:
        state = step.init(problem.params, mesh)
        at_init = step.full_params(state)
        held = {layer: dict(tensors) for layer, tensors in state.params.items()}
        state, _ = step(state, problem.batches[0])
        return at_init, held, state.layout, step.full_params(state)

    results = sw.launch(run, 2)
    # Judged against each layer's scale, as assert_equivalent does (a zero-gradient bias moves by
    # rounding residue alone: see shardwise/testing/equivalence.py).
    sw.testing.compare_histories([[({}, after)] for *_, after in results], [({}, reference)], rtol=F64_RTOL)
    for rank, (at_init, held, layout, _) in enumerate(results):
        for layer, tensors in problem.params.items():
            for name, full in tensors.items():
                assert torch.equal(at_init[layer][name], full), (rank, layer, name)
        qkv = layout.leaves[("blocks.0", "blocks.0.attn.qkv.weight")]
        assert qkv.shape == (3 * 32, 32) and qkv.local_shape == (3 * 16, 32)
        assert qkv.split == sw.layout.TensorSplit("tp", 0, 2, 3)  # three fused blocks, each halved
        q, k, v = problem.params["blocks.0"]["blocks.0.attn.qkv.weight"].chunk(3)
        mine = slice(16 * rank, 16 * (rank + 1))
        assert torch.equal(held["blocks.0"]["blocks.0.attn.qkv.weight"], torch.cat([q[mine], k[mine], v[mine]]))
        assert layout.leaves[("blocks.0", "blocks.0.attn.proj.weight")].split == sw.layout.TensorSplit("tp", 1, 2)
        assert layout.leaves[("blocks.0", "blocks.0.mlp.0.bias")].split == sw.layout.TensorSplit("tp", 0, 2)
        # the vocabulary
        assert layout.leaves[("blocks.0", "tok_emb.weight")].split == sw.layout.TensorSplit("tp", 0, 2)
        for replicated in ("blocks.0.attn.proj.bias", "blocks.0.ln1.weight", "pos_emb"):
            spec = layout.leaves[("blocks.0", replicated)]
            assert spec.split is None and spec.local_shape == spec.shape
            assert torch.equal(held["blocks.0"][replicated], problem.params["blocks.0"][replicated])
        for (layer, name), spec in layout.leaves.items():
            assert tuple(held[layer][name].shape) == spec.local_shape


# -- an embedding split on its hidden dim ------------------------------------------------------


@pytest.mark.parametrize("style", [sw.tp.Colwise(), sw.tp.Colwise(output="replicated")], ids=["default", "replicated"])
def test_an_embedding_split_on_its_hidden_dim_is_gathered(style: sw.tp.Colwise, build: dict[str, Callable]) -> None:
    """Colwise on an Embedding cuts the hidden dim and gathers its output (by default too)."""
    problem = build["tiny_gpt"](tie=False)
    step = sw.tensor_parallel(problem.step, "tp", {"tok_emb": style, "head": sw.tp.Colwise()})
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=2), problem.batches, problem.params, rtol=F64_RTOL)


def _z_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """PaLM's z-loss beside label-smoothed cross-entropy, both computed on the split logits."""
    shifted, labels = logits[:, :-1], targets[:, :-1]  # a slice of the leading dims stays split
    ce = sw.tp.vocab_parallel_cross_entropy(shifted, labels, label_smoothing=0.1)
    return ce + 0.05 * sw.tp.vocab_parallel_logsumexp(logits).pow(2).mean()


@pytest.mark.parametrize("family", ["tiny_gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_z_loss_and_label_smoothing_on_split_logits_equal_one_device(
    family: str, tp: int, build: dict[str, Callable]
) -> None:
    problem = build[family]()
    if family == "llama":
        def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
            return _z_loss(out.logits, targets)
    else:
        loss = _z_loss
    reference = sw.train_step(problem.step.chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=tp), problem.batches, problem.params, rtol=F64_RTOL)


class _GluedGPT(TinyGPT):
    """TinyGPT with glue the region's ends must not take in reduced form: a norm of the embedding
    (not linear: its partial sums are summed first) and a flip of the sequence after the last block
    (not position by position: the slice is gathered first)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.emb_norm = torch.nn.LayerNorm(self.pos_emb.shape[-1]).double()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) * 2.0  # linear: stays a partial sum
        x = self.emb_norm(x) + self.pos_emb[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).flip(1).flip(1))


def test_sequence_parallel_ends_sum_or_gather_what_glue_needs_whole(build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"]()
    torch.manual_seed(0)
    model = _GluedGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block)
    reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)
    plan = step.plan(sw.Mesh(tp=2), params, problem.batches[0])
    inside = [str(a) for a in plan.for_rank(0) if a.kind == "inside"]
    assert inside[0] == "psum(blocks.0, axis=tp)", inside  # the embedding's partial sums, summed before the norm
    assert "all_gather(blocks.1, axis=tp)" in inside  # the last block's slice, gathered before the flip
    assert "psum(head, axis=tp)" in inside  # so the head's input gradient is all-reduced, as before


class _BufferGPT(TinyGPT):
    """TinyGPT whose glue makes replicated tensors from the embedding's partial sums by their metadata: a
    position buffer ``type_as`` the lookups and a padding mask ``expand_as`` them. Each is whole on every
    rank, not a partial sum (followed as one, the buffer was added twice and the mask summed to 2)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("pe", torch.randn(1, 8, self.pos_emb.shape[-1], dtype=torch.float64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        x = x * (idx != 0).to(x.dtype).unsqueeze(-1).expand_as(x) + self.pe[:, : x.size(1)].type_as(x)
        x = x + self.pos_emb[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_sequence_parallel_ends_keep_replicated_values_made_like_the_partial_sums_whole(
    build: dict[str, Callable],
) -> None:
    problem = build["tiny_gpt"]()
    torch.manual_seed(0)
    model = _BufferGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block)
    reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)


class _InPlaceGPT(TinyGPT):
    """TinyGPT whose glue changes the embedding's lookups in place by ops that are not linear in them (a
    clamp, a row set to a learned vector): the caller keeps using the lookups themselves, so they must be
    made whole in place (before, a summed copy took the op and the lookups went on as the partial sums)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        x.clamp_(-0.05, 0.05)
        x[:, 0] = self.pos_emb[0, 1]
        x = x + self.pos_emb[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_sequence_parallel_ends_make_the_partial_sums_whole_in_place_for_in_place_ops(
    build: dict[str, Callable],
) -> None:
    problem = build["tiny_gpt"]()
    torch.manual_seed(0)
    model = _InPlaceGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block, example_input=problem.batches[0][0])
    reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=4), problem.batches, params, rtol=F64_RTOL)


class _AfterBlocksGPT(TinyGPT):
    """TinyGPT with glue after the last block, which under sequence parallel runs on each rank's slice of
    the sequence: ``after(x)`` on the blocks' output."""

    def __init__(self, after: Callable[[torch.Tensor, TinyGPT], torch.Tensor], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.after = after

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[:, : idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(self.after(x, self)))


def _position_wise_in_place(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    x = x.clone()
    x.mul_(2.0)
    x[..., 0] = 1.0
    x.add_(model.pos_emb[0, 0])
    return x


def _cumsum_in_place(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    x.cumsum_(1)
    return x


def _set_the_last_position(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    x = x.clone()
    x[:, -1] = 0.0
    return x


def _table_at_its_length(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    return x + model.pos_emb[:, : x.size(1)]


def _table_at_its_shape(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    y = x * 2.0  # a position-wise op first: y is a slice of its own
    return y + model.pos_emb[0, torch.arange(x.shape[1])]


def _rows_by_its_numel(x: torch.Tensor, model: TinyGPT) -> torch.Tensor:
    rows = x.numel() // x.size(-1)
    return (x.reshape(rows, -1) + model.pos_emb[0, :1]).view(x.size(0), -1, x.size(-1)) + model.pos_emb[:, : x.size(-2)]


def _after_blocks(
    after: Callable[[torch.Tensor, TinyGPT], torch.Tensor], problem: Any, units: Any = Block
) -> tuple[sw.Step, Any, Any]:
    torch.manual_seed(0)
    model = _AfterBlocksGPT(after, vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=units, example_input=problem.batches[0][0])
    reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9))
    return reference, sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks), params


def test_sequence_parallel_in_place_ops_on_the_last_blocks_slice(build: dict[str, Callable]) -> None:
    """Position-wise in-place ops run on the slice; any other changed a gathered copy and dropped the change
    (the caller goes on with the slice itself), another model without an error: refused, naming the fix."""
    problem = build["tiny_gpt"]()
    reference, step, params = _after_blocks(_position_wise_in_place, problem)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)
    for after, what in [(_cumsum_in_place, "cumsum_ is not a position-wise op"),
                        (_set_the_last_position, "writes across positions")]:
        reference, step, params = _after_blocks(after, problem)
        sw.testing.assert_equivalent(reference, reference, sw.Mesh(tp=2), problem.batches[:1], params)
        message = f"in place, and .*{what}.*train silently wrong: write it out of place"
        with pytest.raises(ValueError, match=message):
            step.plan(sw.Mesh(tp=2), params, problem.batches[0])
        with pytest.raises(sw.collectives.RankFailed, match=message):
            sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize("after", [_table_at_its_length, _table_at_its_shape, _rows_by_its_numel])
def test_sequence_parallel_a_length_read_after_the_last_block(
    after: Callable[[torch.Tensor, TinyGPT], torch.Tensor], build: dict[str, Callable]
) -> None:
    """After the last block ``x.size(1)`` was this rank's slice's length, so ``pos_emb[:, :x.size(1)]`` took
    positions 0..T/N-1 on every rank, another model without an error (loss off by 3e-3 relative). A read of
    the slice's sequence length gathers it first: the code goes on with the whole sequence and its length."""
    problem = build["tiny_gpt"]()
    reference, step, params = _after_blocks(after, problem)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=4), problem.batches, params, rtol=F64_RTOL)
    inside = [str(a) for a in step.plan(sw.Mesh(tp=2), params, problem.batches[0]).for_rank(0) if a.kind == "inside"]
    assert "all_gather(blocks.1, axis=tp)" in inside, inside  # the slice, gathered at the length read
    # The head in a layer of its own: the last block's output crosses as a slice, read there.
    reference, step, params = _after_blocks(after, problem, units=["blocks", "head"])
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)


def test_a_vocabulary_split_scaled_word_embedding_keeps_its_scale() -> None:
    """HF Gemma's embedding is a GemmaTextScaledWordEmbedding (the lookup times sqrt(hidden)); the split
    lookup dropped the scale, another model without an error (loss off by 9e-4 relative). An Embedding
    subclass with any other forward of its own is refused under Rowwise. (Only the embedding is split:
    Gemma's RMSNorm computes in float32, so a sum in another order differs by float32 rounding.)"""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=16, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )
    model = transformers.GemmaForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(64, (4, 8), generator=gen), torch.randint(64, (4, 8), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=GemmaDecoderLayer, example_input=data[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)

    reference = sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", {"model.embed_tokens": sw.tp.Rowwise()})
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), data, params, rtol=F64_RTOL)

    class Shifted(torch.nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + 1.0

    other = torch.nn.Sequential(Shifted(64, 8), torch.nn.Linear(8, 4)).double()
    chain, params = sw.functionalize(other)
    plain = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    split = sw.tensor_parallel(plain, "tp", {"0": sw.tp.Rowwise()})
    batch = (torch.randint(64, (4, 3)), torch.randn(4, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Rowwise.*Shifted, whose forward overrides nn.Embedding's.*Colwise"):
        split.plan(sw.Mesh(tp=2), params, batch)


class _HeadsByCount(torch.nn.Module):
    """Attention as one writes it: q, k and v reshaped by the module's own head count."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _Holder(torch.nn.Module):
    """A module holding the attention: a Region on it finds the count one module down."""

    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


@pytest.mark.parametrize("heads", ["n_heads", "attn.n_heads"])
def test_a_region_divides_the_head_count_its_module_holds(heads: str) -> None:
    """Region(heads=('n_heads',)) checked that tp divides n_heads but left it whole: a forward reshaping
    by it made 4 heads of half the width on each rank at tp 2 (another attention), without an error.
    A count held by the module or a submodule is now divided while the Region runs."""
    torch.manual_seed(0)
    attn = _HeadsByCount(16, 4)
    middle = _Holder(attn) if heads == "attn.n_heads" else attn
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), middle, torch.nn.Linear(16, 4)).double()
    chain, params = sw.functionalize(net)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    inner = "1.attn" if heads == "attn.n_heads" else "1"
    plan: dict[str, Any] = {"1": sw.tp.Region(heads=(heads,)), f"{inner}.o": sw.tp.Rowwise(),
                            **{f"{inner}.{p}": sw.tp.Colwise() for p in "qkv"}}
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(4, 8, 4, generator=gen, dtype=torch.float64) for _ in range(2)) for _ in range(2)]
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params)
    assert report.steps == 2
    assert attn.n_heads == 4  # the model itself is untouched


class _PerHead(torch.nn.Module):
    """Separate q, k and v, cut into heads by their size (split(head_dim, -1)): a rank's slice is whole heads."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.stack(m(x).split(self.head_dim, -1), 1) for m in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(torch.cat(y.unbind(1), -1))


def test_regions_the_path_and_cut_checks_must_accept() -> None:
    """What the Region checks must not refuse (found by review): multi-query attention with its one key/value
    head replicated beside split queries (its paths meet the Rowwise sum, not a Colwise), and heads cut by
    their size from separate projections (a rank's slice is its whole heads)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
                                      attn_implementation="eager")
    chain, params = sw.functionalize(modeling_llama.LlamaForCausalLM(config).double(),
                                     units=modeling_llama.LlamaDecoderLayer)
    step = sw.train_step(chain, lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1, momentum=0.9))
    attn = "model.layers.*.self_attn"
    plan: dict[str, Any] = {attn: sw.tp.Region(heads=("config.num_attention_heads",), local=("num_key_value_groups",)),
                            f"{attn}.q_proj": sw.tp.Colwise(), f"{attn}.o_proj": sw.tp.Rowwise()}
    gen = torch.Generator().manual_seed(1)
    ids = [(torch.randint(64, (4, 8), generator=gen), torch.randint(64, (4, 8), generator=gen)) for _ in range(2)]
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), ids, params)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), _PerHead(16, 4), torch.nn.Linear(16, 4)).double()
    chain, params = sw.functionalize(net)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    plan = {"1": sw.tp.Region(), "1.o": sw.tp.Rowwise(), **{f"1.{p}": sw.tp.Colwise() for p in "qkv"}}
    batches = [tuple(torch.randn(4, 8, 4, generator=gen, dtype=torch.float64) for _ in range(2)) for _ in range(2)]
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params)
