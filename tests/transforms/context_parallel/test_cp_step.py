"""sw.context_parallel as a step: equal to the single-device step, its Plan what runs, its errors.

float64 on thread ranks. Ring attention merges the key blocks by an online softmax, Ulysses attends
whole sequences in another shard order, and every gradient's cp parts are summed, so results agree
with the single device to rounding (assert_equivalent's float64 default). The ledger must equal the
Plan exactly: every message's shape follows from the batch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing.models import CausalSelfAttention, TinyGPT
from shardwise.transforms.context_parallel import context_parallel

VOCAB, SEQ = 16, 16


def gpt(seed: int = 0, n_heads: int = 4) -> tuple[sw.Step, Any]:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=n_heads, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(n: int = 2, size: int = 4, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (size, seq + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))  # targets shifted on the whole sequence, before the cut
    return out


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_alone_equals_the_single_device_step(cp: int, attention: str) -> None:
    step, params = gpt()
    composed = context_parallel(step, "cp", attention=attention)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=cp), batches(), params)


def test_unbalanced_ring_equals_the_single_device_step() -> None:
    step, params = gpt()
    composed = context_parallel(step, "cp", balanced=False)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2), batches(), params)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_dp_by_cp_with_zero_equals_the_single_device_step(attention: str, stage: int) -> None:
    step, params = gpt()
    composed = sw.shard_params(context_parallel(step, "cp", attention=attention), "dp", stage)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, cp=2), batches(), params)


def test_token_weighted_loss_counts_the_global_tokens() -> None:
    """Padded labels give the ranks' parts different counts: the step divides by the global count."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=1, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def counted(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (targets != -100).sum()

    step = sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted)
    data = []
    for inputs, targets in batches():
        targets = targets.clone()  # a view of the inputs' ids
        targets[:, : SEQ // 4 + 1] = -100  # rank 0's first chunk and one of rank 1's: unequal counts
        data.append((inputs, targets))
    sw.testing.assert_equivalent(context_parallel(step, "cp"), step, sw.Mesh(cp=2), data, params)


def _ledger(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[list[tuple[str, str, str, int]]]:
    def run() -> list[tuple[str, str, str, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    return sw.launch(run, mesh.size, timeout=120)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("mesh", [sw.Mesh(cp=4), sw.Mesh(dp=2, cp=2)], ids=str)
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(mesh: sw.Mesh, attention: str) -> None:
    step, params = gpt()
    cp = context_parallel(step, "cp", attention=attention)
    if "dp" in mesh.axis_names:
        cp = sw.shard_params(cp, "dp", 2)
    batch = batches(1)[0]
    plan = cp.plan(mesh, params, batch)
    want_op = "ppermute" if attention == "ring" else "all_to_all"
    assert any(c.op == want_op and c.axis == "cp" for c in plan.collectives(0))
    for rank, got in enumerate(_ledger(cp, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


def test_ring_plan_bytes_are_the_key_value_slices() -> None:
    """2 blocks x (cp - 1) passes each way of [2, batch, heads, seq / cp, head_dim] float64."""
    step, params = gpt()
    cp = 4
    plan = context_parallel(step, "cp").plan(sw.Mesh(cp=cp), params, batches(1)[0])
    sends = [c.nbytes for c in plan.collectives(0) if c.op == "ppermute"]
    assert sends == [2 * 4 * 4 * (SEQ // cp) * 4 * 8] * (2 * 2 * (cp - 1))


def test_a_sequence_the_chunks_do_not_divide_is_refused() -> None:
    step, params = gpt()
    bad = batches(1, seq=SEQ - 2)  # 14 tokens: not 2 x 2 chunks
    with pytest.raises(ValueError, match=r"length 14 does not cut into 2 x 2 chunks .*pad it to a multiple of 4"):
        context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, bad[0])
    with pytest.raises(ValueError, match=r"length 14 does not cut into 4 chunks"):
        context_parallel(step, "cp", balanced=False).plan(sw.Mesh(cp=4), params, bad[0])


def test_ulysses_refuses_heads_the_axis_does_not_divide() -> None:
    step, params = gpt(n_heads=2)
    composed = context_parallel(step, "cp", attention="ulysses")
    with pytest.raises(ValueError, match=r"blocks.0: blocks.0.attn has 2 heads, which the 4 ranks of axis 'cp'"):
        composed.plan(sw.Mesh(cp=4), params, batches(1)[0])


def test_a_chain_without_attention_is_refused() -> None:
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="no attention module it can split"):
        context_parallel(step, "cp")


class OtherAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, x, x, need_weights=False)[0]


class SomeAttention(OtherAttention):
    pass


def test_an_attention_it_cannot_split_is_refused_by_name() -> None:
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(8, 8), SomeAttention()))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"holds the attention .*SomeAttention.*cannot split over the sequence"):
        context_parallel(step, "cp")


def test_bad_options_are_refused() -> None:
    step, _ = gpt()
    with pytest.raises(ValueError, match=r"attention='flash'.*\('ring', 'ulysses'\)"):
        context_parallel(step, "cp", attention="flash")
    with pytest.raises(TypeError, match="axis is a mesh axis name"):
        context_parallel(step, "")


def test_composition_rules() -> None:
    step, _ = gpt()
    cp = context_parallel(step, "cp")
    with pytest.raises(ValueError, match=r"context_parallel and pipeline both use axis 'cp'"):
        sw.pipeline(cp, "cp", schedule="gpipe", microbatches=2)
    with pytest.raises(ValueError, match=r"context_parallel and shard_params both use axis 'cp'"):
        sw.shard_params(cp, "cp", 1)


def test_cp_with_mixed_precision_and_remat_equals_the_same_policy_on_one_device() -> None:
    step, params = gpt()
    policy = "params=f64,compute=f64,output=f64"
    reference = sw.mixed_precision(step, policy)
    composed = sw.remat(sw.mixed_precision(context_parallel(step, "cp"), policy))
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(cp=2), batches(), params)


def test_cp_with_zero_stage_2_and_accumulation_equals_the_single_device_step() -> None:
    step, params = gpt()
    composed = sw.shard_params(context_parallel(step, "cp", attention="ulysses"), "dp", 2, accumulation=2)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, cp=2), batches(), params)


