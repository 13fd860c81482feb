"""A loss_fn that is not a mean over the batch's rows, under a step that cuts the batch: refused.

The step takes the mean of its parts' losses (data-parallel shares, accumulation or pipeline micro-batches),
the single-device step's loss only for a mean of per-row terms. A sum (``reduction="sum"``: the loss and the
gradients shrink by the number of parts), an in-batch contrastive loss (each part contrasts its own rows) or
a class-weighted mean train another model without an error; the step's first call probes ``loss_fn`` on the
first rows of its first micro-batch's output and on their halves (engine/run/loss_rows.py) and refuses.

Mean losses (MSE, L1, Huber, cross-entropy over ``[B, T, V]`` logits, label smoothing, KL with
``batchmean``, a Hugging Face GPT-2's logits), a model's own loss and the stacks that cut no rows run as
before: equal to the single-device step to float64 rounding (assert_equivalent's default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.collectives.launch import RankFailed
from shardwise.engine.run.loss_rows import (
    RTOL,
    RTOL_FLOAT32,
    RTOL_FLOAT64,
    LossProbe,
    Measured,
    OwnLoss,
    ProbeCut,
    measure,
)
from shardwise.testing.models import TinyGPT, mlp

ROWS = 8
CUTS: dict[str, tuple[Any, sw.Mesh, str]] = {
    "zero-2 dp=2": (lambda s: sw.shard_params(s, "dp", 2), sw.Mesh(dp=2), r"shard_params over axis 'dp' of size 2"),
    "accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2), sw.Mesh(dp=1), r"2 micro-batches"),
    "gpipe x 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "gpipe", 2), sw.Mesh(pp=2), r"2 micro-batches"),
}


def _mlp() -> tuple[sw.Chain, Any]:
    torch.manual_seed(0)
    return sw.functionalize(mlp([6, 16, 4]).double())


def _batches(n: int = 2, classes: bool = False) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(ROWS, 6, dtype=torch.float64, generator=gen)
        y = torch.randint(4, (ROWS,), generator=gen) if classes else torch.randn(ROWS, 4, dtype=torch.float64,
                                                                                   generator=gen)
        out.append((x, y))
    return out


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[Any]:
    def main() -> Any:
        return step(step.init(params, mesh), batch)[1]["loss"]

    return sw.launch(main, mesh.size, timeout=120)


def _sum_mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y, reduction="sum")


def _in_batch_contrastive(out: Tensor, y: Tensor) -> Tensor:
    """InfoNCE with in-batch negatives (SimCLR / CLIP): each row's positive is its own target row."""
    logits = F.normalize(out, dim=-1) @ F.normalize(y, dim=-1).T / 0.1
    return F.cross_entropy(logits, torch.arange(out.shape[0]))


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_summed_loss_is_refused_naming_the_mean(cut: str) -> None:
    chain, params = _mlp()
    transform, mesh, words = CUTS[cut]
    step = transform(sw.train_step(chain, _sum_mse, sw.optim.sgd(0.01, momentum=0.9)))
    with pytest.raises(RankFailed, match=rf"loss_fn is not a mean over the batch's rows, which a step that cuts the "
                       rf"batch \({words}\) needs(.|\n)*their sum: a loss summed over the rows(.|\n)*reduction='mean'"):
        _run(step, mesh, params, _batches(1)[0])


def _summed_zero3_step() -> Any:
    """A rank process's step: ZeRO-3 over dp=2 with a summed loss."""
    chain, params = _mlp()
    step = sw.shard_params(sw.train_step(chain, _sum_mse, sw.optim.sgd(0.01)), "dp", 3)
    return step(step.init(params, sw.Mesh(dp=2)), _batches(1)[0])[1]["loss"]


@pytest.mark.gloo
def test_a_summed_loss_is_refused_on_gloo_processes_without_a_hang() -> None:
    with pytest.raises(RankFailed, match="loss_fn is not a mean over the batch's rows"):
        sw.launch(_summed_zero3_step, 2, backend="processes", timeout=120)


