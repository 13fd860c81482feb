"""Activation bytes kept for backward: the plan's prediction (fake tensors) equals the measurement."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.plan.accounting import kept_for_backward, observing, predict_kept_for_backward
from shardwise.engine.run.executor import Executor
from shardwise.engine.torch_api import storage_key
from shardwise.testing.models import Block, TinyGPT, mlp
from shardwise.transforms.pipeline import simulate
from shardwise.transforms.tensor_parallel import TINY_GPT_BLOCKS


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1))
    batch = (torch.randint(64, (8, 16)), torch.randint(64, (8, 16)))
    return step, params, batch


def _saves_nothing_selectively(op: object, *args: object, **kwargs: object) -> bool:
    return False


VARIANTS = {
    "plain": lambda s: s,
    "full remat": lambda s: sw.remat(s),
    "dots": lambda s: sw.remat(s, policy=sw.policies.dots_saveable),
    # A selective policy asked op by op (what save_only_these_names("x") was on this model, which tags
    # nothing: a name no layer tags is refused now).
    "selective": lambda s: sw.remat(s, policy=_saves_nothing_selectively),
    "bf16": lambda s: sw.mixed_precision(s, "compute=bf16"),
    "bf16 + remat": lambda s: sw.remat(sw.mixed_precision(s, "compute=bf16")),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prediction_equals_measurement_per_layer(variant: str) -> None:
    step, params, batch = _gpt()
    chain = VARIANTS[variant](step).chain
    measured = kept_for_backward(chain, params, batch[0])
    assert predict_kept_for_backward(chain, params, batch[0]) == measured
    assert all(v > 0 for v in measured.values())


def test_step_plan_reports_what_saved_bytes_measures() -> None:
    step, params, batch = _gpt()
    for variant in (step, sw.remat(step)):
        plan = variant.plan(sw.Mesh(dp=1), params, batch)
        assert plan.memory["kept_for_backward"] == (sum(sw.policies.saved_bytes(variant, params, batch).values()),)
    full = step.plan(None, params, batch).memory["kept_for_backward"][0]
    remat = sw.remat(step).plan(None, params, batch).memory["kept_for_backward"][0]
    assert full >= 3 * remat


def test_sharded_plan_counts_one_micro_batch_of_one_rank() -> None:
    step, params, batch = _gpt()
    sharded = sw.shard_params(step, "dp", 3, accumulation=2)
    plan = sharded.plan(sw.Mesh(dp=2), params, batch)
    quarter = (batch[0][:2], batch[1][:2])
    assert plan.memory["kept_for_backward"] == (sum(sw.policies.saved_bytes(step, params, quarter).values()),) * 2


def test_pipeline_plan_is_peak_in_flight_times_stage_bytes() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 32, 32, 32, 4]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    for schedule in ("gpipe", "1f1b"):
        piped = sw.pipeline(step, "pp", schedule, 4, partition=[3, 4])
        mesh = sw.Mesh(pp=2)
        layout = piped.layout(mesh, params)
        per_layer = sw.policies.saved_bytes(step, params, (batch[0][:4], batch[1][:4]))
        stage = [sum(per_layer[n] for n in layers) for layers in layout.placement.stages]
        peaks = simulate(layout.schedule).peak_activations
        once = (batch[0].untyped_storage().nbytes(), 0)  # the first Linear keeps the whole batch
        expected = tuple(peaks[r] * (stage[r] - once[r]) + once[r] for r in range(2))
        assert piped.plan(mesh, params, batch).memory["kept_for_backward"] == expected
    gpipe = sw.pipeline(step, "pp", "gpipe", 4, partition=[3, 4]).plan(mesh, params, batch)
    one_f_one_b = sw.pipeline(step, "pp", "1f1b", 4, partition=[3, 4]).plan(mesh, params, batch)
    assert one_f_one_b.memory["kept_for_backward"][0] < gpipe.memory["kept_for_backward"][0]


def test_mixed_precision_counts_bf16_activations_not_weight_copies() -> None:
    """The compute copies are cast once per step and held anyway: only activations count, in bf16."""
    step, params, batch = _gpt()
    f32 = sw.policies.saved_bytes(sw.remat(step), params, batch)
    bf16 = sw.policies.saved_bytes(sw.remat(sw.mixed_precision(step, "compute=bf16")), params, batch)
    for layer in ("blocks.0", "blocks.1", "head"):  # each keeps only its (now bf16) input
        assert bf16[layer] * 2 == f32[layer]
    plan = sw.remat(sw.mixed_precision(step, "compute=bf16")).plan(None, params, batch)
    assert plan.memory["kept_for_backward"] == (sum(bf16.values()),)


def kept_in_run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> tuple[int, ...]:
    """Per rank, the bytes of every distinct storage autograd's saved-tensor hooks see
    during the forwards of one real step, less the stage's parameters and outputs (held anyway):
    with all forwards before any backward (gpipe), what the run keeps at its peak."""
    kept: dict[int, dict[int, int]] = {}
    forward = Executor._forward  # each forward, alone or in a run of joined ones

    def observed(self: Executor, action: Any) -> None:
        seen: dict[int, int] = {}
        with observing(lambda t: seen.__setitem__(storage_key(t), t.untyped_storage().nbytes())):
            forward(self, action)
        saved = self._saved[(action.stage, action.mb)]
        output = optree.tree_leaves(self._outputs[(action.stage, action.mb)])
        held = [*saved.params.values(), *(t for t in output if isinstance(t, torch.Tensor))]
        resident = {storage_key(t) for t in held}
        mine = kept.setdefault(self.mesh.rank, {})
        mine.update({key: n for key, n in seen.items() if key not in resident})

    def run() -> None:
        step(step.init(params, mesh), batch)

    Executor._forward = observed  # type: ignore[method-assign]
    try:
        sw.launch(run, mesh.size)
    finally:
        Executor._forward = forward  # type: ignore[method-assign]
    return tuple(sum(kept.get(i, {}).values()) for i in range(mesh.size))


def _mlp_step():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 16, 4]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    return step, params, (torch.randn(6, 8), torch.randn(6, 4))


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_the_first_stage_keeps_the_batch_once_however_many_micro_batches_view_it(
    microbatches: int,
) -> None:
    """Micro-batches are views of one batch: the first Linear keeps its storage (192 B) once."""
    step, params, batch = _mlp_step()
    piped = sw.pipeline(step, "pp", "gpipe", microbatches)
    mesh = sw.Mesh(pp=2)
    measured = kept_in_run(piped, mesh, params, batch)
    assert measured[0] == batch[0].untyped_storage().nbytes() == 192
    assert piped.plan(mesh, params, batch).memory["kept_for_backward"] == measured


def test_a_custom_schedule_counts_the_batch_once() -> None:
    """A schedule of one's own, all forwards first on pp 2: what each rank keeps, as the run."""
    step, params, batch = _mlp_step()
    schedule = sw.schedules.Schedule.parse("0F0 0F1 0F2 0B0 0B1 0B2\n1F0 1F1 1F2 1B0 1B1 1B2")
    piped = sw.pipeline(step, "pp", schedule, 3)
    mesh = sw.Mesh(pp=2)
    planned = piped.plan(mesh, params, batch).memory["kept_for_backward"]
    assert planned == kept_in_run(piped, mesh, params, batch)


