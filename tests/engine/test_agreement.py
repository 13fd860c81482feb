"""Step.init refuses ranks that built different steps, naming the ranks and what differs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.engine.run.agreement import stable_text
from shardwise.testing.models import mlp


def _base() -> tuple[sw.Step, dict]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


def test_a_rank_with_another_stack_is_named() -> None:
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        stage = 3 if mesh.axis_index("dp") == 0 else 2  # rank 1 read its flag differently
        sw.shard_params(base, "dp", stage).init(params, mesh)

    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its transform stack"):
        sw.launch(build, 2)


def test_a_rank_with_another_schedule_or_seed_is_named() -> None:
    base, params = _base()

    def schedule() -> None:
        mesh = sw.Mesh(pp=2)
        name = "gpipe" if mesh.axis_index("pp") == 0 else "1f1b"
        sw.pipeline(base, "pp", name, 2).init(params, mesh)

    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its transform stack, schedule"):
        sw.launch(schedule, 2)

    def seed() -> None:
        mesh = sw.Mesh(dp=2, pp=2)
        step = sw.shard_params(sw.pipeline(base, "pp", "1f1b", 2), "dp", 3)
        step.init(params, mesh, seed=mesh.rank // 3)  # rank 3 alone

    with pytest.raises(sw.collectives.RankFailed, match=r"rank 3 differs from rank 0 in its seed"):
        sw.launch(seed, 4)


def test_ranks_that_start_from_other_weights_are_named() -> None:
    """What ranks that build the model themselves without seeding alike get."""
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        mine = {k: {n: t + mesh.axis_index("dp") for n, t in v.items()} for k, v in params.items()}
        sw.shard_params(base, "dp", 3).init(mine, mesh)

    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its parameter values"):
        sw.launch(build, 2)


def _train_gpt_built_in_each_rank() -> tuple[float, list[float]]:
    """Each rank seeds torch and builds the model itself (no model passed in): thread ranks start one
    at a time, up to their first collective, so none draws from the shared generator meanwhile."""
    from shardwise.testing.models import Block, TinyGPT

    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8), units=Block)
    step = sw.shard_params(
        sw.train_step(chain, lambda o, y: torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten()),
                      sw.optim.sgd(0.1)),
        "dp",
    )
    mesh = sw.Mesh(dp=4)
    state = step.init(params, mesh)  # refuses ranks that built different models
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        state, metrics = step(state, (ids, ids))
        losses.append(float(metrics["loss"]))
    return float(sum(t.sum() for t in step.full_params(state)["blocks.0"].values())), losses


def test_thread_ranks_that_build_the_model_themselves_agree_run_to_run() -> None:
    first = sw.launch(_train_gpt_built_in_each_rank, 4, timeout=120)
    second = sw.launch(_train_gpt_built_in_each_rank, 4, timeout=120)
    assert len({repr(r) for r in first}) == 1  # every rank the same
    assert first == second  # bitwise, run to run


def _with_optimizer(optimizer_of: Callable[[int], sw.optim.Optimizer]) -> None:
    """Rank r builds the ZeRO step with ``optimizer_of(r)``."""
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        step = dataclasses.replace(base, optimizer=optimizer_of(mesh.rank))
        sw.shard_params(step, "dp", 3).init(params, mesh)

    sw.launch(build, 2, timeout=30)


def test_a_rank_with_another_learning_rate_is_named() -> None:
    expected = (r"rank 1 differs from rank 0 in its optimizer \(optimizer: .*lr=0\.2.* "
                r"where rank 0 has .*lr=0\.1")
    with pytest.raises(sw.collectives.RankFailed, match=expected):
        _with_optimizer(lambda rank: sw.optim.sgd(0.1 if rank == 0 else 0.2, momentum=0.9))


def test_a_rank_with_another_momentum_or_schedule_is_named() -> None:
    expected = (r"rank 1 differs from rank 0 in its optimizer \(optimizer: .*momentum=0\.5.* "
                r"where rank 0 has .*momentum=0\.9")
    with pytest.raises(sw.collectives.RankFailed, match=expected):
        _with_optimizer(lambda rank: sw.optim.sgd(0.1, momentum=0.9 if rank == 0 else 0.5))
    with pytest.raises(sw.collectives.RankFailed, match=r"in its optimizer .*warmup_steps=20"):
        _with_optimizer(lambda r: sw.optim.adamw(sw.optim.warmup_cosine(1e-3, 10 + 10 * r, 100)))


def test_a_rank_with_another_loss_or_clipping_is_named() -> None:
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        loss = torch.nn.functional.mse_loss if mesh.rank == 0 else torch.nn.functional.l1_loss
        step = dataclasses.replace(base, loss_fn=loss, clip_norm=1.0 + mesh.rank)
        sw.shard_params(step, "dp", 3).init(params, mesh)

    expected = (r"rank 1 differs from rank 0 in its loss function, gradient clipping "
                r"\(loss function: .*l1_loss.* where rank 0 has .*mse_loss.*; "
                r"gradient clipping: '2\.0' where rank 0 has '1\.0'\)")
    with pytest.raises(sw.collectives.RankFailed, match=expected):
        sw.launch(build, 2, timeout=30)


def test_ranks_that_built_the_same_optimizer_and_loss_themselves_agree() -> None:
    base, params = _base()

    def build() -> int:
        mesh = sw.Mesh(dp=2)
        lr = 0.1  # a closure and a schedule, built on every rank: the same text, no addresses
        step = dataclasses.replace(
            base, loss_fn=lambda o, y: torch.nn.functional.mse_loss(o, y) * lr,
            optimizer=sw.optim.adamw(
                sw.optim.join([sw.optim.constant(lr), sw.optim.linear(lr, 0.0, 10)], [5])
            ),
        )
        return sw.shard_params(step, "dp", 3).init(params, mesh).step

    assert sw.launch(build, 2, timeout=30) == [0, 0]


def test_stable_text_has_no_addresses_and_sees_closures() -> None:
    def scaled(k: float) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: x * k

    assert stable_text(scaled(2.0)) == stable_text(scaled(2.0)) != stable_text(scaled(3.0))
    texts = stable_text(sw.optim.sgd(0.1, momentum=0.9)) + stable_text(torch.nn.CrossEntropyLoss())
    assert " at 0x" not in texts
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    assert stable_text(smoothed) != stable_text(torch.nn.CrossEntropyLoss())


def test_a_function_with_a_set_literal_reads_alike_in_processes_of_other_hash_seeds() -> None:
    """A set literal compiles to a frozenset constant, whose repr's order follows string hashing: ranks
    started with other PYTHONHASHSEEDs (torchrun's, spawned processes) were refused as building other
    losses, at init and at every step."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from shardwise.engine.run.agreement import stable_text\n"
        "def loss(out, y, reduction='mean'):\n"
        "    assert reduction in {'mean', 'avg', 'default', 'sum', 'none', 'batchmean'}\n"
        "    return torch.nn.functional.mse_loss(out, y)\n"
        "print(stable_text(loss))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    texts = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}).stdout
        for seed in ("1", "2", "3")
    }
    assert len(texts) == 1, texts


