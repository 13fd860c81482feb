"""A Region that fails on a count it was not told to divide names the counts it could divide by the names a
Region takes (failures.region_failed): a count held by the module's config as ``config.<name>``.

T5Attention holds ``n_heads`` and its config ``num_heads``; the refusal said "T5Attention has {'num_heads': 4}",
and ``Region(heads=('num_heads',))`` is then refused as an attribute the module does not have.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

D, HEADS = 16, 4


class ConfigCountAttention(nn.Module):
    """An attention whose per-head bias is sized by its config's whole count (as T5's zeros bias is by
    ``n_heads``, here read from the config the Region does not divide)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_heads=HEADS)
        self.n_heads = HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        bias = torch.zeros(1, self.config.num_heads, t, t, dtype=x.dtype)
        a = (q @ k.transpose(-1, -2) + bias).softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


def _refusal_at_tp2(attention: nn.Module) -> str:
    """The refusal of one step of ``attention`` in a Region over heads at tp2 (threads), as text."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(attention).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    plan = {"0": sw.tp.Region(heads=("n_heads",)), "0.[qkv]": sw.tp.Colwise(), "0.o": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan)
    batch = (torch.randn(2, 6, D, dtype=torch.float64), torch.randn(2, 6, D, dtype=torch.float64))
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batch), 2)
    return str(caught.value)


def test_a_config_count_is_named_as_the_region_takes_it() -> None:
    text = _refusal_at_tp2(ConfigCountAttention())
    assert "computes with a count it was not told to divide; ConfigCountAttention has {'config.num_heads': 4}" in text


class HeldCountSinksAttention(nn.Module):
    """GPT-OSS-like sinks, one logit per head beside each head's scores, with the head count the module holds
    (``self.n_heads``), which the Region divides while it runs (to a HeadCount, an int subclass)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) + self.sinks[:, None, None]
        a = scores.softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


def test_a_per_head_parameter_is_named_when_the_module_holds_its_head_count() -> None:
    """The count a module holds reads divided while its Region runs, as a HeadCount (an int subclass): the
    per-head parameter was missed ("type(...) is int") and the refusal named a count not told to divide."""
    text = _refusal_at_tp2(HeldCountSinksAttention())
    assert f"its parameter 'sinks' of shape ({HEADS},) holds one value per head ({HEADS} heads)" in text, text
    assert "give '0.sinks' sw.tp.PerHead() in the plan" in text