@pytest.mark.parametrize("sequence_parallel", [None, TINY_GPT_BLOCKS])
def test_a_tensor_parallel_plan_keeps_what_the_run_keeps(sequence_parallel: str | None) -> None:
    """Under sequence parallel the norms' weights, replicated, take ``vary`` (identity forward):
    the run keeps the weight itself, held anyway, so it is no activation memory."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(64, (4, 8), generator=gen), torch.randint(64, (4, 8), generator=gen))
    tp = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel=sequence_parallel)
    mesh = sw.Mesh(tp=2)
    planned = tp.plan(mesh, params, batch).memory["kept_for_backward"]
    assert planned == kept_in_run(tp, mesh, params, batch)


def _llama():  # type: ignore[no-untyped-def]
    """A tiny HF Llama from a config (random init, float64): its layers pass the hidden state,
    RoPE's (cos, sin) and the mask on."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = T.LlamaForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(64, (4, 8), generator=gen), torch.randint(64, (4, 8), generator=gen))
    batches = [batch, batch]
    layer = T.models.llama.modeling_llama.LlamaDecoderLayer
    chain, params = sw.functionalize(model, units=layer, example_input=batches[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    return sw.train_step(chain, loss, sw.optim.sgd(0.1)), params, batches


def _ledgers(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[list[tuple[str, int]]]:
    def run() -> list[tuple[str, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    return sw.launch(run, mesh.size)


@pytest.mark.parametrize("partition", [(2, 2), (3, 1)])
def test_only_values_that_depend_on_parameters_get_gradients(partition: tuple[int, int]) -> None:
    """cos and sin come from buffers and ids: no gradient is made, kept for or sent back."""
    step, params, batches = _llama()
    piped = sw.pipeline(step, "pp", "gpipe", 2, partition=list(partition))
    mesh = sw.Mesh(pp=2)
    plan = piped.plan(mesh, params, batches[0])
    hidden = 2 * 8 * 32 * 8  # one micro-batch's hidden state, float64
    grads = [c.nbytes for c in plan.collectives(1) if c.op == "send"]
    assert grads == [hidden, hidden]  # one tensor per micro-batch: no cos, sin or mask
    for rank, got in enumerate(_ledgers(piped, mesh, params, batches[0])):
        assert got == [(c.op, c.nbytes) for c in plan.collectives(rank)]
    planned = plan.memory["kept_for_backward"]
    measured = kept_in_run(piped, mesh, params, batches[0])
    # At (2, 2) rank 1's layer passes cos and sin on to the head: the accounting leaves a layer's
    # outputs out (held by the executor), which inside a stage they are not; not this test's point.
    ranks = range(2) if partition == (3, 1) else range(1)
    assert [planned[r] for r in ranks] == [measured[r] for r in ranks]
    sw.testing.assert_equivalent(piped, step, mesh, batches, params, rtol=1e-12)