def test_an_in_batch_contrastive_loss_is_refused_naming_per_shard_mean() -> None:
    chain, params = _mlp()
    step = sw.shard_params(sw.train_step(chain, _in_batch_contrastive, sw.optim.sgd(0.01)), "dp", 1)
    with pytest.raises(RankFailed, match=r"in-batch negatives(.|\n)*tokens='per_shard_mean'"):
        _run(step, sw.Mesh(dp=2), params, _batches(1)[0])
    # The opt-out: the mean of the shares' contrastive losses, as DDP computes it.
    opted = sw.train_step(chain, _in_batch_contrastive, sw.optim.sgd(0.01), tokens="per_shard_mean")
    x, y = batch = _batches(1)[0]
    by_hand = sum(_in_batch_contrastive(chain(params, a), b) for a, b in zip(x.chunk(2), y.chunk(2), strict=True)) / 2
    for loss in _run(sw.shard_params(opted, "dp", 1), sw.Mesh(dp=2), params, batch):
        torch.testing.assert_close(loss, by_hand.detach(), rtol=1e-12, atol=0)


def _dpo_concatenated(out: Tensor, reference: Tensor) -> Tensor:
    """TRL's DPO layout: rows [:n] the chosen answers, [n:] the rejected ones, row i paired with row i + n."""
    n = out.shape[0] // 2
    margin = out[:, 0] - reference[:, 0]
    return -F.logsigmoid(0.5 * (margin[:n] - margin[n:])).mean()


def test_a_loss_not_finite_on_the_probes_halves_is_refused() -> None:
    """The review (s39 loss F11): on 2-row shares (dp4 of 8 rows, a pipeline's 4 micro-batches: one DPO pair per
    part) the probe's 1-row halves give NaN (a mean over an empty pairing), which it took for 'says nothing' and probed
    again on every later call: the step trained each part's own pairing (0.43 off the one-device loss), no error."""
    chain, params = _mlp()
    step = sw.train_step(chain, _dpo_concatenated, sw.optim.sgd(0.1))
    batch = _batches(1)[0]
    assert ROWS == 8
    for cut, mesh in ((sw.shard_params(step, "dp", 1), sw.Mesh(dp=4)), (sw.pipeline(step, "pp", "1f1b", 4),
                                                                           sw.Mesh(pp=2))):
        with pytest.raises(RankFailed, match=r"loss_fn is not a mean over the batch's rows.*first 2 rows .* and "
                                             r"nan and nan on their two halves.*not finite on a part where it is on "
                                             r"the whole"):
            _run(cut, mesh, params, batch)


class _Towers(nn.Module):
    """Two towers and their rows x rows similarity matrix, as CLIPModel's ``logits_per_text``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        za, zb = F.normalize(self.a(x), dim=-1), F.normalize(self.b(x), dim=-1)
        return {"embeds": za, "logits": za @ zb.T / 0.1}


def test_a_contrastive_loss_on_a_rows_by_rows_output_is_refused() -> None:
    """Both dims of the similarity matrix hold the rows: the chain's output on half the rows (fake tensors)
    says so, and the probe takes the halves' diagonal blocks, which the shares would compute."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(_Towers().double())

    def clip_loss(out: dict[str, Tensor], _: Tensor) -> Tensor:
        labels = torch.arange(out["logits"].shape[0])
        return (F.cross_entropy(out["logits"], labels) + F.cross_entropy(out["logits"].T, labels)) / 2

    step = sw.shard_params(sw.train_step(chain, clip_loss, sw.optim.sgd(0.01)), "dp", 3)
    with pytest.raises(RankFailed, match="loss_fn is not a mean over the batch's rows"):
        _run(step, sw.Mesh(dp=2), params, _batches(1)[0])


def test_a_class_weighted_mean_is_refused_and_tokens_sum_computes_it() -> None:
    """cross_entropy(weight=w) divides by the rows' total weight: each share by its own (DDP's mean of the
    shares' means), not the batch's. tokens='sum' with (the weighted sum, the total weight) is exact."""
    chain, params = _mlp()
    w = torch.tensor([1.0, 4.0, 0.5, 2.0], dtype=torch.float64)
    x, _ = _batches(1)[0]
    batch = (x, torch.tensor([0, 1, 2, 3, 1, 1, 0, 2]))

    def weighted(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y, weight=w)

    step = sw.shard_params(sw.train_step(chain, weighted, sw.optim.sgd(0.1)), "dp", 2)
    with pytest.raises(RankFailed, match=r"a weighted mean \(cross_entropy\(weight=...\)"):
        _run(step, sw.Mesh(dp=2), params, batch)
    summed = sw.train_step(chain, lambda o, y: (F.cross_entropy(o, y, weight=w, reduction="sum"), w[y].sum()),
                           sw.optim.sgd(0.1), tokens="sum")
    reference = sw.train_step(chain, weighted, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.shard_params(summed, "dp", 2), reference, sw.Mesh(dp=2), [batch, batch], params)


