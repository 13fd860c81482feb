"""How a module cuts a Colwise output along its features, checked against the style (split_watch.py),
and a loss a model computes itself on split logits (own_loss.py).

Each wrong case trained silently before: a plain Colwise cut at a width the Region divides
(GPT-2's ``split(split_size)``), fused=3 on grouped-query blocks of unequal widths (gpt-fast's
``split([dim, kv, kv])``) or on a layout per head (GPT-NeoX's ``view(..., heads, 3 * head_dim)``).
Each is refused by the Plan's prediction (the Region's first forward); the uses that fit their
style are compared with the single-device step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

D, HEADS = 16, 4


class _Attention(nn.Module):
    """q, k and v from one projection, cut apart as ``layout`` says; ``kv_heads`` < ``n_heads``: grouped."""

    def __init__(self, layout: str, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.layout, self.n_embd, self.n_heads, self.kv_heads, self.head_dim = layout, D, heads, kv_heads, D // heads
        self.qkv = nn.Linear(D, D + 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.layout == "split":  # GPT-2's, nanoGPT's: at a width
            q, k, v = qkv.split(self.n_embd, dim=-1)
        elif self.layout == "sections":  # gpt-fast's: grouped-query blocks of their own widths
            kv = self.kv_heads * self.head_dim
            q, k, v = qkv.split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        elif self.layout == "slices":  # Phi-3's
            q, k, v = qkv[..., :self.n_embd], qkv[..., self.n_embd:2 * self.n_embd], qkv[..., 2 * self.n_embd:]
        elif self.layout == "blocks-view":  # the blocks outermost, then heads
            q, k, v = qkv.view(b, t, 3, self.n_heads, -1).unbind(2)
        else:  # "per-head": GPT-NeoX's, q, k and v of each head side by side
            q, k, v = qkv.view(b, t, -1, 3 * self.head_dim).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.n_heads)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, layout: str, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), _Attention(layout, heads, kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _problem(layout: str, heads: int = HEADS, kv_heads: int = HEADS) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(*(_Block(layout, heads, kv_heads) for _ in range(2))).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 6, D, dtype=torch.float64, generator=gen),
                torch.randn(2, 6, D, dtype=torch.float64, generator=gen)) for _ in range(2)]
    return step, params, batches


def _plan(fused: int, local: tuple[str, ...] = ("n_embd",), heads: tuple[str, ...] = ("n_heads",)) -> dict[str, Any]:
    return {"*.attn": sw.tp.Region(heads=heads, local=local), "*.attn.qkv": sw.tp.Colwise(fused=fused),
            "*.attn.out": sw.tp.Rowwise()}


def _refused(step: sw.Step, params: Any, batch: Any, plan: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batch)


def test_a_plain_colwise_cut_at_a_width_the_region_divides_is_refused() -> None:
    """nanoGPT / GPT-2 with Colwise() where fused=3 was meant and the width named in local= (as the
    Region-failed error advises): split(n_embd / tp) cut each rank's contiguous slice into 3 parts, which
    the attention took for q, k and v (on rank 0: q's heads 0-1, q's heads 2-3, k's heads 0-1), with a
    loss error of 4e-4 and no error. fused=3 trains the single-device model."""
    step, params, batches = _problem("split")
    _refused(step, params, batches[0], _plan(1), r"Colwise\(\) on '0\.attn\.qkv' gives each rank a contiguous 1/tp "
             r"of its output features, and the module cuts that output into parts along them \(split\): this rank's "
             r"24 features into \[8, 8, 8\], at 8, a width the Region divides.*give it Colwise\(fused=<the number "
             r"of blocks>\)")
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _plan(3)), step, sw.Mesh(tp=2), batches, params)


def test_the_real_gpt2_with_a_plain_colwise_on_c_attn_is_refused(build: dict[str, Callable]) -> None:
    """transformers' GPT-2 cuts c_attn's output with split(split_size): gpt2_plan with Colwise() there gave a
    loss of 4.1556 against 4.1529, silently."""
    problem = build["gpt2"](steps=1)
    plan = {**problem.plan, "transformer.h.*.attn.c_attn": sw.tp.Colwise()}
    with pytest.raises(ValueError, match=r"Colwise\(\) on 'transformer\.h\.0\.attn\.c_attn' .*\(split\): this rank's "
                                         r"\d+ features into \[(\d+), \1, \1\], at \1, a width the Region divides"):
        sw.tensor_parallel(problem.step, "tp", plan).plan(sw.Mesh(tp=2), problem.params, problem.batches[0])


def test_grouped_query_blocks_of_unequal_widths_are_refused_either_way() -> None:
    """gpt-fast's wqkv, split([dim, kv, kv]) with 8 query heads and 2 key/value heads: fused=3 cut [16 | 4 | 4]
    as three blocks of 8 (a loss error of 8e-3 on gpt-fast's model), a plain Colwise as contiguous halves;
    both silently."""
    step, params, batches = _problem("sections", heads=8, kv_heads=2)
    plan = _plan(3, local=(), heads=("n_heads", "kv_heads"))
    _refused(step, params, batches[0], plan, r"Colwise\(fused=3\) on '0\.attn\.qkv' gives each rank its 1/tp of each "
             r"of 3 equal blocks .* cuts this rank's 12 features at sizes \[8, 2, 2\] \(split\): not its 3 blocks of "
             r"4.*Blocks of unequal widths .* separate Linear modules")
    _refused(step, params, batches[0], {**plan, "*.attn.qkv": sw.tp.Colwise()},
             r"Colwise\(\) on '0\.attn\.qkv' .*\(split\): this rank's 12 features into \[8, 2, 2\].*blocks of unequal "
             r"widths .* separate Linear modules")


def test_a_layout_per_head_takes_a_plain_colwise() -> None:
    """GPT-NeoX's query_key_value holds q, k and v of head 0, then of head 1, ...: a plain Colwise gives a rank
    whole heads of it, and fused=3 (what the docs said for "a fused q, k, v projection") trained silently
    wrong. Refused, naming the reshape and the plain Colwise."""
    step, params, batches = _problem("per-head")
    plan = _plan(1, local=())
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params)
    _refused(step, params, batches[0], _plan(3, local=()), r"Colwise\(fused=3\) on '0\.attn\.qkv' .* reshapes this "
             r"rank's 24 features into \[2, 12\], not 3 blocks outermost.*A plain Colwise\(\) gives each rank whole "
             r"heads of such a layout")


@pytest.mark.parametrize("layout,local", [("slices", ("n_embd",)), ("blocks-view", ()), ("split", ("n_embd",))])
def test_fused_blocks_cut_apart_are_the_single_device_step(layout: str, local: tuple[str, ...]) -> None:
    """Phi-3's slices at the blocks' edges, a view with the blocks outermost, a split at the divided width."""
    step, params, batches = _problem(layout)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _plan(3, local=local)), step, sw.Mesh(tp=2),
                                 batches, params)


class _Unfused(nn.Module):
    """A Linear whose output goes to the next one whole: it computes no blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def test_fused_blocks_the_module_never_cuts_are_refused() -> None:
    """fused=2 on an output the module never cuts apart: each rank held its halves of two blocks that are
    not there, and the Rowwise after it read them as one contiguous slice."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Unfused()).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(4, D, dtype=torch.float64), torch.randn(4, D, dtype=torch.float64))
    plan = {"0": sw.tp.Region(), "0.up": sw.tp.Colwise(fused=2), "0.down": sw.tp.Rowwise()}
    _refused(step, params, batch, plan, r"Colwise\(fused=2\) on '0\.up' .* the module never cut this rank's 16 "
             r"features into 2 parts along them \(it went to linear\)")
    plan["0.up"] = sw.tp.Colwise()
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), [batch], params)


# -- a loss the model computes itself ---------------------------------------------------------------


class _OwnLossLM(nn.Module):
    """nanoGPT's head: the model computes its cross-entropy in its forward when given targets."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.emb, self.lm_head = nn.Embedding(vocab, D), nn.Linear(D, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        logits = self.lm_head(torch.tanh(self.emb(idx)))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def test_a_model_computing_its_own_cross_entropy_on_split_logits_is_refused() -> None:
    """Was a bare "IndexError: Target 43 is out of bounds" (a target outside the rank's slice of the
    vocabulary), or each rank's part of the loss. Refused by the Plan and by the step, naming the head and
    both fixes; gathered, the model's own loss is the single-device one."""
    torch.manual_seed(0)
    model = _OwnLossLM().double()
    ids = torch.randint(32, (2, 7), generator=torch.Generator().manual_seed(2))
    batch = ({"idx": ids[:, :-1], "targets": ids[:, 1:]}, None)
    chain, params = sw.functionalize(model, example_input=batch[0])
    step = sw.train_step(chain, lambda out, _: out[1], sw.optim.sgd(0.1))
    message = (r"_OwnLossLM computes cross_entropy in its forward, on the logits that Colwise\(output='sharded'\) on "
               r"'lm_head' leaves split over 'tp'.*sw\.tp\.vocab_parallel_cross_entropy\(logits, targets\).*"
               r"Colwise\(output='replicated'\)")
    split = sw.tensor_parallel(step, "tp", {"lm_head": sw.tp.Colwise()})
    with pytest.raises(ValueError, match=message):
        split.plan(sw.Mesh(tp=2), params, batch)
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.launch(lambda: split(split.init(params, sw.Mesh(tp=2)), batch), 2)
    gathered = sw.tensor_parallel(step, "tp", {"lm_head": sw.tp.Colwise(output="replicated")})
    sw.testing.assert_equivalent(gathered, step, sw.Mesh(tp=2), [batch, batch], params)


class _PartialRotaryAttention(nn.Module):
    """Grouped-query attention whose heads rotate their first dims only, split per head (DeepSeek-V3.2's,
    HunYuan's partial rotary): ``split([rot, rest])`` of a head's features, not of the projection's."""

    def __init__(self, d: int = 32, n_heads: int = 4, n_kv: int = 2, hd: int = 8, rot: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.rot = n_heads, n_kv, hd, rot
        self.q_proj = nn.Linear(d, n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv * hd, bias=False)
        self.o_proj = nn.Linear(n_heads * hd, d, bias=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = torch.split(x, [self.rot, self.hd - self.rot], dim=-1)
        t = torch.arange(x.shape[1], dtype=x.dtype)[:, None, None]
        return torch.cat([x_rot * torch.cos(t) + torch.flip(x_rot, [-1]) * torch.sin(t), x_pass], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.rope(self.q_proj(x).view(b, t, -1, self.hd))
        k = self.rope(self.k_proj(x).view(b, t, -1, self.hd))
        v = self.v_proj(x).view(b, t, -1, self.hd)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _GluMLP(nn.Module):
    """A fused gate|up projection that ``F.glu`` halves itself."""

    def __init__(self, d: int = 32, h: int = 16) -> None:
        super().__init__()
        self.wi = nn.Linear(d, 2 * h)
        self.wo = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.glu(self.wi(x), dim=-1))


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x))


def _residual_problem(make: Callable[[], nn.Module]) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Residual(make()), _Residual(make())).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(2, 6, 32, dtype=torch.float64, generator=gen) for _ in range(2)) for _ in range(3)]
    return step, params, batches


