"""Small problems for the tensor-parallel tests: a model, its single-device step, a plan, batches.

Every model is tiny (hidden 32, 2 blocks, sequence 8, batch 4) and float64, so a
step takes milliseconds on threads and the equivalence tests can hold 1e-12.

* TinyGPT (``shardwise.testing.models``) split per Block: a fused ``qkv`` Linear
  (Colwise(fused=3)), the head tied to the token embedding (both cut the vocabulary).
* Hugging Face Llama: grouped-query attention, 8 query heads and 4 key/value heads,
  so tp 2 and tp 4 both keep whole groups on a rank.
* Hugging Face GPT-2: the fused ``c_attn`` Conv1D, the special case of the plans.
* An MLP (``nn.Sequential``, layers "0", "2", ...): Colwise / Rowwise pairs.

The builders are fixtures so that each test file gets them without importing a
helper module (the suite runs with ``--import-mode=importlib``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT, mlp
from shardwise.transforms.tensor_parallel import GPT2_BLOCKS, LLAMA_BLOCKS, TINY_GPT_BLOCKS

VOCAB, HIDDEN, SEQ, BATCH, LAYERS = 64, 32, 8, 4, 2
FAMILIES = ("tiny_gpt", "llama", "gpt2")


@dataclass(frozen=True)
class Problem:
    """A single-device step and what a tensor-parallel version of it needs."""

    step: sw.Step  # the reference: no transform
    params: dict[str, dict[str, Tensor]]
    batches: list[Any]
    plan: dict[str, Any]  # the family's ready plan (vocab_parallel as asked)
    blocks: str | None  # the sequence-parallel blocks pattern; None for a model without blocks
    model: torch.nn.Module


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy that works on whole logits and, inside a tensor-parallel step, on split ones."""
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def hf_lm_loss(out: Any, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def token_batches(n: int, batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(VOCAB, (batch, seq), generator=gen), torch.randint(VOCAB, (batch, seq), generator=gen))
        for _ in range(n)
    ]


def sgd() -> Any:
    return sw.optim.sgd(0.1, momentum=0.9)


def build_tiny_gpt(
    *, vocab_parallel: bool = True, optimizer: Callable[[], Any] = sgd, clip_norm: float | None = None,
    steps: int = 3, d_model: int = HIDDEN, n_heads: int = 4, n_layers: int = LAYERS, seq: int = SEQ,
    batch: int = BATCH, tie: bool = True,
) -> Problem:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=d_model, n_heads=n_heads, n_layers=n_layers, seq_len=seq,
                    tie_weights=tie).double()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, lm_loss, optimizer(), clip_norm=clip_norm)
    return Problem(step, params, token_batches(steps, batch, seq), sw.tp.tiny_gpt_plan(vocab_parallel=vocab_parallel),
                   TINY_GPT_BLOCKS, model)


def _transformers() -> Any:
    return pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")


def build_llama(
    *, vocab_parallel: bool = True, optimizer: Callable[[], Any] = sgd, clip_norm: float | None = None,
    steps: int = 3, heads: int = 8, kv_heads: int = 4,
) -> Problem:
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2 * SEQ,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = T.LlamaForCausalLM(cfg).double()
    batches = token_batches(steps)
    chain, params = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                     example_input=batches[0][0])
    step = sw.train_step(chain, hf_lm_loss, optimizer(), clip_norm=clip_norm)
    return Problem(step, params, batches, sw.tp.llama_plan(vocab_parallel=vocab_parallel), LLAMA_BLOCKS, model)


def build_gpt2(
    *, vocab_parallel: bool = True, optimizer: Callable[[], Any] = sgd, clip_norm: float | None = None,
    steps: int = 3,
) -> Problem:
    T = _transformers()
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )
    model = T.GPT2LMHeadModel(cfg).double()
    batches = token_batches(steps)
    chain, params = sw.functionalize(model, units=T.models.gpt2.modeling_gpt2.GPT2Block,
                                     example_input=batches[0][0])
    step = sw.train_step(chain, hf_lm_loss, optimizer(), clip_norm=clip_norm)
    return Problem(step, params, batches, sw.tp.gpt2_plan(vocab_parallel=vocab_parallel), GPT2_BLOCKS, model)


MLP_WIDTHS = (8, 32, 16, 32, 8)
MLP_PLAN = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise(), "4": sw.tp.Colwise(), "6": sw.tp.Rowwise()}


def build_mlp(
    widths: tuple[int, ...] = MLP_WIDTHS, plan: dict[str, Any] | None = None, *,
    optimizer: Callable[[], Any] = sgd, clip_norm: float | None = None, steps: int = 3, batch: int = BATCH,
) -> Problem:
    torch.manual_seed(0)
    model = mlp(list(widths)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, optimizer(), clip_norm=clip_norm)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(batch, widths[0], generator=gen, dtype=torch.float64),
         torch.randn(batch, widths[-1], generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]
    return Problem(step, params, batches, dict(MLP_PLAN if plan is None else plan), None, model)


BUILDERS: dict[str, Callable[..., Problem]] = {"tiny_gpt": build_tiny_gpt, "llama": build_llama, "gpt2": build_gpt2}


@pytest.fixture
def build() -> dict[str, Callable[..., Problem]]:
    """The problem builders by family: ``build["llama"](vocab_parallel=False)``; ``build["mlp"](...)``."""
    return {**BUILDERS, "mlp": build_mlp}


class PreNormBlock(nn.Module):
    """``x + attention(LayerNorm(x))``: the block the attention tests put a module of theirs in."""

    def __init__(self, attention: nn.Module, width: int) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(width), attention

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm(x))


class ProjectedAttention(nn.Module):
    """Plain q, k, v and o Linears of ``width`` features, viewed per head of ``head_dim`` as Hugging Face's
    attentions view them (the count inferred); ``attend(q, k, v)`` computes the per-head output from the views."""

    def __init__(self, attend: Callable[[Tensor, Tensor, Tensor], Tensor], width: int, head_dim: int) -> None:
        super().__init__()
        self.attend, self.head_dim = attend, head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))


def two_blocks_problem(make_attention: Callable[[], nn.Module], width: int) -> tuple[sw.Step, Any, list[Any]]:
    """Two :class:`PreNormBlock` around the attention ``make_attention`` builds, in float64, SGD with momentum,
    and two batches of (2, 6, ``width``) inputs and targets."""
    torch.manual_seed(0)
    blocks = nn.Sequential(PreNormBlock(make_attention(), width), PreNormBlock(make_attention(), width))
    chain, params = sw.functionalize(blocks.double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(2, 6, width, dtype=torch.float64, generator=gen) for _ in range(2)) for _ in range(2)]
    return step, params, batches
