"""A dict batch whose keys the forward does not take, told apart from a model that takes the dict whole and fails.

With ``forward(self, batch)`` and a dict batch, any failure inside the model (a shape mismatch in a Linear)
was reported as "the dict is not taken as its keyword arguments; name the keys as the forward's arguments",
hiding torch's error. The keyword-argument hint now comes only where the model's code took the dict for a
tensor (the error names the dict's type), after torch's error and the line that raised it; any other failure
is torch's own error, with the layer, micro-batch and input in its note.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw


class TakesTheBatch(torch.nn.Module):
    """forward(self, batch) reading batch["x"]; ``wide`` rows: the second Linear's input is cut to 5 features, a
    bug the example (4 rows) does not reach."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.a(batch["x"])
        return self.b(h[..., :5] if h.shape[0] > 4 else h)


def _step(model: torch.nn.Module, example: Any, loss: Any) -> tuple[sw.Step, Any]:
    chain, params = sw.functionalize(model.double(), example_input=example)
    return sw.train_step(chain, loss, sw.optim.sgd(0.1)), params


def _rows(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, 6, generator=gen, dtype=torch.float64),
            "y": torch.randn(n, 3, generator=gen, dtype=torch.float64)}


def test_a_forward_taking_the_dict_whole_fails_with_torchs_error_not_a_keyword_hint() -> None:
    torch.manual_seed(0)
    step, params = _step(TakesTheBatch(), _rows(4), lambda out, b: F.mse_loss(out, b["y"]))
    batch = _rows(8)
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(8x5 and 16x3\)") as err:
        step(step.init(params), (batch, batch))
    assert "keyword" not in str(err.value)
    assert err.value.__notes__ == ["in layer 'model' (stage 0, micro-batch 0), on input float64[8, 6], float64[8, 3]"]
    assert err.value.__traceback__ is not None
    assert any(f.name == "forward" and f.filename == __file__ for f in __import__("traceback").extract_tb(
        err.value.__traceback__))  # where: the model's line in the traceback


class HFWrapper(torch.nn.Module):
    """A user's forward(self, batch) calling an unmodified tiny GPT-2 with the dict's values."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as T

        self.gpt = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.gpt(input_ids=batch["ids"], attention_mask=batch["mask"]).logits


def test_an_hf_model_called_with_the_dicts_values_fails_with_torchs_error() -> None:
    """A token id past the vocabulary: torch's index error from GPT-2's embedding, under ZeRO-3 dp2 too."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 8))
    step, params = _step(HFWrapper(), {"ids": ids, "mask": torch.ones(4, 8)}, lambda out, _: out.pow(2).mean())
    bad = ids.clone()
    bad[0, 0] = bad[3, 0] = 40  # a row of each rank's half
    batch = {"ids": bad, "mask": torch.ones(4, 8)}
    with pytest.raises(IndexError, match="index out of range in self") as err:
        step(step.init(params), (batch, None))
    assert "keyword" not in str(err.value)
    zero = sw.shard_params(step, "dp", 3)
    with pytest.raises(sw.collectives.RankFailed, match="IndexError: index out of range in self") as failed:
        sw.launch(lambda: zero(zero.init(params, sw.Mesh(dp=2)), (batch, None)), 2)
    assert "keyword" not in str(failed.value)


class TakesIds(torch.nn.Module):
    """forward(self, input_ids, attention_mask=None): given {"input_id": ...}, the dict goes in whole as input_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(input_ids if attention_mask is None else input_ids * attention_mask)


def test_a_key_the_forward_does_not_take_gets_the_hint_after_torchs_error_and_its_line() -> None:
    """Keywords were the cause (torch's error names the dict): the message says that error, the model's line
    that raised it, and the key to rename."""
    x = torch.randn(4, 4, dtype=torch.float64)
    step, params = _step(TakesIds(), {"input_ids": x}, lambda out, _: out.pow(2).mean())
    line = TakesIds.forward.__code__.co_firstlineno + 1
    message = (r"layer 'model' failed: TypeError: linear\(\): argument 'input' \(position 1\) must be Tensor, not dict "
               rf"\(at {__file__}:{line} in forward\)\. Its input \(the batch\) is a dict with keys \['input_id'\], "
               r"but TakesIds\.forward takes \['input_ids', 'attention_mask'\], not \['input_id'\], so the dict is "
               r"not taken as its keyword arguments.*\('input_id' -> 'input_ids'\?\)")
    with pytest.raises(ValueError, match=message):
        step(step.init(params), ({"input_id": x}, None))