MEAN_LOSSES = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "huber": F.huber_loss,
    "kl batchmean": lambda o, y: F.kl_div(F.log_softmax(o, -1), F.softmax(y, -1), reduction="batchmean"),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("loss", sorted(MEAN_LOSSES))
def test_mean_losses_run_and_equal_the_single_device_step(cut: str, loss: str) -> None:
    chain, params = _mlp()
    transform, mesh, _ = CUTS[cut]
    step = sw.train_step(chain, MEAN_LOSSES[loss], sw.optim.sgd(0.01, momentum=0.9))
    sw.testing.assert_equivalent(transform(step), step, mesh, _batches(), params)


class _Prototypes(nn.Module):
    """Features of the rows, and a table of 4 class prototypes returned beside them (not per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.proto = nn.Linear(6, 5), nn.Parameter(torch.randn(4, 5))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.enc(x), self.proto * 1.0


def _prototype_loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
    features, prototypes = out
    return F.cross_entropy(features @ prototypes.T, y)  # a mean over the rows of a per-row term


@pytest.mark.parametrize("cut", ["zero-2 dp=2", "accumulation=2"])  # 4 rows a part: the prototypes' count
def test_an_output_whose_dim_0_merely_equals_the_rows_is_not_cut(cut: str) -> None:
    """The prototypes' dim 0 equals a part's rows here, but does not follow them: each half's loss gets
    the whole table. Cutting every tensor whose dim 0 equalled the rows refused this mean (review)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Prototypes()).double())
    transform, mesh, _ = CUTS[cut]
    step = sw.train_step(chain, _prototype_loss, sw.optim.sgd(0.1))
    # Classes 0 and 1 only: a cut table of 2 prototypes still takes them (a loss that fails is not probed).
    batches = [(x, torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])) for x, _ in _batches()]
    sw.testing.assert_equivalent(transform(step), step, mesh, batches, params)


@pytest.mark.parametrize("seq", [6, 4])  # 4: a sequence as long as a share's rows (the output's shape is ambiguous)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_over_sequences_runs_under_zero_and_a_pipeline(seq: int, smoothing: float) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d_model=8, n_heads=2, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def lm(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing)

    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(16, (ROWS, seq), generator=gen), torch.randint(16, (ROWS, seq), generator=gen))
               for _ in range(2)]
    step = sw.train_step(chain, lm, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 2), step, sw.Mesh(pp=2), batches, params)


def test_hugging_face_gpt2_logits_and_own_loss_run() -> None:
    T = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = T.GPT2LMHeadModel(cfg).double()
    ids = torch.zeros(ROWS, 6, dtype=torch.long)
    chain, params = sw.functionalize(model, units=T.models.gpt2.modeling_gpt2.GPT2Block, example_input=ids)
    gen = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(32, (ROWS, 6), generator=gen), torch.randint(32, (ROWS, 6), generator=gen))
             for _ in range(2)]

    def lm(out: Any, targets: Tensor) -> Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    step = sw.train_step(chain, lm, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 2), step, sw.Mesh(dp=2), pairs, params)
    dicts = [{"input_ids": i, "labels": i} for i, _ in pairs]  # the model's own loss: not probed (a scalar)
    chain, params = sw.functionalize(model, units=T.models.gpt2.modeling_gpt2.GPT2Block, example_input=dicts[0])
    own = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1, momentum=0.9))
    # (transformers computes its own loss on logits.float(): float32 rounding in the loss)
    sw.testing.assert_equivalent(sw.pipeline(own, "pp", "gpipe", 2), own, sw.Mesh(pp=2), dicts, params, rtol=1e-6)


def test_a_bf16_mean_loss_runs_under_mixed_precision() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 4]))
    step = sw.mixed_precision(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.01)), "params=f32,compute=bf16")
    batch = tuple(t.float() for t in _batches(1)[0])
    losses = _run(sw.shard_params(step, "dp", 2), sw.Mesh(dp=2), params, batch)
    assert all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("stack", ["one device", "dp=1", "pipeline of one micro-batch"])
def test_a_summed_loss_runs_where_the_batch_is_not_cut(stack: str) -> None:
    chain, params = _mlp()
    step = sw.train_step(chain, _sum_mse, sw.optim.sgd(0.01, momentum=0.9))
    if stack == "one device":
        state = step.init(params)
        for batch in _batches():
            state, _ = step(state, batch)
        return
    transform, mesh = {
        "dp=1": (lambda s: sw.shard_params(s, "dp", 2), sw.Mesh(dp=1)),
        "pipeline of one micro-batch": (lambda s: sw.pipeline(s, "pp", "gpipe", 1), sw.Mesh(pp=2)),
    }[stack]
    sw.testing.assert_equivalent(transform(step), step, mesh, _batches(), params)


