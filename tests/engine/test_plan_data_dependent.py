"""A model that reads data to decide a shape plans, under context_parallel, shard_params and pipeline.

The plain ``TopKMoE`` forward (HF's loop: ``torch.where(chosen == e)`` per expert) cannot run on fake
tensors, which the Plan's predictions use (what each layer keeps for backward; the collectives a
split's layers issue inside their compute). Such a layer runs on real zero-filled stand-ins instead,
its gradients passed through so that the backward still runs through it: the Plan lists every
collective the run issues (the ledger equals it), and the step equals the single-device step. Under
a pipeline the stage boundaries stay unpredicted (their transfers announce their shapes), as before.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import TinyGPT, TopKMoE
from shardwise.transforms.context_parallel import context_parallel

VOCAB, SEQ = 16, 16


class MoEGPT(TinyGPT):
    """TinyGPT whose blocks' MLPs are plain TopKMoE (4 experts, top 2), not split by expert_parallel."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            block.mlp = TopKMoE(kwargs["d_model"], 2 * kwargs["d_model"], num_experts=4, top_k=2)


def moe_gpt() -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = MoEGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    loss = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params


def batches(n: int = 2, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _ledger(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[list[tuple[str, str, str, int]]]:
    def run() -> list[tuple[str, str, str, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    return sw.launch(run, mesh.size, timeout=120)


STACKS = {
    "cp2-ring": (lambda s: context_parallel(s, "cp"), sw.Mesh(cp=2)),
    "cp2-ulysses": (lambda s: context_parallel(s, "cp", attention="ulysses"), sw.Mesh(cp=2)),
    "dp2-zero3": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2)),
    "pp2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_plain_moe_loop_plans_its_ledger_is_the_plan_and_it_equals_one_device(stack: str) -> None:
    step, params = moe_gpt()
    transform, mesh = STACKS[stack]
    composed, data = transform(step), batches()
    plan = composed.plan(mesh, params, data[0])
    assert all(n > 0 for n in plan.memory["kept_for_backward"])
    stood_in = {layer for layer, notes in plan.layers.items() if any("zero-filled stand-ins" in n for n in notes)}
    assert stood_in == {"blocks.0", "blocks.1"}, plan.layers  # the Plan says which figures are the stand-ins'
    if stack == "pp2":  # stage boundaries are not predicted on stand-ins (a shape there may depend on the
        # data): the transfers announce their shapes at run time, and the Plan says their bytes are unknown
        # ... and says why (it told the user to pass the parameters and a batch, which they had)
        unknown = (r"send_activation\(stage0, mb=0, to=1\) on rank 0: its payload is unknown: the pipeline's stage "
                   r"boundary was not predicted, since a layer before it could not run on fake tensors \(blocks.0, ")
        with pytest.raises(ValueError, match=unknown):
            list(plan.collectives(0))
        link = sw.plan.PlanCosts(comm=sw.plan.CommModel.link(bandwidth=1e9, latency=1e-6))
        with pytest.raises(ValueError, match=r"carries a payload the plan does not know \(the pipeline's stage bound"):
            sw.simulate(plan, link)
        sw.testing.assert_equivalent(composed, step, mesh, data, params)
        return
    for rank, got in enumerate(_ledger(composed, mesh, params, data[0])):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"
    if stack.startswith("cp"):  # the blocks' attention (beside the MoE loop in one layer) was predicted
        assert any(c.axis == "cp" for c in plan.collectives(0))
    sw.testing.assert_equivalent(composed, step, mesh, data, params)


def test_a_layer_on_stand_ins_keeps_its_backward_collectives_in_the_plan() -> None:
    """Ring attention's backward sends run inside the layer that also holds the MoE loop: the
    stand-ins pass gradients through, so the Plan's backward lists them (cp - 1 per layer each way)."""
    step, params = moe_gpt()
    plan = context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches(1)[0])
    ring = [c for c in plan.collectives(0) if c.op == "ppermute"]
    assert len(ring) == 2 * 2 * 1  # 2 layers x (forward, backward) x (cp - 1)


class _ReadsItsGradients:
    """A user's optimizer whose update reads a value (``float`` of a tensor) to decide its step: fake
    tensors cannot run it."""

    def init(self, params: Any) -> dict[str, torch.Tensor]:
        return {"count": torch.zeros(())}

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        lr = 0.1 if float(sum(g.abs().sum() for g in optree.tree_leaves(grads))) < 1e3 else 0.01
        return optree.tree_map(lambda p, g: p - lr * g, params, grads), state


def test_an_update_that_reads_its_values_plans_and_says_its_figure_is_a_guess() -> None:
    """The Plan predicts the update's memory on fake tensors; one that reads a value there is counted
    as an out-of-place update's new parameters and state, and the Plan says so (it still plans, and
    the step runs)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                         torch.nn.Linear(16, 4)))
    step = sw.pipeline(sw.train_step(chain, F.mse_loss, _ReadsItsGradients()), "pp", "1f1b", microbatches=2)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    plan = step.plan(sw.Mesh(pp=2), params, batch)
    held = [sum(t.nbytes for t in params[layer].values()) + 4 for layer in ("0", "2")]  # and the state's count
    assert list(plan.memory["update_buffers"]) == held
    assert all("update_buffers counts its new parameters" in plan.layers[n][-1] for n in ("0", "2")), plan.layers


def test_the_search_marks_pipeline_bytes_the_plan_does_not_know() -> None:
    """A pipeline's sends after a layer on stand-ins count 0 bytes: the table showed the pp column as
    if they were all it sends. Such an axis is now marked ``+?`` and the table says what that means."""
    from shardwise.plan_search import FlopCompute, Space, params_per_layer

    step, params = moe_gpt()
    batch = batches(1)[0]
    found = sw.search(step, params, batch, world=2, memory_per_rank="1GB", top=10, prune=False,
                      compute=FlopCompute(params_per_layer(step, params), 1e9, 4, SEQ),
                      space=Space(zero_stages=(1,), schedules=("1f1b",), microbatches=(2,), remat=(None,)))
    marks = {str(p.candidate): p.unknown_bytes_on for p in found.ranked}
    assert marks == {"dp2 zero1": (), "pp2 1f1b mb2": ("pp",)}, found.table()
    assert "+?: and transfers whose payload the plan does not know" in found.table()
    assert next(p for p in found.ranked if p.unknown_bytes_on).as_dict()["bytes_unknown_on"] == ["pp"]


class _Temperature(torch.nn.Module):
    """A learned scalar (0-d parameter), as CLIP's logit scale."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_a_scalar_parameter_plans_and_the_plan_counts_its_update(optimizer: str) -> None:
    # The update's prediction took every 0-d tensor of the optimizer state for the update count and
    # made it an int: a 0-d parameter's moments too, and the foreach ops raised a TypeError.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Temperature(), torch.nn.Linear(4, 2)).double()
    chain, params = sw.functionalize(model)
    opt = sw.optim.adamw(1e-3) if optimizer == "adamw" else sw.optim.sgd(0.1, momentum=0.9)
    step = sw.train_step(chain, F.mse_loss, opt)
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))
    for planned in (step, sw.shard_params(step, "dp", stage=1)):
        mesh = None if planned is step else sw.Mesh(dp=2)
        plan = planned.plan(mesh, params, batch)
        assert plan.memory["update_buffers"][0] > 0, plan.memory  # predicted, not guessed:
        assert not any("update_buffers counts" in note for notes in plan.layers.values() for note in notes)


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _TrimmedToLongest(torch.nn.Module):
    """Trims its batch to the longest row's length (``int(mask.sum(1).max())``), then embeds and pools."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(_Residual() for _ in range(2))
        self.out = torch.nn.Linear(16, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        length = int(batch["mask"].sum(1).max())
        x = self.emb(batch["ids"][:, :length])
        for block in self.blocks:
            x = block(x)
        return self.out(x[:, 0])


@pytest.mark.parametrize("stack", ["one device", "zero3 dp2", "pipeline pp2"])
def test_a_layer_reading_the_batch_to_decide_a_shape_reads_the_batchs_values_in_the_plan(stack: str) -> None:
    """The Plan ran such a layer on zero-filled stand-ins, though it was given the batch: a zero mask trims to
    length 0, and the Plan raised the model's own IndexError where the step runs (and equals one device). The
    batch's tensors stand in for themselves now."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (4, 8), generator=gen)
    mask = torch.zeros_like(ids)
    for row, length in enumerate([8, 3, 5, 2]):
        mask[row, :length] = 1
    batch = ({"ids": ids, "mask": mask}, torch.randn(4, 3, generator=gen, dtype=torch.float64))
    chain, params = sw.functionalize(_TrimmedToLongest().double(), units=["blocks"], example_input=batch[0])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    mesh = None
    if stack == "zero3 dp2":
        step, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    elif stack == "pipeline pp2":
        step, mesh = sw.pipeline(step, "pp", "1f1b", microbatches=2), sw.Mesh(pp=2)
    plan = step.plan(mesh, params, batch)
    assert sum(plan.memory["kept_for_backward"]) > 0  # (a pipeline's first stage keeps only integer ids)
    if mesh is not None:
        sw.testing.assert_equivalent(step, sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), mesh, [batch] * 2,
                                     params)
