"""Under sequence parallel, what a block computes outside its Regions must be position-wise.

Between the Regions each rank holds its slice of the sequence, so a module that mixes positions
there (attention without its Region) sees 1/N of them and trains silently wrong: TinyGPT without
its attention entries was 2.3e-3 off in the loss. Such a step is refused at the Plan and at the
first step (before any update), naming the module and the fix; position-wise code outside the
Regions (a replicated MLP, HF GPT-2's Conv1D folding batch and sequence into rows) still trains
as one device does, and the ready plans are untouched (their equivalence tests hold them).
Tolerances as in test_equivalence.py: float64, 1e-12, a reordering of sums only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.transforms.tensor_parallel import positions

F64_RTOL = 1e-12


def _without(plan: dict[str, Any], part: str) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if part not in k}


def _one_step(step: sw.Step, params: Any, mesh: sw.Mesh, batch: Any) -> None:
    sw.launch(lambda: step(step.init(params, mesh), batch), mesh.size)


@pytest.mark.parametrize(("family", "part", "module", "fix"), [
    ("tiny_gpt", ".attn", r"'blocks\.0\.attn' \(CausalSelfAttention\)",
     r"plan\['blocks\.\*\.attn'\] = sw\.tp\.Region\(heads=\('n_heads',\)\)"),
    ("llama", ".self_attn", r"'model\.layers\.0\.self_attn' \(LlamaAttention\)",
     r"plan\['model\.layers\.\*\.self_attn'\] = sw\.tp\.Region\(heads=\('config\.num_attention_heads', "
     r"'config\.num_key_value_heads'\)\)"),
    ("gpt2", ".attn", r"'transformer\.h\.0\.attn' \(GPT2Attention\)",
     r"plan\['transformer\.h\.\*\.attn'\] = sw\.tp\.Region\(heads=\('num_heads',\), "
     r"local=\('split_size',\)\)"),
])
def test_attention_outside_a_region_is_refused(
    family: str, part: str, module: str, fix: str, build: dict[str, Callable]
) -> None:
    """The plan without its attention entries: the attention runs replicated on the slices."""
    problem = build[family](steps=1)
    plan = _without(problem.plan, part)
    step = sw.tensor_parallel(problem.step, "tp", plan, sequence_parallel=problem.blocks)
    message = (
        module + r" runs on this rank's 1/2 of the sequence .*outside any Region.*and transpose "
        r"acts along dim 1: it does not compute position by position.*train silently wrong; give "
        r"it a Region so that it sees the whole sequence, " + fix + r".* or leave '.*\.\*' out of "
        r"sequence_parallel"
    )
    with pytest.raises(ValueError, match=message):
        step.plan(sw.Mesh(tp=2), problem.params, problem.batches[0])
    with pytest.raises(sw.collectives.RankFailed, match=message):
        _one_step(step, problem.params, sw.Mesh(tp=2), problem.batches[0])


def test_the_same_plan_without_sequence_parallel_trains_equal(build: dict[str, Callable]) -> None:
    """Each rank then has the whole sequence: replicated attention is right."""
    problem = build["tiny_gpt"]()
    step = sw.tensor_parallel(problem.step, "tp", _without(problem.plan, ".attn"))
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


def test_llama_without_its_attention_region_is_refused(build: dict[str, Callable]) -> None:
    """Only the Region dropped: q, k and v gather the sequence themselves, the attention reads
    the slice's length; refused at the reshape by it (sequence_gather.py), never trained."""
    problem = build["llama"](steps=1)
    plan = {k: v for k, v in problem.plan.items() if k != "model.layers.*.self_attn"}
    step = sw.tensor_parallel(problem.step, "tp", plan, sequence_parallel=problem.blocks)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj' sits outside any Region inside "
                                         r"the sequence-parallel block 'model\.layers\.0'"):
        step.plan(sw.Mesh(tp=2), problem.params, problem.batches[0])


@pytest.mark.parametrize("family", ["tiny_gpt", "llama", "gpt2"])
def test_a_replicated_mlp_on_the_slices_trains_equal(
    family: str, build: dict[str, Callable]
) -> None:
    """The MLP left whole runs on each rank's slice: position-wise, so right (GPT-2's Conv1D
    folds batch and sequence into rows and back)."""
    problem = build[family]()
    step = sw.tensor_parallel(problem.step, "tp", _without(problem.plan, ".mlp"),
                              sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, problem.step, sw.Mesh(tp=2), problem.batches, problem.params,
                                 rtol=F64_RTOL)


# -- the rule for each op, on a block followed by hand ----------------------------------------


