"""sw.router_aux_loss under a token-weighted loss (``train_step(tokens=)``): fine-tuning a MoE on padded labels.

Padded labels (-100) on a batch the step cuts need a loss over counted tokens (a mean loss is refused
there), and router_aux_loss refused every token-weighted step, so MoE fine-tuning with the
load-balancing loss had no exact path. The step multiplies each share's loss by its token count and
divides by the global count; the aux loss is one term of the whole batch, added beside that, not
multiplied by any share's count. Labels padded unevenly over the ranks (one rank with none counted), in
float64: ZeRO-3, expert_parallel and both equal the single-device step (loss, and parameters after
AdamW steps), whose loss is HF's cross-entropy over the counted tokens plus coef x HF's aux loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

from .test_ep_step import _ledger, batches, moe_model

COEF = 0.5  # large, so that an aux loss weighed by the shares' counts would show


def _count(inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return (targets != -100).sum()


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _lm_sum(out: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum"), (targets != -100).sum()


def _padded_batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Two batches of 4 rows, right-padded (attention_mask 0, labels -100), the counted labels spread
    unevenly over 2 shares of 2 rows: in the first, the first two rows count no label at all."""
    gen = torch.Generator().manual_seed(1)
    data = []
    for b in range(2):
        ids = torch.randint(1, 32, (4, 9), generator=gen)
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[1, 5:] = mask[3, 2:] = 0
        labels = ids[:, 1:].clone()
        labels[mask == 0] = -100
        if b == 0:
            labels[:2] = -100  # prompt tokens only: no counted label in the first share
        else:
            labels[2, :4] = -100
        data.append(({"input_ids": ids[:, :-1], "attention_mask": mask}, labels))
    return data


def _model(family: str) -> tuple[Any, type]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=16,
                  attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0)
    if family == "Mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

        cfg = transformers.MixtralConfig(num_local_experts=4, router_jitter_noise=0.0, **common)
        return transformers.MixtralForCausalLM(cfg).double(), MixtralDecoderLayer
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    cfg = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                      norm_topk_prob=False, **common)
    return transformers.Qwen2MoeForCausalLM(cfg).double(), Qwen2MoeDecoderLayer


def _compose(step: sw.Step, stack: str) -> tuple[sw.Step, sw.Mesh]:
    if stack == "dp2 ZeRO-3":
        return sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    if stack == "ep2":
        return sw.expert_parallel(step, "ep"), sw.Mesh(ep=2)
    return sw.shard_params(sw.expert_parallel(step, "ep"), "dp", 3), sw.Mesh(dp=2, ep=2)


@pytest.mark.parametrize(("family", "stack"), [
    ("Mixtral", "dp2 ZeRO-3"), ("Mixtral", "ep2"), ("Mixtral", "dp2 x ep2, ZeRO-3"), ("Qwen2Moe", "dp2 x ep2, ZeRO-3"),
])
def test_padded_labels_with_a_count_function_and_the_aux_loss_equal_the_single_device_step(
    family: str, stack: str
) -> None:
    """It was refused at router_aux_loss(...), even for the single-device step."""
    model, unit = _model(family)
    data = _padded_batches()
    chain, params = sw.functionalize(model, units=unit, example_input=data[0][0])
    reference = sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.adamw(0.01), tokens=_count), COEF)
    _, metrics = reference(reference.init(params), data[1])
    with torch.no_grad():
        out = model(**data[1][0], output_router_logits=True)
    hf = float(_lm_loss(out, data[1][1]) + COEF * out.aux_loss)
    assert float(metrics["loss"]) == pytest.approx(hf, rel=1e-7)  # HF sums the aux loss in float32
    composed, mesh = _compose(reference, stack)
    sw.testing.assert_equivalent(composed, reference, mesh, data, params)


@pytest.mark.parametrize("stack", ["dp2 ZeRO-3", "ep2"])
def test_a_summed_loss_with_its_count_and_the_aux_loss_equal_the_single_device_step(stack: str) -> None:
    """tokens="sum": loss_fn returns (summed loss, count); the aux loss is added beside the sum."""
    model, unit = _model("Mixtral")
    data = _padded_batches()
    chain, params = sw.functionalize(model, units=unit, example_input=data[0][0])
    reference = sw.router_aux_loss(sw.train_step(chain, _lm_sum, sw.optim.adamw(0.01), tokens="sum"), COEF)
    counted = sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.adamw(0.01), tokens=_count), COEF)
    runs = []
    for step in (reference, counted):  # the same step, either mode
        state, losses = step.init(params), []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs.append((losses, state.params))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=1e-14)
    composed, mesh = _compose(reference, stack)
    sw.testing.assert_equivalent(composed, reference, mesh, data, params)