def _loss_calls(accumulation: int, steps: int) -> list[list[int]]:
    """The rows of every loss_fn call in each of ``steps`` steps of ``accumulation`` micro-batches."""
    chain, params = _mlp()
    calls: list[int] = []

    def counted(out: Tensor, y: Tensor) -> Tensor:
        calls.append(out.shape[0])
        return F.mse_loss(out, y)

    step = sw.shard_params(sw.train_step(chain, counted, sw.optim.sgd(0.01)), "dp", 1, accumulation=accumulation)

    def main() -> list[list[int]]:
        state, seen = step.init(params, sw.Mesh(dp=1)), []
        for batch in _batches(steps):
            del calls[:]
            state, _ = step(state, batch)
            seen.append(list(calls))
        return seen

    return sw.launch(main, 1)[0]


def test_the_probe_runs_on_the_first_call_only() -> None:
    first, *later = _loss_calls(accumulation=2, steps=3)
    # the probe's 4 rows and their halves, three ways (0 1 | 2 3, 0 2 | 1 3, 0 3 | 1 2), then the two micro-batches
    # (review1: a micro-batch of 2 or 3 rows was probed on the row repeated too: see the test below)
    assert first == [4, 2, 2, 2, 2, 2, 2, 4, 4]
    assert later == [[4, 4], [4, 4]]


# -- the probe itself, on outputs made by hand ----------------------------------------------------------
def _measure(loss_fn: Any, output: Any, targets: Any, rows: int = ROWS) -> Any:
    return measure(loss_fn, output, torch.zeros(rows, 1), targets, [torch.default_generator], True, lambda _: None)


