"""The loss probe under ``tokens=``: a ``loss_fn`` that does not return what its token mode asks is refused.

``tokens="sum"`` sums loss_fn's (summed loss, count) over the parts the step computes and divides the global
sum by the global count; ``tokens=count_fn`` multiplies loss_fn's mean by ``count_fn(inputs, targets)``,
sums, and divides by the global count. The probe did not run under ``tokens=`` at all, so a summed loss_fn
with a count function (0.49 off the single-device loss at step 1 under ZeRO-3 over dp=2 with padded labels)
or a mean returned with its count under ``tokens="sum"`` (1.0 off) trained another model without an error.
Now the step's first call checks, on the first rows and their halves (of one row, the row repeated twice),
that the sums and counts add up (``"sum"``) or that loss x count does (a count function), and refuses
naming the mode and what loss_fn returned. ``tokens="per_shard_mean"`` takes the parts' means knowingly:
not probed.

Token losses that keep the contract (cross-entropy with ``ignore_index`` and padded labels, a class-weighted
sum with its total weight, micro-batches of one row, context parallel) equal the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import shardwise as sw
from shardwise.collectives.launch import RankFailed
from shardwise.engine.run.loss_rows import Measured, measure
from shardwise.testing.models import TinyGPT

VOCAB, SEQ, ROWS = 16, 6, 8


def _gpt(loss: Any, tokens: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=8, n_heads=2, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9), tokens=tokens), params


def _padded(n: int = 2, rows: int = ROWS) -> list[tuple[Tensor, Tensor]]:
    """Batches whose rows each keep their own number of real labels (at least one), the rest -100."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(VOCAB, (rows, SEQ + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:].clone()
        for i in range(rows):
            y[i, int(torch.randint(1, SEQ, (1,), generator=gen)):] = -100
        out.append((x, y))
    return out


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[Any]:
    return sw.launch(lambda: step(step.init(params, mesh), batch)[1]["loss"], mesh.size, timeout=120)


def count_tokens(inputs: Tensor, targets: Tensor) -> Tensor:
    return (targets != -100).sum()


