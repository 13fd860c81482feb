"""Time-major torch functionals called by hand under a cut of the batch.

``F.multi_head_attention_forward`` takes query, key and value as ``(L, N, E)`` whatever the caller holds; a
layer holding the attention's weights as parameters (Hugging Face's WavLM does) calls it itself. Fed a batch
whose rows are on dim 0 there, a step that cuts the rows (ZeRO-3 dp2, accumulation) attended over a slice of
every sequence: the first loss 0.5% off the single-device step's, without an error, since the check looked
for sequence-first modules only. It hears these calls now, names the call site, and refuses; the rows
transposed to dim 1 before the call (the correct use) are cut as before and equal the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.model.sequence_first import rows_on_sequence_dim

WIDTH = 16


class HandAttention(torch.nn.Module):
    """Self-attention over dim 0 of its input, by F.multi_head_attention_forward on its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj_weight = torch.nn.Parameter(torch.randn(3 * WIDTH, WIDTH) / 4)
        self.in_proj_bias = torch.nn.Parameter(torch.zeros(3 * WIDTH))
        self.out_proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.multi_head_attention_forward(
            h, h, h, WIDTH, 2, self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0, self.out_proj.weight,
            self.out_proj.bias, training=True, need_weights=False)[0]


class Model(torch.nn.Module):
    """``x [d0, d1, 6] -> [d0, d1, 3]``; ``transpose``: the rows moved to dim 1 around the attention."""

    def __init__(self, transpose: bool) -> None:
        super().__init__()
        self.transpose = transpose
        self.inp, self.mix, self.out = torch.nn.Linear(6, WIDTH), HandAttention(), torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h.transpose(0, 1) if self.transpose else h
        h = self.mix(h)
        return self.out(h.transpose(0, 1) if self.transpose else h)


CUTS = {
    "zero3 dp2": (lambda step: sw.shard_params(step, "dp", stage=3), sw.Mesh(dp=2)),
    "accumulation 2": (lambda step: sw.shard_params(step, "dp", stage=1, accumulation=2), sw.Mesh(dp=1)),
}


def _problem(transpose: bool) -> tuple[sw.Step, Any, list[Any]]:
    """8 x 4 batches: on a part of 4 rows, dim 0 and dim 1 of the attention's input are equal (sizes tell nothing)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    chain, params = sw.functionalize(Model(transpose).double(), example_input=batches[0][0])
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_hand_written_attention_over_the_rows_is_refused_naming_the_call_site(cut: str) -> None:
    step, params, batches = _problem(transpose=False)
    wrap, mesh = CUTS[cut]
    with pytest.raises(sw.collectives.RankFailed, match=r"multi_head_attention_forward \(called at \S+"
                                                         r"test_sequence_first_functional.py:\d+ in forward\) takes "
                                                         r"its sequence on dim 0") as err:
        sw.testing.assert_equivalent(wrap(step), step, mesh, batches, params)
    assert "transpose the rows to dim 1 before that call" in str(err.value)


def test_the_rows_transposed_to_dim_1_before_the_call_are_cut_as_before() -> None:
    step, params, batches = _problem(transpose=True)
    for wrap, mesh in CUTS.values():
        sw.testing.assert_equivalent(wrap(step), step, mesh, batches, params)


def test_wavlm_which_calls_it_with_the_rows_on_dim_1_trains_as_one_device_under_zero3() -> None:
    """transformers' WavLM attention transposes its (batch, frames, hidden) input to (frames, batch, hidden) for
    F.multi_head_attention_forward: heard, and passed."""
    import transformers as T

    torch.manual_seed(0)
    model = T.WavLMForCTC(T.WavLMConfig(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, pad_token_id=0, num_buckets=8, max_bucket_distance=16,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0)).double()
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, 400, dtype=torch.float64, generator=gen),  # 48 frames after the convolutions
                torch.randn(4, 48, 12, dtype=torch.float64, generator=gen)) for _ in range(2)]
    with torch.no_grad():
        heard = rows_on_sequence_dim([], model, batches[0][0])
    assert heard == []
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: F.mse_loss(out.logits, y), sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)


class CTCHead(torch.nn.Module):
    """A model that computes a CTC loss itself (as transformers' ForCTC heads do): log-probabilities (T, N, C)
    by contract, of a (batch, frames, 6) input; ``transpose``: (frames, batch) as F.ctc_loss wants them."""

    def __init__(self, transpose: bool, module: bool) -> None:
        super().__init__()
        self.transpose, self.lin = transpose, torch.nn.Linear(6, 5)
        self.ctc = torch.nn.CTCLoss() if module else F.ctc_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = self.lin(x).log_softmax(-1)
        logp = logp.transpose(0, 1) if self.transpose else logp
        n = logp.shape[1]
        targets = torch.ones(n, 2, dtype=torch.long)
        return self.ctc(logp, targets, torch.full((n,), logp.shape[0]), torch.full((n,), 2))


@pytest.mark.parametrize("module", [False, True], ids=["F.ctc_loss", "nn.CTCLoss"])
def test_ctc_loss_on_the_rows_is_found_and_on_dim_1_is_not(module: bool) -> None:
    """F.ctc_loss (also through nn.CTCLoss, named by the line that calls the module) is time-major by contract."""
    for transpose, found in ((True, False), (False, True)):
        with torch.no_grad():
            got = rows_on_sequence_dim([], CTCHead(transpose, module), torch.randn(4, 4, 6))
        assert [path for path, _, _ in got] == ([
            f"torch.nn.functional.ctc_loss (called at {__file__}:{CTCHead.forward.__code__.co_firstlineno + 5} "
            "in forward)"] if found else [])


def test_the_fake_run_is_made_only_where_the_code_names_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose code names no time-major functional and holds no sequence-first module pays no run on fake
    tensors for the check (half a second for a small GPT-2 at its first call, seconds in a fresh process)."""
    import transformers as T

    from shardwise.engine.model.time_major_code import may_call_time_major
    from shardwise.engine.step import sequence_cut
    from shardwise.testing.models import TinyGPT

    def chain_of(model: torch.nn.Module, example: Any) -> Any:
        return sw.functionalize(model, example_input=example)[0]

    ids = torch.randint(0, 32, (4, 8))
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                          attn_implementation="eager", bos_token_id=0, eos_token_id=0))
    tiny = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8)
    assert not may_call_time_major(chain_of(gpt2, ids))
    assert not may_call_time_major(chain_of(tiny, ids))
    assert may_call_time_major(chain_of(Model(transpose=True), torch.randn(4, 4, 6)))
    for module in (False, True):
        assert may_call_time_major(chain_of(CTCHead(True, module), torch.randn(4, 4, 6)))

    def never(*args: Any) -> Any:
        raise AssertionError("the check ran the model on fake tensors")

    monkeypatch.setattr(sequence_cut, "rows_on_sequence_dim", never)
    chain, params = sw.functionalize(tiny, example_input=ids)
    step = sw.train_step(chain, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), sw.optim.sgd(0.1))
    accumulate = sw.shard_params(step, "dp", 1, accumulation=2)
    sw.launch(lambda: accumulate(accumulate.init(params, sw.Mesh(dp=1)), (ids, ids)), 1)
