"""Time-major batches into torch's sequence-first modules (``batch_first=False``) under a cut of the batch.

``nn.LSTM`` and ``nn.TransformerEncoderLayer`` read ``(seq, batch, ...)`` by default. Fed such batches, a
step that cuts the batch (data parallel, accumulation, a pipeline's micro-batches) cut dim 0, the sequence:
each part attended over (or ran its recurrence along) a slice of every sequence, and ZeRO-3 at dp=2 trained
with a first loss 1.3% (encoder) and 0.4% (LSTM) off the single-device step's, without an error. It is
refused now, naming the module; batch-first data (rows on dim 0, the module on batch_first=True or the
rows transposed to dim 1 before it) is cut as before and equals the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

SEQ, ROWS, WIDTH = 8, 4, 16


class Model(torch.nn.Module):
    """Linear, then a sequence-mixing module, then Linear: ``x [d0, d1, 6] -> [d0, d1, 3]``."""

    def __init__(self, kind: str, batch_first: bool = False, transpose: bool = False) -> None:
        super().__init__()
        self.kind, self.transpose = kind, transpose
        self.inp = torch.nn.Linear(6, WIDTH)
        if kind == "encoder":
            self.mix: torch.nn.Module = torch.nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0,
                                                                          batch_first=batch_first)
        elif kind == "attention":
            self.mix = torch.nn.MultiheadAttention(WIDTH, 2, batch_first=batch_first)
        else:
            self.mix = torch.nn.LSTM(WIDTH, WIDTH, batch_first=batch_first)
        self.out = torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.transpose:  # batch-first data, the rows moved to the module's batch dim (dim 1)
            h = h.transpose(0, 1)
        if self.kind == "attention":
            h = self.mix(h, h, h, need_weights=False)[0]
        elif self.kind == "lstm":
            h = self.mix(h)[0]
        else:
            h = self.mix(h)
        if self.transpose:
            h = h.transpose(0, 1)
        return self.out(h)


def _problem(model: Model, shape: tuple[int, int]) -> tuple[sw.Step, Any, list[Any]]:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(*shape, 6, generator=gen, dtype=torch.float64),
                torch.randn(*shape, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    chain, params = sw.functionalize(model.double(), example_input=batches[0][0])
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


CUTS = {
    "zero3 dp2": (lambda step: sw.shard_params(step, "dp", stage=3), sw.Mesh(dp=2)),
    "accumulation 2": (lambda step: sw.shard_params(step, "dp", stage=1, accumulation=2), sw.Mesh(dp=1)),
}


@pytest.mark.parametrize("kind", ["encoder", "lstm"])
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_time_major_batches_into_a_sequence_first_module_are_refused_under_a_cut(kind: str, cut: str) -> None:
    torch.manual_seed(0)
    step, params, batches = _problem(Model(kind), (SEQ, ROWS))
    wrap, mesh = CUTS[cut]
    with pytest.raises(sw.collectives.RankFailed, match=r"batch_first=False\) takes its sequence on dim 0") as err:
        sw.testing.assert_equivalent(wrap(step), step, mesh, batches, params)
    assert "batch_first=True" in str(err.value)


def test_a_pipeline_of_micro_batches_refuses_them_too_and_one_micro_batch_trains() -> None:
    torch.manual_seed(0)
    model = Model("lstm")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(SEQ, ROWS, 6, generator=gen, dtype=torch.float64),
                torch.randn(SEQ, ROWS, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    chain, params = sw.functionalize(model.double(), units=["inp", "mix", "out"], example_input=batches[0][0])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(sw.collectives.RankFailed, match=r"'mix' \(LSTM, batch_first=False\)"):
        sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 2), step, sw.Mesh(pp=2), batches, params)
    # one micro-batch: no cut, every stage sees whole sequences
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 1), step, sw.Mesh(pp=2), batches, params)


@pytest.mark.parametrize("model", [
    pytest.param(lambda: Model("encoder", batch_first=True), id="encoder batch_first=True"),
    pytest.param(lambda: Model("lstm", batch_first=True), id="lstm batch_first=True"),
    pytest.param(lambda: Model("attention", transpose=True), id="attention, rows transposed to dim 1"),
])
def test_batch_first_data_is_cut_as_before(model: Any) -> None:
    """Rows on dim 0 of the batch; the sizes make dim 0 and dim 1 of the module's input equal on a part
    (8 rows of 4 positions, halved)."""
    torch.manual_seed(0)
    step, params, batches = _problem(model(), (2 * ROWS, ROWS))
    for wrap, mesh in CUTS.values():
        sw.testing.assert_equivalent(wrap(step), step, mesh, batches, params)


@pytest.mark.parametrize("kind", ["encoder", "attention", "lstm"])
def test_the_check_reads_which_dim_follows_the_rows_not_the_sizes(kind: str) -> None:
    """Batch-first data transposed to (seq, batch) before a batch_first=False module is what that module
    wants, and is not found; time-major data is. Sizes equal on purpose (4 x 4)."""
    from shardwise.engine.model.sequence_first import rows_on_sequence_dim

    for transpose, found in ((True, []), (False, ["mix"])):
        torch.manual_seed(0)
        model = Model(kind, transpose=transpose).double()
        modules = [("mix", model.mix)]
        with torch.no_grad():
            got = rows_on_sequence_dim(modules, model, torch.randn(ROWS, ROWS, 6, dtype=torch.float64))
        assert [path for path, _, _ in got] == found
