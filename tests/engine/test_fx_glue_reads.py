"""torch.fx runs the code between units once, at functionalize (engine/model/glue_reads.py): a module global
it reads that the loop changes later, an attribute it writes, and a host random draw are refused rather than
trained as the trace left them; the same reads inside a unit run as written."""

from __future__ import annotations

import copy
import pickle
import random
import sys
import types

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import shardwise as sw

SCALE = 2.0  # a curriculum's scale, changed by the loop: read in the glue or in a unit


class Block(nn.Module):
    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.lin, self.reads = nn.Linear(8, 8), reads

    def forward(self, x: Tensor) -> Tensor:
        if self.reads:
            x = x * SCALE
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, glue_reads: bool) -> None:
        super().__init__()
        self.glue_reads = glue_reads
        self.inp, self.b0, self.out = nn.Linear(4, 8), Block(not glue_reads), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.glue_reads and SCALE > 1.5:  # a branch on the global, traced once
            h = torch.relu(h) * SCALE
        return self.out(self.b0(h))


def _train(glue_reads: bool, world: int) -> tuple[list[float], list[float]]:
    """Losses of three steps of torch and of the step (ZeRO-3 over ``world`` ranks, one device for 1), the
    loop setting SCALE to 1.0 from the third step on."""
    global SCALE
    torch.manual_seed(0)
    model = Net(glue_reads).double()
    reference = copy.deepcopy(model)
    chain, params = sw.functionalize(model, units=["inp", "b0", "out"])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
                torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(3)]
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    if world > 1:
        step = sw.shard_params(step, "dp", stage=3)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    try:
        for i, (x, y) in enumerate(batches):
            SCALE = 2.0 if i < 2 else 1.0
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(reference(x), y)
            loss.backward()
            optimizer.step()
            expected.append(loss.item())

        def main() -> list[float]:
            global SCALE
            state, losses = step.init(params, sw.Mesh(dp=world) if world > 1 else None), []
            for i, batch in enumerate(batches):
                SCALE = 2.0 if i < 2 else 1.0
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
            return losses

        return expected, sw.launch(main, world=world)[0]
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("world", [1, 2])
def test_a_global_the_traced_glue_read_is_refused_once_the_loop_changes_it(world: int) -> None:
    with pytest.raises(sw.collectives.RankFailed, match=r"a layer of Net: the code between units that torch.fx "
                       r"traced at functionalize reads the global 'SCALE' \(of .*\), which was 2.0 then and is 1.0 "
                       r"now.*Read it inside a unit"):
        _train(glue_reads=True, world=world)


@pytest.mark.parametrize("world", [1, 2])
def test_a_global_a_unit_reads_follows_the_loop_as_in_torch(world: int) -> None:
    expected, got = _train(glue_reads=False, world=world)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_an_unchanged_global_trains_and_the_check_survives_a_pickle() -> None:
    global SCALE
    torch.manual_seed(0)
    model = Net(glue_reads=True)
    chain, params = sw.functionalize(model, units=["inp", "b0", "out"])
    x = torch.randn(3, 4)
    assert torch.equal(chain(params, x), model(x))
    copied = pickle.loads(pickle.dumps(chain))  # as a process rank receives it
    SCALE = 1.0
    try:
        with pytest.raises(RuntimeError, match="reads the global 'SCALE'"):
            copied(params, x)
    finally:
        SCALE = 2.0


class LayerDropModuleList(nn.ModuleList):
    """fairseq's: draws with torch in ``__iter__``, which fx runs for real at the trace."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        probs = torch.empty(len(self)).uniform_()
        for i, m in enumerate(super().__iter__()):
            if not self.training or probs[i] > -1.0:  # never drops: only the draw matters
                yield m


class LayerDrop(nn.Module):
    """Decides in the root's loop over its blocks whether to run each: traced, one decision for every step."""

    def __init__(self, draws: str) -> None:
        super().__init__()
        self.draws = draws
        blocks = [Block(False) for _ in range(3)]
        self.blocks = LayerDropModuleList(blocks) if draws == "torch" else nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.draws != "torch":
                draw = np.random.rand() if self.draws == "numpy" else random.random()
                if self.training and draw < 0.0:  # never drops: only the draw matters
                    continue
            x = block(x)
        return x