def _logits(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(ROWS, 5, 7, generator=gen).to(dtype), torch.randint(7, (ROWS, 5), generator=gen)


AGREE = {
    "mse": lambda o, y: F.mse_loss(o, torch.zeros_like(o)),
    "hf-style flattened ce": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
    "shifted ce": lambda o, y: F.cross_entropy(o[:, :-1].flatten(0, 1), y[:, 1:].flatten()),
    "label smoothing": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    "z-loss": lambda o, y: torch.logsumexp(o, -1).pow(2).mean(),
    "kl batchmean": lambda o, y: F.kl_div(F.log_softmax(o, -1), F.softmax(o.flip(-1), -1), reduction="batchmean"),
    "mean of a signed term": lambda o, y: o.mean(),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss", sorted(AGREE))
def test_mean_losses_agree_with_their_halves(loss: str, dtype: torch.dtype) -> None:
    logits, targets = _logits(dtype)
    found = _measure(AGREE[loss], logits, targets)
    assert isinstance(found, Measured) and found.agrees, found
    assert found.rtol == {torch.float64: RTOL_FLOAT64, torch.float32: RTOL_FLOAT32}.get(dtype, RTOL)


def test_a_float32_loss_is_judged_at_float32s_precision() -> None:
    """The finetune review: a class-weighted cross-entropy in float32 (1.2e-3 off a mean over the rows) passed the
    probe at bf16's 2e-2, and trained on the mean of the shares' weighted means (0.46 of the head's update)."""
    logits, targets = _logits(torch.float32)
    found = _measure(lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(),
                                                  weight=torch.linspace(0.5, 2.0, 7)), logits, targets)
    assert isinstance(found, Measured) and not found.agrees and found.rtol == RTOL_FLOAT32, found
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # float32 matmuls may run in bf16: rows round by their company
    try:
        weights = torch.randn(logits.shape[-1], 3, generator=torch.Generator().manual_seed(0))
        assert _measure(lambda o, y: F.mse_loss(o @ weights, torch.zeros(*o.shape[:-1], 3)), logits, targets).rtol \
            == RTOL  # a loss with a matmul; without one (mse alone) float32's tolerance holds whatever the setting
        assert _measure(AGREE["mse"], logits, targets).rtol == RTOL_FLOAT32
    finally:
        torch.set_float32_matmul_precision(before)


def test_dict_and_tuple_outputs_are_halved_leaf_by_leaf() -> None:
    logits, targets = _logits()
    found = _measure(lambda o, y: F.cross_entropy(o["a"][0].flatten(0, 1), y.flatten()) + o["b"].mean(),
                     {"a": (logits, None), "b": logits[:, 0]}, targets)
    assert isinstance(found, Measured) and found.agrees, found


def test_what_cannot_be_halved_is_not_probed() -> None:
    logits, targets = _logits()
    own_loss = {"loss": torch.tensor(2.0, dtype=torch.float64), "logits": logits}
    # a model's own (scalar) loss: not probed, refused only where its model is known (or holds a rows x rows matrix)
    assert _measure(lambda o, _: o["loss"], own_loss, None) == OwnLoss(())
    square = torch.randn(ROWS, ROWS, dtype=torch.float64)  # no prediction of the chain's output here
    assert _measure(lambda o, _: o.sum(), square, None) == "unknown"
    # One row whose row dim cannot be told (a dim of size 1 beside it, no prediction): on a later call
    # with other shapes (more rows), not never.
    assert _measure(lambda o, _: o.sum(), logits[:1, :1], targets[:1], rows=1) == "later"

    def fails_on_fewer_rows(o: Tensor, y: Tensor) -> Tensor:
        return o.view(ROWS, -1).sum()

    assert _measure(fails_on_fewer_rows, logits, targets) == "unknown"
    before = torch.default_generator.get_state()
    assert _measure(lambda o, y: o.sum() * torch.rand(()), logits, targets) == "unknown"  # it draws
    assert torch.equal(torch.default_generator.get_state(), before)  # and the draws were set back
    assert _measure(lambda o, y: o.sum() * float("nan"), logits, targets) == "retry"


def test_a_scalar_the_loss_reads_alone_says_nothing_in_every_mode() -> None:
    """A model's own loss (a scalar beside its logits) goes whole to each half: loss_fn reading only it
    gives the same values however the rows are cut, which says nothing, in every token mode and at one
    row too (a (sum, count) pair read whole on the row and on the row twice would else be refused: it
    was not probed at all before a scalar beside the logits was passed whole)."""
    logits, targets = _logits()
    own = {"loss": torch.tensor(2.0, dtype=torch.float64), "count": torch.tensor(5.0, dtype=torch.float64),
           "logits": logits}
    one_row = {**own, "logits": logits[:1]}
    for mode, loss in ((None, lambda o, _: o["loss"]), ("sum", lambda o, _: (o["loss"], o["count"]))):
        for output, rows in ((own, ROWS), (one_row, 1)):
            found = measure(loss, output, torch.zeros(rows, 1), targets[:rows], [torch.default_generator], True,
                            lambda _: None, tokens=mode)
            # (a mean at one row compares the row with itself twice: equal, as any mean's, so it agrees)
            agrees = isinstance(found, Measured) and found.agrees and mode is None and rows == 1
            assert found in ("unknown", OwnLoss(())) or agrees, (mode, rows, found)


def test_sums_and_in_batch_losses_differ_from_their_halves() -> None:
    logits, targets = _logits(torch.bfloat16)
    found = _measure(lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="sum"), logits, targets)
    assert isinstance(found, Measured) and not found.agrees and found.is_sum
    z = logits[:, 0].float()
    found = _measure(lambda o, y: F.cross_entropy(o @ o.T, torch.arange(o.shape[0])), z, targets)
    assert isinstance(found, Measured) and not found.agrees and not found.is_sum


# -- micro-batches of one row ---------------------------------------------------------------------------
# Micro-batch size 1 (common in LLM fine-tuning) has no halves: the probe compares the row with the row
# repeated twice. Before, it skipped one row and marked itself done, so a summed loss trained with 1/parts
# of the single-device step's gradients, even where later batches had more rows.
ONE_ROW_CUTS: dict[str, tuple[Any, sw.Mesh, int, str]] = {
    "zero-2 dp=2 x accumulation=4": (lambda s: sw.shard_params(s, "dp", 2, accumulation=4), sw.Mesh(dp=2), 8,
                                     r"shard_params over axis 'dp' of size 2 x 4 micro-batches"),
    "1f1b x 4 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 4), sw.Mesh(pp=2), 4, r"4 micro-batches"),
    "zero-3 dp=2": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2), 2, r"shard_params over axis 'dp' of size 2"),
}


def _gpt_batches(rows: list[int], pad: bool = False, seq: int = 6) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in rows:
        ids = torch.randint(16, (n, seq + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:].clone()
        if pad:  # each row's own number of real tokens, at least one
            for i in range(n):
                y[i, int(torch.randint(1, seq, (1,), generator=gen)):] = -100
        out.append((x, y))
    return out


def _tiny_gpt(loss: Any, **kwargs: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=16, d_model=8, n_heads=2, n_layers=2, seq_len=8).double(),
                                     units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9), **kwargs), params


