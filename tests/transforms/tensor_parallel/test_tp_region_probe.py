"""A Region's first call on each rank, judged by its values (region_probe.py): per-head values computed in
forward from the rank's head count through Python (ALiBi's ``get_slopes(n)``: math.log2 and a list over
range(n); ``1 / math.sqrt(n_head)``), which head_numbers.py's marks cannot follow, are refused naming the
Region; the exact forms (a PerHead table, the whole count kept at init, dropout inside the attention) train as
on one device. float64 and rtol 1e-9: tensor parallel only reorders sums."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.errors import RankFailed
from shardwise.collectives.launch import launch

D, H, SEQ, BATCH = 16, 4, 6, 2
PLAN: dict[str, Any] = {
    "*.attn": sw.tp.Region(heads=("n_head",)), "*.attn.q": sw.tp.Colwise(), "*.attn.k": sw.tp.Colwise(),
    "*.attn.v": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise(),
}


def get_slopes(n: int) -> list[float]:
    """The ALiBi paper's (and MPT's, Bloom's) slopes for ``n`` heads, a power of two."""
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]


class Attn(nn.Module):
    """Attention with an ALiBi-like per-head bias (or scale) computed as ``how`` says."""

    def __init__(self, how: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.how, self.n_head, self.total_heads = how, H, H  # total_heads: the whole count, kept (not divided)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("slopes", torch.tensor(get_slopes(H)))  # PerHead in the plan where "PerHead"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        h = q.size(1)
        slopes = torch.zeros(h, dtype=q.dtype)
        if self.how == "get_slopes(self.n_head)":
            slopes = torch.tensor(get_slopes(self.n_head), dtype=q.dtype)
        elif self.how == "get_slopes(q.size(1))":
            slopes = torch.tensor(get_slopes(h), dtype=q.dtype)
        elif self.how == "tensor(list(range(h)))":
            slopes = 2.0 ** -(torch.tensor(list(range(h)), dtype=q.dtype) + 1)
        elif self.how == "arange(h).tolist()":
            slopes = torch.tensor([2.0 ** -(i + 1) for i in torch.arange(h).tolist()], dtype=q.dtype)
        elif self.how == "q * (1.0 / h)":
            q = q * (1.0 / h)
        elif self.how == "q / math.sqrt(self.n_head)":
            q = q / math.sqrt(self.n_head)
        elif self.how == "get_slopes(self.n_head) cached on the module":
            if getattr(self, "cached", None) is None:
                self.cached = torch.tensor(get_slopes(self.n_head))  # the rank's count's, kept for later calls
            slopes = self.cached.to(q.dtype)
        elif self.how == "PerHead buffer":
            slopes = self.slopes.to(q.dtype)
        elif self.how == "whole count kept at init":
            q = q / math.sqrt(self.total_heads)
        pos = torch.arange(t, dtype=q.dtype)
        bias = slopes.view(1, -1, 1, 1) * (pos.view(1, 1, 1, t) - pos.view(1, 1, t, 1))
        if self.how in ACROSS:  # scores stacked back from a loop over the heads: a new tensor the per-head watch
            # does not follow (a batched product's it does), so the probe's third copy alone sees an op across them
            scores = torch.stack([q[:, i] @ k[:, i].transpose(-1, -2) for i in range(q.size(1))], 1)
        else:
            scores = q @ k.transpose(-1, -2)
        scores = scores / math.sqrt(q.size(-1)) + bias  # (batch, heads, t, t)
        if self.how in ("minus the mean over heads", "batched scores minus their mean over heads"):
            scores = scores - scores.mean(1, keepdim=True)
        elif self.how == "minus the max over heads":
            scores = scores - scores.amax(1, keepdim=True)
        elif self.how == "over the variance over heads":
            scores = scores / (1 + scores.var(1, keepdim=True, unbiased=False))
        probs = self.drop(scores.softmax(-1))
        return self.o((probs @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, how: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), Attn(how, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _problem(how: str, dropout: float = 0.0) -> tuple[sw.Step, Any, list[Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(how, dropout), Block(how, dropout)).double().train()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(BATCH, SEQ, D, dtype=torch.float64, generator=gen) for _ in range(2))
               for _ in range(2)]
    plan = {**PLAN, "*.attn.slopes": sw.tp.PerHead()} if how == "PerHead buffer" else PLAN
    return step, params, batches, plan


def _refusal_at_tp2(how: str) -> str:
    """The refusal (a ValueError on a rank) of the step at tp2 against one device."""
    step, params, batches, plan = _problem(how)
    tp = sw.tensor_parallel(step, "tp", plan)
    with pytest.raises(RankFailed) as info:
        sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)
    message = str(info.value.__cause__)
    assert isinstance(info.value.__cause__, ValueError), message
    return message


SILENT = ["get_slopes(self.n_head)", "get_slopes(self.n_head) cached on the module",
          "get_slopes(q.size(1))", "tensor(list(range(h)))", "arange(h).tolist()",
          "q * (1.0 / h)", "q / math.sqrt(self.n_head)"]


@pytest.mark.parametrize("how", SILENT)
def test_a_per_head_value_from_the_rank_count_through_python_is_refused_naming_the_region(how: str) -> None:
    message = _refusal_at_tp2(how)
    assert "Region '0.attn' (a Attn) computes other values on rank" in message
    assert "the input of Rowwise '0.attn.o' (its call 1)" in message
    assert "per-head value computed in forward from the rank's count" in message
    assert "sw.tp.PerHead()" in message


ACROSS = ["minus the mean over heads", "minus the max over heads", "over the variance over heads"]


@pytest.mark.parametrize("how", ACROSS)
def test_an_op_across_heads_that_tiled_weights_hide_is_refused(how: str) -> None:
    """A mean, max or (population) variance over the heads dim gives the same over this rank's heads tiled as
    over them alone: the whole copy with the other places' weights scaled shows it (silent before: the loss
    off by 1e-5 to 3e-3 at tp2)."""
    message = _refusal_at_tp2(how)
    assert "Region '0.attn' (a Attn) computes its heads' values on rank" in message
    assert "from the other heads' values too" in message
    assert "the input of Rowwise '0.attn.o' (its call 1)" in message
    assert "when only the OTHER heads' weights change" in message


def test_an_op_across_the_heads_of_a_batched_products_scores_is_refused_by_the_per_head_watch() -> None:
    """Scores of ``q @ k.transpose(-1, -2)`` hold the heads where q and k do (head_views.py follows a batched
    product), so a mean over them is refused where the module computes it, naming the op, before the probe."""
    message = _refusal_at_tp2("batched scores minus their mean over heads")
    assert "gives each rank whole heads, 1/tp of them (8 of 16 features here), and the module computes mean over " \
           "dim -3, which holds its heads of its per-head view: over this rank's heads alone" in message


@pytest.mark.parametrize("how", ["plain", "PerHead buffer", "whole count kept at init"])
def test_exact_per_head_values_train_as_on_one_device(how: str) -> None:
    step, params, batches, plan = _problem(how)
    tp = sw.tensor_parallel(step, "tp", plan)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


def test_dropout_inside_the_attention_in_training_mode_is_not_refused_and_the_probe_still_judges() -> None:
    """The probe's copies run in eval mode: dropout draws nothing there (the step's own draws are untouched:
    the loss differs from the same step without dropout), and a wrong per-head value beside it is refused."""
    losses = {}
    for p in (0.0, 0.5):
        step, params, batches, plan = _problem("plain", dropout=p)
        per_rank = launch(functools.partial(_losses, step, plan, params, batches), 2)
        assert per_rank[0] == per_rank[1]  # the loss is every rank's
        losses[p] = per_rank[0]
    assert losses[0.0] != losses[0.5]  # dropout drew in the step
    step, params, batches, plan = _problem("get_slopes(self.n_head)", dropout=0.5)
    with pytest.raises(RankFailed, match=r"Region '0\.attn' \(a Attn\) computes other values"):
        launch(functools.partial(_losses, step, plan, params, batches), 2)


def _losses(step: sw.Step, plan: dict[str, Any], params: Any, batches: list[Any]) -> list[float]:
    tp = sw.tensor_parallel(step, "tp", plan)
    return [float(metrics["loss"]) for metrics, _ in sw.testing.record_history(tp, tp.init(params, sw.Mesh(tp=2)),
                                                                                 batches)]


def _refusal_on_rank(how: str) -> str:
    """Each gloo rank's own refusal (caught on the rank, so each reports it rather than the first alone)."""
    step, params, batches, plan = _problem(how)
    tp = sw.tensor_parallel(step, "tp", plan)
    try:
        sw.testing.record_history(tp, tp.init(params, sw.Mesh(tp=2)), batches)
    except ValueError as err:
        return str(err)
    return "not refused"


@pytest.mark.gloo
@pytest.mark.parametrize("how", ["q / math.sqrt(self.n_head)", "tensor(list(range(h)))"])
def test_on_gloo_processes_every_rank_refuses_and_every_process_ends(gloo2: Any, how: str) -> None:
    """A table numbered from 0 on every rank gives rank 0 the whole's first heads: rank 0 refuses too (judging
    every place's heads), rather than going on to a collective rank 1 never reaches."""
    messages = gloo2.run(_refusal_on_rank, how)
    assert len(messages) == 2
    for rank, message in enumerate(messages):
        assert f"Region '0.attn' (a Attn) computes other values on rank {rank} of axis 'tp'" in message, message


def test_the_probe_copies_run_none_of_the_modules_forward_hooks() -> None:
    """A user's forward hooks on a Region's submodule see the step's calls only: the probe's copies (float64 runs,
    one at the whole shape) leave them out, so the first step calls them as the later steps do."""
    torch.manual_seed(0)
    model = nn.Sequential(Block("plain"), Block("plain")).double().train()
    seen: list[tuple[Any, ...]] = []
    model[0].attn.q.register_forward_pre_hook(lambda m, i: seen.append(("in", *i[0].shape)))
    model[0].attn.q.register_forward_hook(lambda m, i, o: seen.append(("out", *o.shape)))
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(BATCH, SEQ, D, dtype=torch.float64, generator=gen) for _ in range(2))
               for _ in range(2)]
    launch(functools.partial(_losses, step, PLAN, params, batches), 2)
    # two ranks, two steps, one call each: the split q's input (batch, seq, D) and output (batch, seq, D / 2)
    assert sorted(seen) == sorted([("in", BATCH, SEQ, D)] * 4 + [("out", BATCH, SEQ, D // 2)] * 4), seen


class PairedAttn(Attn):
    """Takes a second tensor of (batch * 2, seq) rows (a Bloom-like (batch * heads, ...) layout), which the
    probe's cut to the batch's first sample does not cut; it records the batch sizes its forward saw."""

    def forward(self, x: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        BATCHES.append(x.shape[0])
        if pairs is not None:
            x = x + pairs.view(x.shape[0], 2, x.shape[1]).sum(1).unsqueeze(-1) * 0.0
        return super().forward(x)


BATCHES: list[int] = []


class PairedBlock(nn.Module):
    def __init__(self, how: str, pairs: bool) -> None:
        super().__init__()
        self.norm, self.attn, self.pairs = nn.LayerNorm(D), PairedAttn(how), pairs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = torch.ones(x.shape[0] * 2, x.shape[1], dtype=x.dtype) if self.pairs else None
        return x + self.attn(self.norm(x), pairs=extra)


@pytest.mark.parametrize("pairs", [False, True], ids=["cut to one sample", "whole input after the cut failed"])
def test_the_probe_runs_on_one_sample_and_on_the_whole_input_where_the_cut_fails(pairs: bool) -> None:
    """The copies run on the batch's first sample (1/batch of the call's time and memory); an argument not cut
    with the batch makes that run fail, and the whole input is judged instead: refused either way."""
    torch.manual_seed(0)
    model = nn.Sequential(PairedBlock("get_slopes(self.n_head)", pairs)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(BATCH, SEQ, D, dtype=torch.float64), torch.randn(BATCH, SEQ, D, dtype=torch.float64))
    BATCHES.clear()
    plan = {"*.attn": sw.tp.Region(heads=("n_head",)), **{f"*.attn.{p}": sw.tp.Colwise() for p in "qkv"},
            "*.attn.o": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan)
    with pytest.raises(RankFailed, match=r"Region '0\.attn' \(a PairedAttn\) computes other values"):
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batch), 2)
    # Each rank's call on the batch; its three copies on one sample, or (the first copy failing on the pairs
    # there) the three on the whole batch.
    assert sorted(BATCHES) == ([1] * 2 + [BATCH] * (2 + 2 * 3) if pairs else [1] * 2 * 3 + [BATCH] * 2), BATCHES