@pytest.mark.parametrize("draws", ["python", "numpy", "torch"])
def test_a_random_draw_the_trace_makes_is_refused_and_the_generators_put_back(draws: str) -> None:
    model = LayerDrop(draws)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    with pytest.raises(sw.FunctionalizeError, match=r"LayerDrop.*draws random numbers that torch.fx does not "
                       r"trace.*Draw inside a unit.*put back"):
        sw.functionalize(model, units=Block)
    assert random.getstate() == python and torch.equal(torch.random.get_rng_state(), torch_state)
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(np.random.get_state(), numpy_state, strict=True))


_PACKAGE = {
    "__init__.py": "",
    "conf.py": "SCALE = 2.0\n",
    "helpers.py": "FACTOR = 2.0\n\n\ndef scale(h):\n    return h * FACTOR\n",
    "model.py": '''
import dataclasses
import math
import torch
from torch import nn
from . import conf as C
from .helpers import scale


@dataclasses.dataclass
class Config:
    scale: float = 2.0


CFG = {"scale": 2.0}
cfg = Config()
STATS = {"calls": 0}


class Settings:
    SCALE = 2.0


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.nn.functional.relu(self.inp(x)) * math.pi
        STATS["calls"] += 1  # the code's own count, changed by the trace: not a setting
        if self.how == "module":
            h = h * C.SCALE
        elif self.how == "dict":
            h = h * CFG["scale"]
        elif self.how == "dataclass":
            h = h * cfg.scale
        elif self.how == "class":
            h = h * Settings.SCALE
        elif self.how == "helper":
            h = scale(h)
        return self.out(self.mid(h))
''',
}


def _changed_setting(package: str, how: str) -> None:
    import importlib

    model = importlib.import_module(f"{package}.model")
    if how == "module":
        importlib.import_module(f"{package}.conf").SCALE = 1.0
    elif how == "dict":
        model.CFG["scale"] = 1.0
    elif how == "dataclass":
        model.cfg.scale = 1.0
    elif how == "class":
        model.Settings.SCALE = 1.0
    else:
        importlib.import_module(f"{package}.helpers").FACTOR = 1.0


_SHOWN = {"module": "'C.SCALE'", "dict": "\"CFG\\['scale'\\]\"", "dataclass": "'cfg.scale'",
          "class": "'Settings.SCALE'", "helper": "'FACTOR'"}


@pytest.mark.parametrize("how", ["module", "dict", "dataclass", "class", "helper"])
def test_a_setting_read_through_a_global_or_in_a_helper_file_is_refused_once_changed(
    how: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``C.SCALE`` of an imported config module, ``CFG["scale"]``, a config dataclass's field, a class's
    attribute, and a global read by a helper in another file of the model's package: each traced once."""
    import importlib

    package = f"glue_pkg_{how}"
    (tmp_path / package).mkdir()
    for name, text in _PACKAGE.items():
        (tmp_path / package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        torch.manual_seed(0)
        net = importlib.import_module(f"{package}.model").Net(how)
        chain, params = sw.functionalize(net, units=["inp", "mid", "out"])
        x = torch.randn(3, 4)
        assert torch.equal(chain(params, x), net(x))  # unchanged, and the code's own count: no refusal
        copied = pickle.loads(pickle.dumps(chain))
        _changed_setting(package, how)
        for traced in (chain, copied):
            with pytest.raises(RuntimeError, match=rf"reads the global {_SHOWN[how]} \(of {package}\.\w+\), which "
                               r"was 2.0 then and is 1.0 now"):
                traced(params, x)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == package]:
            del sys.modules[name]


def test_a_global_of_a_model_a_notebook_cell_defines_is_refused_once_changed() -> None:
    """A notebook's classes have no module file: their methods' code names the cell."""
    source = (
        "from torch import nn\nSCALE = 2.0\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 2)\n\n"
        "    def forward(self, x):\n        return self.out(self.inp(x) * SCALE)\n"
    )
    notebook = types.ModuleType("__glue_notebook__")
    sys.modules[notebook.__name__] = notebook
    try:
        exec(compile(source, "/tmp/ipykernel_4242/1234567.py", "exec"), vars(notebook))
        net = notebook.Net()
        chain, params = sw.functionalize(net, units=["inp", "out"])
        x = torch.randn(3, 4)
        assert torch.equal(chain(params, x), net(x))
        notebook.SCALE = 1.0
        with pytest.raises(RuntimeError, match=r"reads the global 'SCALE' \(of __glue_notebook__\)"):
            chain(params, x)
    finally:
        del sys.modules[notebook.__name__]