def _lm_sum(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


@pytest.mark.parametrize("cut", sorted(ONE_ROW_CUTS))
def test_a_summed_loss_on_micro_batches_of_one_row_is_refused(cut: str) -> None:
    transform, mesh, rows, words = ONE_ROW_CUTS[cut]
    step, params = _tiny_gpt(_lm_sum)
    with pytest.raises(RankFailed, match=rf"loss_fn is not a mean over the batch's rows, which a step that cuts the "
                       rf"batch \({words}\) needs(.|\n)*On the one row(.|\n)*repeated twice \(twice it: a loss "
                       r"summed over the rows"):
        _run(transform(step), mesh, params, _gpt_batches([rows])[0])


def test_a_first_batch_of_one_row_a_rank_does_not_end_the_probe() -> None:
    """The probe measured nothing on one row and marked itself done: batches of 8 rows that followed
    trained silently wrong. Now the one row is measured; where it cannot be, a later call is."""
    step, params = _tiny_gpt(_lm_sum)
    with pytest.raises(RankFailed, match="loss_fn is not a mean over the batch's rows"):
        _run(sw.shard_params(step, "dp", 3), sw.Mesh(dp=2), params, _gpt_batches([2])[0])
    probe = LossProbe(ProbeCut("dp"), lambda: None, lambda _: None)
    out = torch.randn(1, 1, dtype=torch.float64)  # [rows, 1]: the rows' dim cannot be told on one row
    probe.check(lambda o, y: F.mse_loss(o, y, reduction="sum"), out, torch.zeros(1, 3), torch.zeros(1, 1), [], False)
    assert probe.later  # not done: the next micro-batch of other shapes probes
    out = torch.randn(4, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="loss_fn is not a mean over the batch's rows"):
        probe.check(lambda o, y: F.mse_loss(o, y, reduction="sum"), out, torch.zeros(4, 3), torch.zeros(4, 1), [],
                    False)


ONE_ROW_MEANS = {
    "cross-entropy": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
    "label smoothing": lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    "mse": lambda o, y: F.mse_loss(o, F.one_hot(y, 16).double()),
}


@pytest.mark.parametrize("loss", sorted(ONE_ROW_MEANS))
@pytest.mark.parametrize("cut", sorted(ONE_ROW_CUTS))
def test_mean_losses_on_micro_batches_of_one_row_equal_the_single_device_step(cut: str, loss: str) -> None:
    transform, mesh, rows, _ = ONE_ROW_CUTS[cut]
    step, params = _tiny_gpt(ONE_ROW_MEANS[loss])
    sw.testing.assert_equivalent(transform(step), step, mesh, _gpt_batches([rows, rows]), params)


def _largest_row_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1).max()


def _mean_plus_variance(logits: Tensor, y: Tensor) -> Tensor:
    rows = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
    return rows.mean() + rows.var(unbiased=False)


def _class_weighted(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), weight=torch.linspace(0.5, 2.0, 16, dtype=logits.dtype))


@pytest.mark.parametrize("loss", [_largest_row_loss, _mean_plus_variance, _class_weighted])
@pytest.mark.parametrize("cut", sorted(ONE_ROW_CUTS))
def test_a_whole_batch_loss_on_micro_batches_of_one_row_is_refused_on_two_of_them(cut: str, loss: Any) -> None:
    """The largest row's loss, a mean plus a variance over the rows, a class-weighted mean: each the same on one
    row repeated, so micro-batches of one row trained another model (0.6 relative loss error, a pipeline of four
    one-row micro-batches). The probe keeps the first row and probes it with the next micro-batch's as two rows,
    within the step or (zero-3 dp=2: one row a rank, one micro-batch) at the next."""
    transform, mesh, rows, words = ONE_ROW_CUTS[cut]
    step, params = _tiny_gpt(loss)
    with pytest.raises(RankFailed, match=rf"loss_fn is not a mean over the batch's rows, which a step that cuts the "
                       rf"batch \({words}\) needs(.|\n)*On two rows of this rank's, each a micro-batch of one row, "
                       r"together"):
        sw.testing.assert_equivalent(transform(step), step, mesh, _gpt_batches([rows, rows]), params)