class RenamedPositions(TinyGPT):
    """TinyGPT with its position table under another name (BERT's): context_parallel's default
    positions=("pos_emb",) does not list it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.position_embeddings = self._parameters.pop("pos_emb")

    @property  # type: ignore[override]
    def pos_emb(self) -> torch.Tensor:  # what TinyGPT.forward reads
        return self.position_embeddings


def test_a_position_table_positions_does_not_list_is_refused_and_listed_it_trains_right() -> None:
    torch.manual_seed(0)
    model = RenamedPositions(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9))
    # Read at each rank's local positions it would train another model, without an error.
    with pytest.raises(ValueError, match=r"'position_embeddings', named like a learned position table.*"
                                         r"positions=\(\.\.\., 'position_embeddings'\)"):
        context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches(1)[0])
    listed = context_parallel(step, "cp", positions=("position_embeddings",))
    sw.testing.assert_equivalent(listed, step, sw.Mesh(cp=2), batches(), params)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_plans_kept_for_backward_is_what_a_run_keeps(cp: int, attention: str) -> None:
    """The Plan runs the attention on fake tensors, which keep nothing of the ring's key/value slices
    unless the prediction says what the run keeps. Measured: the tensors a real run saves for backward
    (saved-tensor hooks, per storage) plus the ring's merged output, which its blocks hold outside
    autograd. The Plan's figure is the rank that keeps the most: Ulysses' ranks keep alike; the ring's
    last index merges the most blocks; index i makes one block and one merge fewer for each of the
    cp - 1 - i indices after it (their slices only its late chunk sees: one block, not two), so it keeps
    3 (cp - 1 - i) fewer [batch, heads, SEQ / 2cp] rows of log-sum-exps and merge weights.
    """
    from shardwise.engine.plan.accounting import kept_for_backward

    step, params = gpt()
    composed, mesh = context_parallel(step, "cp", attention=attention), sw.Mesh(cp=cp)
    batch = batches(1)[0]
    planned = composed.plan(mesh, params, batch).memory["kept_for_backward"]

    def run() -> int:
        spec = next(s for s in composed.transforms if s.name == "context_parallel")
        inputs = spec.cut_sequence(batch, rank=None, mesh=mesh)[0]
        view = composed.compute_view(composed.local_view(params, mesh, 0))
        with mesh:
            return sum(kept_for_backward(composed.chain, view, inputs).values())

    merged = 2 * 4 * 4 * (SEQ // cp) * 4 * 8 if attention == "ring" else 0  # 2 layers' [4, 4, SEQ / cp, 4]
    for rank, measured in enumerate(sw.launch(run, cp, timeout=60)):
        fewer_rows = 0 if attention == "ulysses" else 2 * 4 * 4 * 3 * (cp - 1 - rank) * (SEQ // (2 * cp)) * 8
        assert planned[rank] == measured + merged + fewer_rows, (rank, planned[rank], measured + merged)


class NormedAttention(CausalSelfAttention):
    """TinyGPT's attention with a q_norm: qkv, proj, head_dim and the causal mask, so it looks known."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int) -> None:
        super().__init__(d_model, n_heads, seq_len)
        self.q_norm = nn.LayerNorm(d_model // n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(self.q_norm(q), k, v, attn_mask=self.mask[:t, :t])
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def test_a_known_looking_attention_with_a_module_its_forward_leaves_out_is_refused() -> None:
    """The installed forward is TinyGPT's: it left the q_norm out and trained another model without an
    error (the loss differed from the single device's by 6e-3 relative). Refused, naming the module."""
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(8, 8), NormedAttention(8, 2, 16)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"\(NormedAttention\) holds q_norm, which the forward it installs"):
        context_parallel(step, "cp")