def test_a_rank_that_resumes_with_another_learning_rate_or_clipping_is_named(tmp_path: Path) -> None:
    """sw.checkpoint.load builds the state without step.init, so it skipped the check: a rank resuming with
    another learning rate (or clipping) trained on, at ZeRO-1 each rank updating its own shard with its own
    (every rank then held the same, half-wrong parameters: no error). It checks as init does."""
    base, params = _base()
    path = str(tmp_path) + "/ckpt"
    step = sw.shard_params(base, "dp", 1)
    sw.launch(lambda: sw.checkpoint.save(path, step.init(params, sw.Mesh(dp=2)), step), 2)

    def resume(changed: Callable[[int], sw.Step]) -> None:
        mesh = sw.Mesh(dp=2)
        sw.checkpoint.load(path, sw.shard_params(changed(mesh.rank), "dp", 1), mesh)

    sw.launch(lambda: resume(lambda rank: base), 2, timeout=30)  # the same step: loads
    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its optimizer .*lr=0\.2"):
        sw.launch(lambda: resume(lambda r: dataclasses.replace(base, optimizer=sw.optim.sgd(0.1 + 0.1 * r))), 2,
                  timeout=30)
    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its gradient clipping"):
        sw.launch(lambda: resume(lambda r: dataclasses.replace(base, clip_norm=None if r == 0 else 0.5)), 2,
                  timeout=30)