def test_an_in_batch_contrastive_loss_on_one_row_a_rank_is_refused() -> None:
    chain, params = _mlp()
    step = sw.shard_params(sw.train_step(chain, _in_batch_contrastive, sw.optim.sgd(0.01)), "dp", 1)
    x, y = _batches(1)[0]
    with pytest.raises(RankFailed, match=r"On the one row(.|\n)*in-batch negatives"):
        _run(step, sw.Mesh(dp=2), params, (x[:2], y[:2]))


def test_one_row_and_its_repetition_in_the_probe_itself() -> None:
    logits, targets = _logits()
    for loss in AGREE.values():
        found = _measure(loss, logits[:1], targets[:1], rows=1)
        assert isinstance(found, Measured) and found.along == "repeat" and found.agrees, found
    found = _measure(lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="sum"), logits[:1],
                     targets[:1], rows=1)
    assert isinstance(found, Measured) and found.along == "repeat" and found.is_sum and not found.agrees
    assert found.whole == pytest.approx(2 * found.halves[0], rel=1e-12)
    # The output's rows told by the chain's output on the row repeated (fake tensors): dims 0 and 1 of a
    # rows x rows matrix beside a [1, 1] column.
    square, column = torch.randn(1, 1, dtype=torch.float64), torch.randn(1, 1, dtype=torch.float64)
    found = measure(lambda o, y: o[0].sum() + o[1].sum(), (square, column), torch.zeros(1, 3), targets[:1],
                    [], True, lambda x: [torch.Size([2, 2]), torch.Size([2, 1])] if x.shape[0] == 2 else None)
    assert isinstance(found, Measured) and found.whole == pytest.approx(4 * square.item() + 2 * column.item())