def _mean_ce(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _summed_ce(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def _sum_and_count(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return _summed_ce(logits, y), (y != -100).sum()


def _mean_and_count(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return _mean_ce(logits, y), (y != -100).sum()


def _sum_and_one(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return _summed_ce(logits, y), torch.tensor(1.0, dtype=torch.float64)


CUTS: dict[str, tuple[Any, sw.Mesh, int]] = {
    "zero-3 dp=2": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2), ROWS),
    "1f1b x 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2), ROWS),
    "zero-2 dp=2 x accumulation=4, one row": (lambda s: sw.shard_params(s, "dp", 2, accumulation=4),
                                              sw.Mesh(dp=2), ROWS),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_summed_loss_with_a_count_function_is_refused(cut: str) -> None:
    transform, mesh, rows = CUTS[cut]
    step, params = _gpt(_summed_ce, count_tokens)
    with pytest.raises(RankFailed, match=r"train_step\(tokens=count_tokens\) needs loss_fn to return the mean loss "
                       r"over the tokens count_tokens\(inputs, targets\) counts(.|\n)*loss_fn's values add up over the "
                       r"halves: a loss summed over the tokens(.|\n)*pass tokens='sum'"):
        _run(transform(step), mesh, params, _padded(1, rows)[0])


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_mean_returned_under_tokens_sum_is_refused(cut: str) -> None:
    transform, mesh, rows = CUTS[cut]
    step, params = _gpt(_mean_and_count, "sum")
    with pytest.raises(RankFailed, match=r"train_step\(tokens='sum'\) needs loss_fn to return \(the sum of the token "
                       r"losses, their count or total weight\)(.|\n)*loss_fn returns a mean, not the sum\?\)(.|\n)*"
                       r"pass tokens=count_fn"):
        _run(transform(step), mesh, params, _padded(1, rows)[0])


def test_a_count_that_does_not_add_up_under_tokens_sum_is_refused() -> None:
    step, params = _gpt(_sum_and_one, "sum")
    with pytest.raises(RankFailed, match=r"tokens='sum'(.|\n)*the count is not the sum of the halves' \(2\)"):
        _run(sw.shard_params(step, "dp", 3), sw.Mesh(dp=2), params, _padded(1)[0])


def test_a_count_function_counting_other_tokens_than_the_mean_is_refused() -> None:
    """loss_fn the mean over the real labels, count_fn counting every position: not loss x count."""
    step, params = _gpt(_mean_ce, lambda inputs, targets: targets.numel())
    with pytest.raises(RankFailed, match=r"tokens=count_fn\)(.|\n)*a mean over other tokens than those counted"):
        _run(sw.shard_params(step, "dp", 3), sw.Mesh(dp=2), params, _padded(1)[0])


KEPT = {
    "count function": (_mean_ce, count_tokens),
    "count function, label smoothing": (
        lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), ignore_index=-100, label_smoothing=0.1),
        count_tokens),
    "sum": (_sum_and_count, "sum"),
    "sum, class-weighted": (lambda o, y: (F.cross_entropy(o.flatten(0, 1), y.flatten(), weight=_WEIGHT,
                                                          reduction="sum"), _WEIGHT[y[y != -100]].sum()), "sum"),
}
_WEIGHT = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)


@pytest.mark.parametrize("kept", sorted(KEPT))
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_token_losses_that_keep_their_contract_equal_the_single_device_step(cut: str, kept: str) -> None:
    transform, mesh, rows = CUTS[cut]
    step, params = _gpt(*KEPT[kept])
    sw.testing.assert_equivalent(transform(step), step, mesh, _padded(2, rows), params)


def test_per_shard_mean_is_not_probed() -> None:
    """The mean of the parts' losses, taken knowingly: a summed loss there is the user's choice."""
    step, params = _gpt(_summed_ce, "per_shard_mean")
    assert all(torch.isfinite(loss) for loss in _run(sw.shard_params(step, "dp", 3), sw.Mesh(dp=2), params,
                                                       _padded(1)[0]))


def test_a_summed_loss_with_a_count_function_under_cp_is_refused() -> None:
    """Context parallel alone cuts no rows: the tokens' halves (and count_fn on them) show the sum."""
    step, params = _gpt(lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="sum"), count_tokens)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(VOCAB, (2, 9), generator=gen)
    with pytest.raises(RankFailed, match=r"tokens=count_tokens\)(.|\n)*first 4 tokens of the first 2 rows"):
        _run(sw.context_parallel(step, "cp"), sw.Mesh(cp=2), params, (ids[:, :-1], ids[:, 1:]))


# -- the probe itself -------------------------------------------------------------------------------------
def _measure(loss_fn: Any, tokens: Any, rows: int = 4) -> Any:
    logits, targets = _padded(1, rows)[0]
    logits = torch.randn(rows, SEQ, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return measure(loss_fn, logits, torch.zeros(rows, 1), targets, [], True, lambda _: None, tokens=tokens)


@pytest.mark.parametrize("rows", [4, 1])
def test_what_each_mode_measures(rows: int) -> None:
    found = _measure(_sum_and_count, "sum", rows)
    assert isinstance(found, Measured) and found.mode == "sum" and found.agrees and found.counts is not None
    assert found.counts[0] == found.counts[1] + found.counts[2]
    assert not _measure(_mean_and_count, "sum", rows).agrees
    found = _measure(_mean_ce, count_tokens, rows)
    assert isinstance(found, Measured) and found.mode == "count" and found.agrees
    found = _measure(_summed_ce, count_tokens, rows)
    assert isinstance(found, Measured) and not found.agrees and found.is_sum
    assert _measure(_mean_ce, "sum", rows) == "unknown"  # not a pair: the step's own call says what it must return


def test_a_part_without_counted_tokens_adds_nothing_and_none_at_all_says_nothing() -> None:
    logits = torch.randn(2, SEQ, VOCAB, dtype=torch.float64)
    targets = torch.full((2, SEQ), -100)
    targets[0, :3] = 1  # the second half (row) counts nothing: its mean is NaN, as the step's shard's
    found = measure(_mean_ce, logits, torch.zeros(2, 1), targets, [], True, lambda _: None, tokens=count_tokens)
    assert isinstance(found, Measured) and found.agrees and found.counts == (3.0, 3.0, 0.0)
    targets[0, :3] = -100
    assert measure(_mean_ce, logits, torch.zeros(2, 1), targets, [], True, lambda _: None,
                   tokens=count_tokens) == "retry"
