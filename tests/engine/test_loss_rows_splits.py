"""The loss probe under tensor, expert and context parallel: a loss that is not a mean over what the step cuts.

Under a split the probe did not run (its loss might communicate), so a summed loss trained silently wrong:
dp x tp and dp x ep with ``reduction="sum"`` took 1/dp of the single-device step's gradients, and context
parallel, which cuts each sequence into parts and takes the mean of the parts' losses, took 1/cp of a loss
summed over the tokens (or per sequence), even with no row cut. The probe now runs under splits, where no
collective may run (a split's loss functions compute on the rank's own part there: the vocabulary-parallel
cross-entropy on its slice), and under context parallel it also halves the tokens of the rank's part.

Mean losses (gathered or vocabulary-parallel cross-entropy, with label smoothing and a z-loss, MSE under
dp x ep, cross-entropy under cp and dp x cp) still equal the single-device step to float64 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.collectives.launch import RankFailed
from shardwise.engine.run.loss_rows import Measured, measure
from shardwise.testing.models import MoEBlock, TinyGPT

VOCAB, SEQ = 16, 16
ROWS_REFUSED = r"loss_fn is not a mean over the batch's rows, which a step that cuts the batch \({}\) needs"
TOKENS_REFUSED = (r"loss_fn is not a mean over the tokens of the batch's sequences, which a step that cuts each "
                  r"sequence \(context_parallel over axis 'cp' of size 2\) needs")


def _gpt(loss: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params


def _ids(n: int = 2, rows: int = 4) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))  # targets shifted on the whole sequence
    return out


def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _ce_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _per_sequence_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Each sequence's summed token losses, averaged over the rows: a mean over rows, a sum over tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape).sum(1).mean()


def _vocab_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(logits, targets, reduction="sum")


def _vocab_mean_z(logits: Tensor, targets: Tensor) -> Tensor:
    ce = sw.tp.vocab_parallel_cross_entropy(logits, targets, label_smoothing=0.1)
    return ce + 1e-2 * sw.tp.vocab_parallel_logsumexp(logits).pow(2).mean()


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[Any]:
    return sw.launch(lambda: step(step.init(params, mesh), batch)[1]["loss"], mesh.size, timeout=120)


def _dp_tp(step: sw.Step, vocab_parallel: bool) -> sw.Step:
    return sw.shard_params(sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(vocab_parallel=vocab_parallel)), "dp", 2)


@pytest.mark.parametrize(("loss", "vocab_parallel"), [(_ce_sum, False), (_vocab_sum, True)],
                         ids=["gathered logits", "vocab-parallel"])
def test_a_summed_loss_under_dp_x_tp_is_refused(loss: Any, vocab_parallel: bool) -> None:
    """The vocabulary-parallel cross-entropy on split logits computes on the rank's slice in the probe:
    how loss_fn reduces the rows shows all the same, and no collective runs."""
    step, params = _gpt(loss)
    with pytest.raises(RankFailed, match=ROWS_REFUSED.format("shard_params over axis 'dp' of size 2")
                       + r"(.|\n)*their sum"):
        _run(_dp_tp(step, vocab_parallel), sw.Mesh(dp=2, tp=2), params, _ids(1)[0])


@pytest.mark.parametrize(("loss", "vocab_parallel"), [(_ce_sum, False), (_vocab_sum, True)],
                         ids=["gathered logits", "vocab-parallel"])
def test_a_summed_loss_on_one_row_a_rank_under_dp_x_tp_is_refused(loss: Any, vocab_parallel: bool) -> None:
    """Under a split the rows are told without a fake run (dim 0): the row and the row repeated twice."""
    step, params = _gpt(loss)
    with pytest.raises(RankFailed, match=ROWS_REFUSED.format("shard_params over axis 'dp' of size 2")
                       + r"(.|\n)*On the one row(.|\n)*twice it"):
        _run(_dp_tp(step, vocab_parallel), sw.Mesh(dp=2, tp=2), params, _ids(1, rows=2)[0])
    step, params = _gpt(_ce if not vocab_parallel else _vocab_mean_z)
    sw.testing.assert_equivalent(_dp_tp(step, vocab_parallel), step, sw.Mesh(dp=2, tp=2), _ids(rows=2), params)


@pytest.mark.parametrize(("loss", "vocab_parallel"), [(_ce, False), (_vocab_mean_z, True)],
                         ids=["gathered logits", "vocab-parallel with smoothing and a z-loss"])
def test_mean_losses_under_dp_x_tp_equal_the_single_device_step(loss: Any, vocab_parallel: bool) -> None:
    """The probe's calls leave tensor parallel's record that the head left the logits split: the step's
    own call still computes the vocabulary-parallel loss."""
    step, params = _gpt(loss)
    sw.testing.assert_equivalent(_dp_tp(step, vocab_parallel), step, sw.Mesh(dp=2, tp=2), _ids(), params)


def _moe(loss: Any) -> tuple[sw.Step, Any, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), nn.Linear(8, 3)).double()
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return sw.train_step(chain, loss, sw.optim.sgd(0.01)), params, batches


def test_a_summed_loss_under_dp_x_ep_is_refused_and_the_mean_runs() -> None:
    step, params, batches = _moe(lambda o, y: F.mse_loss(o, y, reduction="sum"))
    composed = sw.shard_params(sw.expert_parallel(step, "ep"), "dp", 1)
    words = "shard_params over axis 'dp' of size 2 x expert_parallel over axis 'ep' of size 2"
    with pytest.raises(RankFailed, match=ROWS_REFUSED.format(words)):
        _run(composed, sw.Mesh(dp=2, ep=2), params, batches[0])
    step, params, batches = _moe(F.mse_loss)
    sw.testing.assert_equivalent(sw.shard_params(sw.expert_parallel(step, "ep"), "dp", 1), step,
                                 sw.Mesh(dp=2, ep=2), batches, params)


@pytest.mark.parametrize("loss", [_ce_sum, _per_sequence_sum], ids=["summed", "summed per sequence"])
def test_a_loss_summed_over_tokens_under_cp_is_refused(loss: Any) -> None:
    """Context parallel alone cuts no rows: the probe halves the tokens of the rank's part."""
    step, params = _gpt(loss)
    with pytest.raises(RankFailed, match=TOKENS_REFUSED + r"(.|\n)*their sum: a loss summed over the tokens"):
        _run(sw.context_parallel(step, "cp"), sw.Mesh(cp=2), params, _ids(1)[0])