class _Inner(nn.Module):
    def __init__(self, fn: Callable[[Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Any:
        return self.fn(x)


class _Block(nn.Module):
    def __init__(self, fn: Callable[[Tensor], Any]) -> None:
        super().__init__()
        self.inner = _Inner(fn)

    def forward(self, x: Tensor) -> Any:
        return self.inner(x)


def _conv1d_rows(x: Tensor) -> Tensor:
    """Hugging Face's Conv1D: batch and sequence folded into rows, then back."""
    w, b = torch.randn(8, 6), torch.randn(6)
    return torch.addmm(b, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], 6)


POSITIONWISE: dict[str, Callable[[Tensor], Any]] = {
    "layer_norm": lambda x: F.layer_norm(x, (8,)),
    "rms_norm": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "linear_gelu_dropout": lambda x: F.dropout(F.gelu(F.linear(x, torch.randn(4, 8))), 0.1),
    "matmul_2d": lambda x: x @ torch.randn(8, 3),
    "heads": lambda x: x.view(4, 4, 2, 4).transpose(2, 3).reshape(4, 4, 8),
    "chunk_last": lambda x: torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1),
    "index_last": lambda x: x[..., :3] + x[:, :, 3:6],
    "softmax_last": lambda x: x.softmax(-1).cumsum(-1),
    "conv1d_rows": _conv1d_rows,
    "permute_inner": lambda x: x.unsqueeze(-1).permute(0, 1, 3, 2),
    "metadata": lambda x: x.new_zeros(x.shape[-1]) + x.size(1) + x.dim(),
    # DeepSeek-V3's grouped routing: a mask scattered and scores gathered along the experts, row by row
    "scatter_gather_last": lambda x: torch.zeros_like(x).scatter_(-1, x.topk(2, dim=-1)[1], 1.0).bool().long()
    + x.gather(2, x.argsort(-1)).int(),
}
MIXING: dict[str, tuple[Callable[[Tensor], Any], str]] = {
    "transpose": (lambda x: x.transpose(1, 2), "transpose acts along dim 1"),
    "swap_batch_and_sequence": (lambda x: x.permute(1, 0, 2), "permute acts along dim 0"),
    "sdpa": (lambda x: F.scaled_dot_product_attention(x, x, x), "scaled_dot_product_attention is"),
    "cumsum_over_positions": (lambda x: x.cumsum(1), "cumsum acts along dim 1"),
    "sum_of_all": (lambda x: x.sum(), "sum acts on every dim"),
    "mean_over_positions": (lambda x: x.mean(dim=1), "mean acts along dim 1"),
    "first_positions": (lambda x: x[:, :2], r"indexes the batch or sequence dim"),
    "roll": (lambda x: torch.roll(x, 1, 1), "roll acts along dim 1"),
    "rows_summed": (lambda x: x.flatten(0, 1).sum(0), "sum acts along dim 0"),
    "conv_over_time": (lambda x: F.conv1d(x, torch.randn(4, 4, 3)), "conv1d is not a position"),
    "item": (lambda x: x[:, :, 0].max().item(), "max acts on every dim"),
    "scores": (lambda x: x @ x.transpose(-1, -2), "transpose acts along dim 1"),
    "gather_by_fewer_rows": (lambda x: x.gather(2, torch.zeros(4, 2, 8, dtype=torch.long)),
                             "gather takes an index or values of other batch or sequence dims"),
    "scatter_along_positions": (lambda x: torch.zeros_like(x).scatter(1, torch.zeros(4, 4, 8, dtype=torch.long), x),
                                "scatter acts along dim 1"),
}


def _follow(fn: Callable[[Tensor], Any]) -> Any:
    block = _Block(fn)
    x = torch.randn(4, 4, 8)  # batch 4, 4 positions: a size check alone could not tell them apart
    with positions.following("blk", block, x, 2):
        return block(x)


@pytest.mark.parametrize("name", sorted(POSITIONWISE))
def test_position_wise_ops_pass(name: str) -> None:
    _follow(POSITIONWISE[name])


@pytest.mark.parametrize("name", sorted(MIXING))
def test_ops_that_mix_positions_are_refused_naming_the_module(name: str) -> None:
    fn, why = MIXING[name]
    with pytest.raises(ValueError,
                       match=r"'blk\.inner' \(_Inner\) runs on this rank's 1/2 .*" + why):
        _follow(fn)


def test_a_gathered_sequence_is_whole() -> None:
    """What a Region's all-gather of the sequence makes may mix positions; a scatter's may not."""
    def fn(x: Tensor) -> Tensor:
        whole = positions.collective(lambda: torch.cat([x, x], 1), x, "all_gather", 1)
        whole.transpose(1, 2)
        part = positions.collective(lambda: whole.narrow(1, 0, 4).clone(), whole, "psum_scatter", 1)
        return part.transpose(1, 2)

    with pytest.raises(ValueError, match=r"transpose acts along dim 1"):
        _follow(fn)