@pytest.mark.parametrize("name", ["positional_embedding", "position_embedding_table", "abs_pos_emb"])
def test_a_position_table_named_outside_the_known_names_is_refused(name: str) -> None:
    """CLIP's positional_embedding (and Karpathy's position_embedding_table, abs_pos_emb) were not among the
    known names: read at each rank's local positions, the step trained another model without an error (the
    loss differed from the single device's by 5e-3 relative). Refused, with the fix; listed, it trains right."""

    class Named(TinyGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            setattr(self, name, self._parameters.pop("pos_emb"))

        @property  # type: ignore[override]
        def pos_emb(self) -> torch.Tensor:
            return getattr(self, name)

    torch.manual_seed(0)
    model = Named(vocab=VOCAB, d_model=16, n_heads=4, n_layers=1, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=rf"'{name}', named like a learned position table"):
        context_parallel(step, "cp")
    if name == "positional_embedding":
        sw.testing.assert_equivalent(context_parallel(step, "cp", positions=(name,)), step, sw.Mesh(cp=2), batches(),
                                     params)


def test_a_second_call_on_the_same_chain_reads_the_tables_its_own_positions_list() -> None:
    """The chain's attentions and tables were remembered per chain, not per positions=: a first call that
    missed a table (under a name nothing recognises) made a second call listing it read it at local
    positions too, another model without an error (loss off by 5e-3 relative)."""

    class Named(TinyGPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.table = self._parameters.pop("pos_emb")

        @property  # type: ignore[override]
        def pos_emb(self) -> torch.Tensor:
            return self.table

    torch.manual_seed(0)
    model = Named(vocab=VOCAB, d_model=16, n_heads=4, n_layers=1, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9))
    context_parallel(step, "cp")  # "table" is no name it knows: read at local positions, as the user wrote
    sw.testing.assert_equivalent(context_parallel(step, "cp", positions=("table",)), step, sw.Mesh(cp=2), batches(),
                                 params)