def test_a_summed_loss_on_one_row_a_rank_under_dp_x_cp_is_refused_and_the_mean_runs() -> None:
    """One row a rank under dp x cp: the row repeated twice (its rows) and its tokens' halves are probed."""
    step, params = _gpt(_ce_sum)
    with pytest.raises(RankFailed, match=r"loss_fn is not a mean over the (batch's rows|tokens)(.|\n)*reduction='sum'"):
        _run(sw.shard_params(sw.context_parallel(step, "cp"), "dp", 1), sw.Mesh(dp=2, cp=2), params,
             _ids(1, rows=2)[0])
    step, params = _gpt(_ce)
    sw.testing.assert_equivalent(sw.shard_params(sw.context_parallel(step, "cp"), "dp", 1), step,
                                 sw.Mesh(dp=2, cp=2), _ids(rows=2), params)


def test_a_class_weighted_mean_under_dp_x_cp_is_refused() -> None:
    """Each part divides by its own tokens' weight: the halves of the tokens (or of the rows) differ."""
    w = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)
    step, params = _gpt(lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), weight=w))
    composed = sw.shard_params(sw.context_parallel(step, "cp"), "dp", 1)
    with pytest.raises(RankFailed, match=r"loss_fn is not a mean over the (batch's rows|tokens)"):
        _run(composed, sw.Mesh(dp=2, cp=2), params, _ids(1, rows=8)[0])


