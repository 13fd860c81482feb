"""An attention of one's own that calls ring_attention / ulysses_attention, as context_parallel's refusal advises.

It was refused twice over: by its class name (``...Attention``, refused before looking at what it
calls) or, named otherwise, as a chain with "no attention module it can split"; and its model had no
single-device step (``axis_size(axis='cp') needs a mesh``), so nothing to compare it with. Now the
two functions compute the plain attention outside any mesh, a module of any class whose forward calls
them is kept as written, and the step equals the single-device one (float64, SGD with momentum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.transforms.context_parallel import ring_attention, ulysses_attention


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with its sdpa call replaced by ring (or Ulysses) attention over ``axis``."""

    def __init__(self, d: int, heads: int, kind: str = "ring", axis: str = "cp", balanced: bool = True) -> None:
        super().__init__()
        self.heads, self.kind, self.axis, self.balanced = heads, kind, axis, balanced
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        attend = ring_attention if self.kind == "ring" else ulysses_attention
        y = attend(q, k, v, self.axis, balanced=self.balanced)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class SelfAttn(CausalSelfAttention):
    """The same under a name that does not end in Attention."""


class Block(nn.Module):
    def __init__(self, attn: nn.Module, d: int) -> None:
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(d), attn, nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                                            nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, attn: type[nn.Module] = CausalSelfAttention, vocab: int = 32, d: int = 16, seq: int = 16,
                 **kw: object) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(attn(d, 2, **kw), d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(x)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _setup(attn: type[nn.Module] = CausalSelfAttention, **kw: object) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = GPT(attn, **kw).double()
    ids = torch.randint(0, 32, (4, 17))
    batches = [(ids[:, :-1], ids[:, 1:]), (ids.flip(0)[:, :-1], ids.flip(0)[:, 1:])]
    chain, params = sw.functionalize(model, units=Block, example_input=batches[0][0])  # no mesh: plain attention
    return sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_outside_any_mesh_they_are_plain_attention(kind: str) -> None:
    q, k, v = torch.randn(3, 2, 2, 8, 4, dtype=torch.float64).unbind(0)
    attend = ring_attention if kind == "ring" else ulysses_attention
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attend(q, k, v, "cp"), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attend(q, k, v, "cp", causal=False),
                               F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
    # ... and a mesh without the axis refuses it (a misspelled name), saying how to run it unsplit there.
    with pytest.raises(ValueError, match=r"has no axis 'cp' .*sw.Mesh\(dp=1, cp=1\)"), sw.Mesh(dp=1):
        attend(q, k, v, "cp")


@pytest.mark.parametrize("attn", [CausalSelfAttention, SelfAttn], ids=["named-Attention", "named-otherwise"])
@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_a_module_calling_them_is_split_as_written(attn: type[nn.Module], kind: str) -> None:
    reference, params, batches = _setup(attn, kind=kind)
    reference(reference.init(params), batches[0])  # the single-device step runs
    step = sw.context_parallel(reference, "cp", positions=("wpe.weight",))
    plan = step.plan(sw.Mesh(cp=2), params, batches[0])
    assert {"ppermute" if kind == "ring" else "all_to_all", "psum"} <= {c.op for c in plan.collectives(0)}
    sw.testing.assert_equivalent(step, reference, sw.Mesh(cp=2), batches, params, rtol=1e-10)


def test_with_zero3_over_dp() -> None:
    reference, params, batches = _setup()
    step = sw.shard_params(sw.context_parallel(reference, "cp", positions=("wpe.weight",)), "dp", stage=3)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(dp=2, cp=2), batches, params, rtol=1e-10)


def test_zero_alone_needs_the_axis_in_the_mesh_at_size_one() -> None:
    """Under a mesh without the axis the call is refused (a misspelled name looks the same), saying how to
    train the model unsplit there; the advice works."""
    reference, params, batches = _setup()
    zero = sw.shard_params(reference, "dp", stage=3)
    with pytest.raises(sw.collectives.RankFailed, match=r"Mesh\(dp=2\) has no axis 'cp'.*sw.Mesh\(dp=2, cp=1\)"):
        sw.testing.assert_equivalent(zero, reference, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(zero, reference, sw.Mesh(dp=2, cp=1), batches, params, rtol=1e-10)


def test_unbalanced() -> None:
    reference, params, batches = _setup(balanced=False)
    step = sw.context_parallel(reference, "cp", balanced=False, positions=("wpe.weight",))
    sw.testing.assert_equivalent(step, reference, sw.Mesh(cp=2), batches, params, rtol=1e-10)


@pytest.mark.parametrize(("kw", "message"), [
    ({"axis": "seq"}, r"ring_attention\(axis='seq'\): this layer runs under context_parallel over axis 'cp'"),
    ({"balanced": False}, r"ring_attention\(balanced=False\): context_parallel over 'cp' cut the sequence with "
                          r"balanced=True"),
])
def test_a_call_that_disagrees_with_the_transform_is_refused(kw: dict, message: str) -> None:
    reference, params, batches = _setup(**kw)
    step = sw.context_parallel(reference, "cp", positions=("wpe.weight",))
    with pytest.raises(ValueError, match=message):
        step.plan(sw.Mesh(cp=2), params, batches[0])
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.testing.assert_equivalent(sw.context_parallel(reference, "cp", positions=("wpe.weight",)), reference,
                                     sw.Mesh(cp=2), batches, params)


class PlainAttention(CausalSelfAttention):
    """An attention that does not call them: sdpa over what it is given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


def test_an_attention_that_does_not_call_them_is_still_refused() -> None:
    reference, _, _ = _setup(PlainAttention)
    with pytest.raises(ValueError, match=r"holds the attention h\.0\.attn \(PlainAttention\), which it cannot split.*"
                                         r"rewrite its forward to call ring_attention / ulysses_attention"):
        sw.context_parallel(reference, "cp", positions=("wpe.weight",))


class _Kernel(nn.Module):
    """torchtitan's way: the attention's kernel a child module, here calling ring attention."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, "cp")


class KernelChildAttention(CausalSelfAttention):
    def __init__(self, d: int, heads: int, **kw: object) -> None:
        super().__init__(d, heads, **kw)  # type: ignore[arg-type]
        self.sdpa = _Kernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        return self.c_proj(self.sdpa(q, k, v).transpose(1, 2).reshape(b, t, d))


def test_an_attention_whose_kernel_child_calls_ring_attention_is_refused_naming_where_to_call_it() -> None:
    """The refusal said to rewrite the forward to call ring_attention, which its child already did: it names the
    child, and the parent's forward (code context_parallel cannot judge) as where the call must go."""
    reference, _, _ = _setup(KernelChildAttention)
    with pytest.raises(ValueError, match=r"holds the attention h\.0\.attn \(KernelChildAttention\), whose "
                                         r"h\.0\.attn\.sdpa calls ring_attention / ulysses_attention, but whose own "
                                         r"forward .* call ring_attention in KernelChildAttention\.forward itself"):
        sw.context_parallel(reference, "cp", positions=("wpe.weight",))
