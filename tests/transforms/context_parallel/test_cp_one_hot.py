"""``F.one_hot`` under context parallel, and DBRX's experts (which pick their tokens with it).

``F.one_hot(ids, num_classes)`` checks its range with an ``aminmax`` over the ids: over the part's positions, but
that check only fails where one device's would, and each position's row is made from its own id. It was refused as
a reduction along the sequence (a one-hot embedding; Hugging Face DBRX, whose ``DbrxExperts`` loops over the experts
its tokens hit). With the count left to the ids (``num_classes=-1``) the classes are the part's largest id + 1, the
output's width then differs between the ranks and one device: still refused. DBRX's experts forward is pinned by
digest as known to compute each token alone (engine/model/reproduced.py, token_wise.py).

Float64, 2 steps of SGD with momentum, compared with one device at rtol 1e-12 (the cut only reorders the
attention's sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.transforms.context_parallel import ring_attention

VOCAB, WIDTH = 32, 16


class _OneHotEmbedding(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes, self.w = classes, nn.Linear(VOCAB, WIDTH, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        hot = F.one_hot(ids, self.classes) if self.classes > 0 else F.one_hot(ids)
        return self.w(F.pad(hot, (0, VOCAB - hot.shape[-1])).to(self.w.weight.dtype))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        return self.o(ring_attention(q, k, v, "cp").transpose(1, 2).reshape(b, t, d))


def _step(classes: int) -> tuple[sw.Step, object, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(_OneHotEmbedding(classes), _Attention(), nn.Linear(WIDTH, VOCAB)).double()
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    loss = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def test_a_one_hot_of_a_given_class_count_is_computed_position_by_position() -> None:
    step, params, batches = _step(VOCAB)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


def test_a_one_hot_counting_its_classes_from_the_part_is_refused() -> None:
    """``F.one_hot(ids)``: the part's largest id decides the width (padded back to VOCAB here, so no shape fails)."""
    step, params, batches = _step(-1)
    with pytest.raises(sw.collectives.RankFailed, match=r"context_parallel\(axis='cp'\): .* along the sequence"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


def test_dbrx_trains_under_context_parallel() -> None:
    """DBRX (grouped-query attention with clipped qkv, a mixture of experts routed top-1 of 2) on an unmodified
    transformers model from a tiny config, random init."""
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    config = T.DbrxConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                          attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                          ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 2, "moe_top_k": 1})
    model = T.DbrxForCausalLM(config).double()
    ids = torch.randint(64, (2, 4, 17), generator=torch.Generator().manual_seed(2))
    batches = [(s[:, :-1], s[:, 1:]) for s in ids]
    chain, params = sw.functionalize(model, units=T.models.dbrx.modeling_dbrx.DbrxBlock, example_input=batches[0][0])
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)