def test_one_row_beside_a_table_is_told_by_the_chains_output_on_the_row_repeated() -> None:
    """Features [1, 5] beside 4 prototypes: no dim-0 fast path, so the chain's output on the row repeated
    twice (fake tensors) says the features follow the rows and the table does not."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Prototypes()).double())
    x, _ = _batches(1)[0]
    batches = [(x[:2], torch.tensor([0, 3])), (x[2:4], torch.tensor([2, 1]))]
    step = sw.train_step(chain, _prototype_loss, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)

    def summed(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
        return F.cross_entropy(out[0] @ out[1].T, y, reduction="sum")

    step = sw.shard_params(sw.train_step(chain, summed, sw.optim.sgd(0.1)), "dp", 3)
    with pytest.raises(RankFailed, match=r"On the one row(.|\n)*twice it: a loss summed over the rows"):
        _run(step, sw.Mesh(dp=2), params, batches[0])


def test_torchs_new_precision_settings_are_read_and_do_not_break_the_probe() -> None:
    """The review: after `torch.backends.mkldnn.matmul.fp32_precision = "bf16"` (torch's new settings) the legacy
    getter raises, and every float32 step that cuts the batch failed with torch's error. In a process of its own:
    the legacy getter stays refused there after the new settings were used."""
    import subprocess
    import sys

    code = (
        "import torch, torch.nn.functional as F\n"
        "from shardwise.engine.run.loss_rows import RTOL, RTOL_FLOAT32, measure\n"
        "torch.backends.mkldnn.matmul.fp32_precision = 'bf16'\n"
        "g = torch.Generator().manual_seed(5)\n"
        "w = torch.randn(5, 3, generator=g)\n"
        "found = measure(lambda o, y: F.mse_loss(o @ w, torch.zeros(o.shape[0], 3)), torch.randn(8, 5, generator=g),\n"
        "                torch.zeros(8, 1), None, [torch.default_generator], True, lambda _: None)\n"
        "assert found.agrees and found.rtol == RTOL, found\n"
        "found = measure(lambda o, y: F.mse_loss(o, torch.zeros_like(o)), torch.randn(8, 5, generator=g),\n"
        "                torch.zeros(8, 1), None, [torch.default_generator], True, lambda _: None)\n"
        "assert found.agrees and found.rtol == RTOL_FLOAT32, found  # no matmul: float32 whatever the setting\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_mean_near_zero_of_cancelling_terms_passes_in_float32() -> None:
    """The review: a KL of near-equal distributions (a self-distillation's teacher: the student plus 1e-4 noise) is
    a mean whose float32 sums round ~3e-5 apart relative to its tiny value; 1e-5 refused it."""
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(ROWS, 5, 7, generator=gen) * 30
    teacher = student + 1e-4 * torch.randn(ROWS, 5, 7, generator=gen)

    def kl(out: Tensor, y: Tensor) -> Tensor:
        return F.kl_div(F.log_softmax(out, -1), F.log_softmax(y, -1), log_target=True, reduction="batchmean")

    found = _measure(kl, student, teacher)
    assert isinstance(found, Measured) and found.agrees, found


# -- a loss over the batch's hardest rows ---------------------------------------------------------------
# OHEM (the mean of the hardest half of the rows' losses, common in detection and segmentation) agrees with
# the mean of its halves where its chosen rows fall one a half: of 4 rows halved 0 1 | 2 3, for 2 pairs in 3.
# The probe halves the 4 rows the three ways: no two rows are together in all of them.
def _ohem(out: Tensor, y: Tensor) -> Tensor:
    rows = F.mse_loss(out, y, reduction="none").mean(1)
    return rows.topk(rows.shape[0] // 2).values.mean()


@pytest.mark.parametrize("hardest", [(0, 2), (0, 3), (1, 2), (1, 3), (0, 1), (2, 3)])
def test_a_mean_over_the_hardest_rows_is_refused_wherever_they_fall(hardest: tuple[int, int]) -> None:
    output = torch.full((4, 3), 0.1, dtype=torch.float64)
    for i, row in enumerate(hardest):
        output[row] = 2.0 + i
    found = _measure(_ohem, output, torch.zeros(4, 3, dtype=torch.float64), rows=4)
    assert isinstance(found, Measured) and not found.agrees
    # a mean over the rows agrees on every halving
    assert _measure(lambda o, y: F.mse_loss(o, y), output, torch.zeros(4, 3, dtype=torch.float64), rows=4).agrees


def test_ohem_under_zero_2_is_refused_where_its_hardest_rows_fall_one_a_first_and_second_half() -> None:
    """The batch (seed 4) that trained 2.6% off torch at the first step, with no error, before."""
    torch.manual_seed(4)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double())
    step = sw.train_step(chain, lambda o, y: F.cross_entropy(o, y, reduction="none").topk(o.shape[0] // 2).values
                         .mean(), sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 5, (8,), generator=gen))
               for _ in range(3)]
    with pytest.raises(RankFailed, match=r"not a mean over the batch's rows.*on two halves of them \(rows 0 and "
                       r"[23]; rows 1 and [23]\).*the batch's hardest rows, OHEM's.*cannot be computed on a part"):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", 2), step, sw.Mesh(dp=2), batches, params)


def _adjacent_pairs(out: Tensor, y: Tensor) -> Tensor:
    """A loss over rows paired with their neighbours (rows 2i and 2i + 1, a preference pair laid out together)."""
    rows = F.mse_loss(out, y, reduction="none").mean(1)
    return F.softplus(rows[0::2] - rows[1::2]).mean()


def test_a_loss_over_adjacent_pairs_is_refused_naming_per_shard_mean_which_trains_it() -> None:
    chain, params = _mlp()
    step = sw.train_step(chain, _adjacent_pairs, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(RankFailed, match=r"pairs each row with its neighbour.*trains with tokens='per_shard_mean'"):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", 2), step, sw.Mesh(dp=2), _batches(2), params)
    # each rank's 4 rows hold two whole pairs: the mean of the ranks' losses is the single-device step's
    knowing = sw.train_step(chain, _adjacent_pairs, sw.optim.sgd(0.1, momentum=0.9), tokens="per_shard_mean")
    sw.testing.assert_equivalent(sw.shard_params(knowing, "dp", 2), step, sw.Mesh(dp=2), _batches(2), params)


def test_a_loss_without_a_matmul_is_judged_at_float32s_tolerance_under_tf32() -> None:
    """Found by session 41's probing: torch.set_float32_matmul_precision("high") (TF32, usual on GPUs) widened the
    tolerance to 2e-2 for every loss, and a class-weighted cross-entropy (no matmul: 0.08-1% off a mean) passed."""
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(4, 5, 16, generator=gen), torch.randint(16, (4, 5), generator=gen)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        found = _measure(_class_weighted, logits, targets, rows=4)
    finally:
        torch.set_float32_matmul_precision(before)
    assert isinstance(found, Measured) and found.rtol == RTOL_FLOAT32 and not found.agrees


def test_a_micro_batch_of_two_rows_is_probed_on_its_halves_alone() -> None:
    """The review (s41 review1): the three halvings of 4 rows, inserted between the halving of 2 rows and the one row's
    repetition, made a micro-batch of 2 or 3 rows probed on the row repeated twice as well."""
    (calls,) = _loss_calls(accumulation=4, steps=1)
    assert calls == [2, 1, 1, 2, 2, 2, 2]  # the probe's 2 rows and their halves, then the 4 micro-batches