def test_under_micro_batches_each_micro_batchs_aux_loss_weighs_by_its_counted_tokens() -> None:
    """per_microbatch=True: each micro-batch's aux loss is over its own routing, and under token weighting
    it weighs as its tokens do: the step's loss is the micro-batches' single-device losses (cross-entropy
    plus aux), each times its count, over the step's count."""
    model, unit = _model("Mixtral")
    data = _padded_batches()
    chain, params = sw.functionalize(model, units=unit, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.adamw(0.01), tokens=_count)
    whole = sw.router_aux_loss(step, COEF)
    inputs, labels = data[1]
    halves = [({k: v[i:i + 2] for k, v in inputs.items()}, labels[i:i + 2]) for i in (0, 2)]
    counts = [float(_count(None, y)) for _, y in halves]
    assert counts[0] != counts[1]
    losses = [float(whole(whole.init(params), half)[1]["loss"]) for half in halves]
    expected = sum(c * loss for c, loss in zip(counts, losses, strict=True)) / sum(counts)
    accumulated = sw.shard_params(sw.router_aux_loss(step, COEF, per_microbatch=True), "dp", 3, accumulation=2)
    got = sw.launch(lambda: float(accumulated(accumulated.init(params, sw.Mesh(dp=1)), data[1])[1]["loss"]), world=1)
    assert got[0] == pytest.approx(expected, rel=1e-12)


def test_a_per_shard_mean_loss_and_a_mean_loss_keep_the_aux_loss_as_they_did() -> None:
    """The mean-loss modes are unchanged: tokens=None refuses -100 labels on a cut batch, naming tokens=."""
    model, unit = _model("Mixtral")
    data = _padded_batches()
    chain, params = sw.functionalize(model, units=unit, example_input=data[0][0])
    mean = sw.shard_params(sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1)), COEF), "dp", 3)
    with pytest.raises(sw.collectives.RankFailed, match=r"tokens=None.*negative integers(.|\n)*Pass tokens="):
        sw.launch(lambda: mean(mean.init(params, sw.Mesh(dp=2)), data[0]), world=2)
    unpadded = [(x, torch.where(y == -100, 1, y)) for x, y in data]
    per_share = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1), tokens="per_shard_mean")
    sw.testing.assert_equivalent(sw.shard_params(sw.router_aux_loss(per_share, COEF), "dp", 3),
                                 sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1)), COEF),
                                 sw.Mesh(dp=2), unpadded, params)


def test_a_summed_loss_that_is_not_a_pair_is_refused_naming_the_mode() -> None:
    model, unit = _model("Mixtral")
    data = _padded_batches()
    chain, params = sw.functionalize(model, units=unit, example_input=data[0][0])
    wrong = sw.router_aux_loss(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1), tokens="sum"), COEF)
    with pytest.raises(ValueError, match=r"tokens='sum'\): loss_fn must return a pair"):
        wrong(wrong.init(params), data[0])


def test_the_count_joins_the_routing_counts_sum_and_the_ledger_is_the_plan() -> None:
    """One value more in the same sum after the loss (the rank's token count): listed in the Plan."""
    step, params = moe_model()
    counted = sw.train_step(step.chain, _masked_mse, sw.optim.sgd(0.1), tokens=_rows_counted)
    composed = sw.shard_params(sw.expert_parallel(sw.router_aux_loss(counted, 0.1), "ep"), "dp", 3)
    mesh = sw.Mesh(dp=2, ep=2)
    x, y = batches(1)[0]
    batch = (x, y.masked_fill(torch.arange(8)[:, None, None] % 3 == 0, float("nan")))  # every third row padding
    plan = composed.plan(mesh, params, batch)
    sums = [(a.op, a.axis, a.wire[0].nbytes) for a in plan.actions[0] if a.label == "router aux counts"]
    assert sums == [("psum", "dp", 6 * 8), ("psum", "ep", 6 * 8)]  # 4 experts' counts, the rows, the tokens
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"
    sw.testing.assert_equivalent(composed, sw.router_aux_loss(counted, 0.1), mesh, [batch, batch], params)


def _rows_counted(inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return (~targets.isnan()).sum()


def _masked_mse(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    kept = ~targets.isnan()  # (no boolean indexing: the Plan runs the loss on fake tensors)
    return torch.where(kept, out - targets.nan_to_num(), 0).square().sum() / kept.sum()