@pytest.mark.parametrize("mesh", [sw.Mesh(cp=2), sw.Mesh(dp=2, cp=2)], ids=["cp", "dp x cp"])
def test_mean_losses_under_cp_equal_the_single_device_step(mesh: sw.Mesh) -> None:
    step, params = _gpt(_ce)
    composed = sw.context_parallel(step, "cp")
    if "dp" in mesh.axis_names:
        composed = sw.shard_params(composed, "dp", 2)
    sw.testing.assert_equivalent(composed, step, mesh, _ids(rows=8), params)


def test_token_weighted_losses_under_cp_keep_their_contract_and_run() -> None:
    """tokens='sum': the step divides by the global count itself (a summed loss is what it asks for); the
    probe finds the sums and counts of the tokens' halves adding up (test_loss_rows_tokens.py)."""
    step, params = _gpt(lambda o, y: (_ce_sum(o, y), torch.tensor(y.numel(), dtype=torch.float64)))
    reference = sw.train_step(step.chain, _ce, sw.optim.sgd(0.1, momentum=0.9))
    summed = sw.train_step(step.chain, step.loss_fn, sw.optim.sgd(0.1, momentum=0.9), tokens="sum")
    sw.testing.assert_equivalent(sw.context_parallel(summed, "cp"), reference, sw.Mesh(cp=2), _ids(), params)


# -- the probe itself: the tokens' dim of the output ------------------------------------------------------
def _measure(loss_fn: Any, output: Any, targets: Any) -> Any:
    return measure(loss_fn, output, torch.zeros(targets.shape[0], 1), targets, [torch.default_generator], True,
                   lambda _: None, rows_cut=False, sequence_dim=1)


def test_the_tokens_are_halved_on_the_sequence_dim_only() -> None:
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 6, 5, generator=gen, dtype=torch.float64), torch.randint(5, (2, 6), generator=gen)
    found = _measure(_ce, logits, targets)
    assert isinstance(found, Measured) and found.along == "tokens" and found.agrees and found.tokens == 6
    found = _measure(_ce_sum, logits, targets)
    assert isinstance(found, Measured) and found.is_sum and not found.agrees
    # A feature dim of the tokens' count (a vocabulary, or a rank's slice of it): which dim holds the
    # tokens cannot be told, so nothing is cut (cutting the features would refuse this mean).
    square = torch.randn(2, 6, 6, generator=gen, dtype=torch.float64)
    assert _measure(lambda o, y: o.pow(2).sum(-1).mean(), square, targets) == "unknown"


class _HeadWithAux(nn.Module):
    """A head that returns (logits, a scalar aux term of its micro-batch) (found by this session's review)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.head(h), h.pow(2).mean()


def _gpt_with_aux(loss: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    model.head = _HeadWithAux(model.head)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params


@pytest.mark.parametrize("mesh", [sw.Mesh(cp=2), sw.Mesh(dp=2, cp=2)], ids=["cp", "dp x cp"])
def test_a_scalar_beside_the_logits_is_passed_whole_and_a_summed_loss_still_refused(mesh: sw.Mesh) -> None:
    """A 0-d aux term beside the logits made the rows' and the tokens' dims unknown under a split (no
    fake run there), so a summed cross-entropy plus the aux trained silently; the scalar goes whole to
    each half now, as the fake run decides under dp alone."""
    def wrap(step: sw.Step) -> sw.Step:
        cp = sw.context_parallel(step, "cp")
        return sw.shard_params(cp, "dp", 2) if "dp" in mesh.axis_names else cp

    step, params = _gpt_with_aux(lambda o, y: _ce_sum(o[0], y) + 0.01 * o[1])
    with pytest.raises(RankFailed, match=r"loss_fn is not a mean over the (batch's rows|tokens)"):
        _run(wrap(step), mesh, params, _ids(1, rows=8)[0])
    step, params = _gpt_with_aux(lambda o, y: _ce(o[0], y) + 0.01 * o[1])
    sw.testing.assert_equivalent(wrap(step), step, mesh, _ids(rows=8), params)
