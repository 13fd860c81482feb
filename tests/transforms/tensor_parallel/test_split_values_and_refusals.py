"""Review of tensor_parallel (issue 17): the defects found, each a test of the behaviour the design
asks for.

Every case is a small float64 model on thread ranks. A test asserts the behaviour the
design asks for (the single-device step, or a refusal that names the place and the fix), so
it passes once the defect is fixed; the ``reason`` says what happens now.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT, mlp

F64_RTOL = 1e-12


def _one_step(step: sw.Step, params: Any, mesh: sw.Mesh, batch_of_rank: Any) -> list[Any]:
    """One step on every rank; ``batch_of_rank(rank)`` is the batch that rank passes."""

    def main() -> Any:
        state = step.init(params, mesh)
        state, metrics = step(state, batch_of_rank(mesh.rank))
        return metrics

    return sw.launch(main, mesh.size, timeout=120)


# -- a Region the layer never calls ---------------------------------------------------------------


class EmbedThenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids))


def test_a_region_no_layer_calls_is_refused_or_trains_right() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(EmbedThenMLP().double(), units=["emb", "mlp"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(16, (4, 3), generator=gen), torch.randn(4, 3, 8, dtype=torch.float64, generator=gen))] * 2
    plan: dict[str, Any] = {"emb": sw.tp.Rowwise(), "mlp": sw.tp.Region(),
                            "mlp.0": sw.tp.Colwise(), "mlp.2": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan)
    # Refused at the first step (where the layers run and the Region is seen not to), naming it.
    with pytest.raises(sw.collectives.RankFailed, match=r"inside Region 'mlp', which this layer never entered"):
        sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)
    with pytest.raises(ValueError, match=r"inside Region 'mlp'"):  # and by the Plan, made with a batch
        tp.plan(sw.Mesh(tp=2), params, batches[0])


# -- whether the logits leave split is read from registration order, not execution order ---------------


class HeadRegisteredFirst(nn.Module):
    """One layer (functionalize's default for a plain module); the head is registered before the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.mlp = nn.ModuleDict({"up": nn.Linear(8, 32), "down": nn.Linear(32, 8)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.mlp["down"](torch.tanh(self.mlp["up"](h)))
        return self.head(h)


def test_split_logits_from_a_head_registered_before_the_blocks() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(HeadRegisteredFirst().double())
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y), sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(16, (4, 6), generator=gen), torch.randint(8, (4, 6), generator=gen))] * 2
    plan: dict[str, Any] = {"emb": sw.tp.Rowwise(), "mlp.up": sw.tp.Colwise(),
                            "mlp.down": sw.tp.Rowwise(), "head": sw.tp.Colwise()}
    tp = sw.tensor_parallel(step, "tp", plan)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)


class DownRegisteredFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(32, 8)  # runs last
        self.up = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def test_a_rowwise_registered_before_its_colwise_is_not_taken_for_split_logits() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(DownRegisteredFirst().double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))]
    tp = sw.tensor_parallel(step, "tp", {"up": sw.tp.Colwise(), "down": sw.tp.Rowwise()})
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)


# -- the batch check ----------------------------------------------------------------------------------


def _swapped_rows_step(kind: str) -> tuple[sw.Step, sw.Mesh, Any, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=16, n_heads=2, n_layers=1, seq_len=256).double()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y), sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(64, (4, 256), generator=gen), torch.randint(64, (4, 256), generator=gen)

    def batch_of_rank(rank: int) -> Any:
        order = [0, 1, 2, 3] if rank == 0 else [2, 1, 0, 3]  # rank 1: the same rows, two of them swapped
        return ids[order], targets[order]

    if kind == "tp":
        return sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan()), sw.Mesh(tp=2), params, batch_of_rank
    return sw.shard_params(step, "dp", 1), sw.Mesh(dp=2), params, batch_of_rank


@pytest.mark.parametrize("kind", ["tp", "dp"])
def test_ranks_passing_rows_in_another_order_are_told(kind: str) -> None:
    step, mesh, params, batch_of_rank = _swapped_rows_step(kind)
    with pytest.raises(sw.collectives.RankFailed, match="different batches"):
        _one_step(step, params, mesh, batch_of_rank)


def _masked_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Missing targets (NaN) are skipped."""
    keep = ~y.isnan()
    return ((out - y.nan_to_num()) ** 2 * keep).sum() / keep.sum()


def test_a_batch_with_missing_targets_is_not_taken_for_different_batches() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 16, 8]).double())
    step = sw.train_step(chain, _masked_mse, sw.optim.sgd(0.1))
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    y[0, 3] = float("nan")
    tp = sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    got = _one_step(tp, params, sw.Mesh(tp=2), lambda rank: (x, y))
    _, want = step(step.init(params), (x, y))
    torch.testing.assert_close(got[0]["loss"], want["loss"], rtol=F64_RTOL, atol=0)


# -- the replica check's slack ------------------------------------------------------------------------


class SmallGain(nn.Module):
    """A replicated gain on each rank's slice of the features (no Region): its gradient is a part on each
    rank. A large replicated Linear before it carries most of the replicated gradients' magnitude."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(512, 512)
        self.up = nn.Linear(512, 16)
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.pre(x))) * (1 + 1e-4 * self.gain))


class SmallGainModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = SmallGain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_missed_sum_on_a_small_replicated_gradient_is_refused() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(SmallGainModel().double(), units=["block"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(64, 512, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64))
    tp = sw.tensor_parallel(step, "tp", {"block.up": sw.tp.Colwise(), "block.down": sw.tp.Rowwise()})
    with pytest.raises(sw.collectives.RankFailed, match="replicated parameters differ"):
        _one_step(tp, params, sw.Mesh(tp=2), lambda rank: batch)


# -- random streams between a Colwise that enters the region itself and its Rowwise -------------------


class Probe(nn.Module):
    """Dropout that records its mask, per thread (rank)."""

    masks: ClassVar[dict[int, list[torch.Tensor]]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(torch.ones_like(x), p=0.5, training=True)
        Probe.masks.setdefault(threading.get_ident(), []).append(mask.detach().clone())
        return x * mask


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), Probe(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_dropout_on_split_features_draws_a_mask_per_rank_without_a_region() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(DropoutMLP().double(), units=["mlp"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(64, 8, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64))
    tp = sw.tensor_parallel(step, "tp", {"mlp.0": sw.tp.Colwise(), "mlp.2": sw.tp.Rowwise()})
    Probe.masks.clear()
    _one_step(tp, params, sw.Mesh(tp=2), lambda rank: batch)
    first, second = (masks[0] for masks in Probe.masks.values())
    assert not torch.equal(first, second)


# -- unclear errors and silent acceptance of bad input --------------------------------------------------


def test_a_split_output_reaching_an_unstyled_module_is_named() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 32, 16, 8]).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises((ValueError, sw.collectives.RankFailed), match=r"tensor_parallel.*'2'"):
        tp = sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise()})
        _one_step(tp, params, sw.Mesh(tp=2), lambda rank: batch)


@pytest.mark.parametrize("bad", ["target", "input"])
def test_ids_outside_the_vocabulary_are_refused(bad: str) -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(
        TinyGPT(vocab=64, d_model=32, n_heads=4, n_layers=1, seq_len=8).double(), units=Block
    )
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y), sw.optim.sgd(0.1))
    ids = torch.randint(0, 64, (4, 8))
    wrong = ids.clone()
    wrong[0, 0] = 64
    batch = (ids, wrong) if bad == "target" else (wrong, ids)
    with pytest.raises(IndexError):
        step(step.init(params), batch)  # the reference refuses it
    with pytest.raises(sw.collectives.RankFailed):
        _one_step(sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan()), params, sw.Mesh(tp=2), lambda rank: batch)


def test_replicas_that_differ_by_rounding_pass_and_a_missed_sum_does_not() -> None:
    """Found by session 41's probing: a rank on another CPU kernel (no AVX-512) or thread count rounds its replicated
    gradients otherwise (4.7e-6 relative, float32), and the bitwise check refused a correct plan at its first step,
    advising a Region. Each bin of pieces may differ by 256 units of the gradients' rounding of its magnitude."""
    from shardwise.engine.run.step_end import REPLICA_BINS, REPLICA_ULPS, _within_rounding

    rtol = REPLICA_ULPS * torch.finfo(torch.float32).eps
    sums = torch.zeros(2, 2 * REPLICA_BINS, dtype=torch.float64)
    sums[:, 0], sums[:, REPLICA_BINS] = 0.5, 3.0  # a piece's sum and magnitude
    sums[:, 1], sums[:, REPLICA_BINS + 1] = 1e-4, 1e-4  # a small gain's, alone in its bin
    rounded = sums.clone()
    rounded[1, 0] += 4.7e-6 * 3.0
    assert _within_rounding(rounded, rtol)
    missed = sums.clone()
    missed[1, 1] = 0.5e-4  # half the small gain's gradient: a missed sum, tiny beside the other piece
    assert not _within_rounding(missed, rtol)
    overflowed = sums.clone()
    overflowed[1, 0] = float("nan")
    assert not _within_rounding(overflowed, rtol)
    assert not _within_rounding(rounded, 0.0)  # a tolerance of 0: bitwise only
    # each bin its own (the review, s41 review2: one bf16 piece loosened every float32 bin's check to 1e-2)
    per_bin = torch.full((REPLICA_BINS,), rtol, dtype=torch.float64)
    per_bin[2] = 1e-2  # a bf16 piece's bin
    assert not _within_rounding(missed, per_bin) and _within_rounding(rounded, per_bin)