def test_a_rank_holding_one_head_cuts_that_heads_features_freely() -> None:
    """With as many key/value heads as ranks, a rank's k_proj output is one head: its per-head view kept
    the projection's width, and the watch took the head's rotary split for a cut of the projection
    (refused; found by this session's review). A per-head view ends what the watch follows."""
    step, params, batches = _residual_problem(_PartialRotaryAttention)
    plan = {"*.inner": sw.tp.Region(heads=("n_heads", "n_kv")), "*.inner.[qkv]_proj": sw.tp.Colwise(),
            "*.inner.o_proj": sw.tp.Rowwise()}
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


def test_glu_cuts_its_input_in_two_a_fused_colwise_fits_and_a_plain_one_is_refused() -> None:
    """F.glu halves the features inside the op: Colwise(fused=2) was refused as never cut (found by this
    session's review), and a plain Colwise there trained another MLP, silently, before the watch too."""
    step, params, batches = _residual_problem(_GluMLP)

    def plan(style: Any) -> dict[str, Any]:
        return {"*.inner": sw.tp.Region(), "*.inner.wi": style, "*.inner.wo": sw.tp.Rowwise()}

    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan(sw.tp.Colwise(fused=2))), step, sw.Mesh(tp=2),
                                 batches, params, rtol=1e-9)
    with pytest.raises(Exception, match=r"cuts that output into parts along them \(glu\)"):
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan(sw.tp.Colwise())), step, sw.Mesh(tp=2),
                                     batches, params, rtol=1e-9)
