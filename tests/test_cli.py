"""The installed ``shardwise`` command, run as a user runs it: a subprocess, its exit status and output.

What needs a process of its own runs in one: the console script and ``python -m shardwise`` (that they
start), an error through the console script (one line on stderr, no traceback) and ``--backend processes``.
The other checks call ``main(argv)`` in this process (``in_process``): the same code, without an
interpreter start importing torch.

Expected figures come from the library in this process (the schedule's simulated bubble, the
Plan's actions), never from copies of the command's output.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.cli.arguments import UsageError, parse_mesh
from shardwise.cli.report import one_line
from shardwise.collectives.mesh import Mesh
from shardwise.engine.simulate.simulation import simulate as simulate_plan
from shardwise.transforms.pipeline import Schedule, ScheduleError, get_schedule, simulate, validate

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "examples" / "cli_steps.py"
SCRIPT = Path(sys.executable).parent / "shardwise"
DEADLOCK = "rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0\n"


def shardwise(*args: str, cwd: Path = ROOT, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the console script (``python -m shardwise.cli`` only where none is installed: see below)."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "shardwise.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., Ran]]:
    """``main(argv)`` in this process (no interpreter start: most checks run this way), leaving
    ``sys.path`` and ``sys.modules`` as they were."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)

    def run(*args: str, cwd: Path = ROOT) -> Ran:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        status = main(list(args))
        out, err = capsys.readouterr()
        return Ran(status, out, err)

    yield run
    for name in set(sys.modules) - before:
        if name.startswith(("divergent", "broken", "short", "cli_steps")):
            del sys.modules[name]


def test_the_console_script_is_installed() -> None:
    """pip install -e . makes ``shardwise`` beside this Python; the entry point must import."""
    found = SCRIPT if SCRIPT.exists() else shutil.which("shardwise")
    assert found, f"no shardwise command beside {sys.executable} or on PATH: pip install -e '.[test]'"
    result = subprocess.run([str(found), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(verb in result.stdout for verb in ("schedule", "plan", "verify"))


@pytest.mark.parametrize("verb", ["schedule", "plan", "verify"])
def test_every_verb_has_help(verb: str, in_process: Callable[..., Ran]) -> None:
    result = in_process(verb, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: shardwise {verb}") and "--json" in result.stdout


def test_no_verb_is_a_usage_error(in_process: Callable[..., Ran]) -> None:
    result = in_process()
    assert result.returncode == 2 and "VERB is one of schedule, plan, verify, checkpoint" in result.stderr


# -- schedule ------------------------------------------------------------------------------------
def test_schedule_prints_the_library_figures(in_process: Callable[..., Ran]) -> None:
    expected = simulate(get_schedule("zb_h1", 4, 4, 8))
    result = in_process("schedule", "zb_h1", "--ranks", "4", "--microbatches", "8")
    assert result.returncode == 0, result.stderr
    assert str(expected.schedule) in result.stdout
    assert f"bubble {expected.bubble_fraction:.1%} of the ranks' time" in result.stdout
    peaks = " ".join(f"{r}:{p}" for r, p in enumerate(expected.peak_activations))
    assert f"peak activations held per rank: {peaks}" in result.stdout


def test_schedule_json_and_drawings(tmp_path: Path, in_process: Callable[..., Ran]) -> None:
    png, svg, trace = tmp_path / "s.png", tmp_path / "s.svg", tmp_path / "s.json"
    result = in_process("schedule", "zb_v", "--ranks", "2", "--microbatches", "4", "--json",
                       "--png", str(png), "--svg", str(svg), "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    expected = simulate(get_schedule("zb_v", 2, 4, 4))  # zb_v's default: two stages per rank
    assert data["ok"] is True and data["stages"] == 4
    assert data["bubble_fraction"] == expected.bubble_fraction
    assert data["peak_activations"] == list(expected.peak_activations)
    assert Schedule.parse(data["text"]) == expected.schedule
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "<svg" in svg.read_text()
    assert {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"} == {
        str(op) for op in expected.schedule.ops()
    }


def test_schedule_file_is_read_and_checked_against_the_flags(tmp_path: Path, in_process: Callable[..., Ran]) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("# hand-written\nrank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    good = in_process("schedule", str(path), "--json")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["name"] == "mine"
    wrong = in_process("schedule", str(path), "--microbatches", "3")
    assert wrong.returncode == 1 and "microbatches=2, but --microbatches 3" in wrong.stderr


@pytest.mark.parametrize("text", [DEADLOCK, "rank 0: 0F0 0X0\n", "rank 0: 0F0 0B0 0B0\n"],
                         ids=["deadlock", "syntax", "duplicate"])
def test_an_invalid_schedule_file_fails_with_the_library_message(
    tmp_path: Path, text: str, in_process: Callable[..., Ran]
) -> None:
    with pytest.raises(ScheduleError) as raised:
        validate(Schedule.parse(text))
    path = tmp_path / "bad.txt"
    path.write_text(text)
    result = in_process("schedule", str(path))
    assert result.returncode == 1
    assert one_line(str(raised.value)) in result.stderr and "Traceback" not in result.stderr
    as_json = in_process("schedule", str(path), "--json")
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["ok"] is False


def test_a_deadlocked_schedule_through_the_console_script(tmp_path: Path) -> None:
    path = tmp_path / "deadlock.txt"
    path.write_text(DEADLOCK)
    result = shardwise("schedule", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"shardwise schedule: error: schedule {str(path)!r} is invalid: the schedule deadlocks"
    )
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["schedule", "no_such_schedule", "--ranks", "2", "--microbatches", "2"], "neither a built-in schedule"),
        (["schedule", "1f1b", "--microbatches", "2"], "needs --ranks"),
        (["schedule", "1f1b", "--ranks", "2", "--stages", "4", "--microbatches", "2"], "one stage per rank"),
        (["schedule", "1f1b", "--ranks", "0", "--microbatches", "2"], "not a positive whole number"),
    ],
)
def test_schedule_usage_errors(args: list[str], message: str, in_process: Callable[..., Ran]) -> None:
    result = in_process(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_schedule_files_it_cannot_read_or_write_are_usage_errors(
        tmp_path: Path, in_process: Callable[..., Ran]) -> None:
    """Found by session 41's probing: a folder that does not exist for --png or --trace, a folder for --trace, and a
    schedule file that is not text ended in exit 1 with Python's own one-line error (FileNotFoundError,
    IsADirectoryError, UnicodeDecodeError) and nothing written; now usage errors (exit 2) naming the flag."""
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00rank 0: 0F0")
    shape = ["gpipe", "--ranks", "2", "--microbatches", "2"]
    for args, message in (
        ([str(binary)], f"schedule file {str(binary)!r} is not text (UTF-8: invalid start byte at byte 0)"),
        ([*shape, "--png", str(tmp_path / "missing" / "g.png")], f"--png {str(tmp_path / 'missing' / 'g.png')!r}: "
                                                                  "there is no folder"),
        ([*shape, "--trace", str(tmp_path / "missing" / "t.json")], "--trace"),
        ([*shape, "--trace", str(tmp_path)], f"--trace {str(tmp_path)!r} is a folder: name a file in it (e.g. "
                                             f"{str(tmp_path / 'trace.json')!r})"),
        ([*shape, "--svg", str(tmp_path)], "--svg"),
    ):
        result = in_process("schedule", *args)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, (
            args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt"]  # nothing written on the way
    (tmp_path / "dangling.json").symlink_to(tmp_path / "missing" / "t.json")
    result = in_process("schedule", *shape, "--trace", str(tmp_path / "dangling.json"))
    assert result.returncode == 2 and "is a link to" in result.stderr and "which does not exist" in result.stderr


def test_an_existing_file_in_a_folder_the_user_cannot_write_is_written(
        in_process: Callable[..., Ran], monkeypatch: pytest.MonkeyPatch) -> None:
    """The review: --trace /dev/null (or /dev/stdout) was refused for a user who cannot write into /dev itself (the
    check asked of the folder): a file that exists is asked of itself. (As a user, not root, would be answered.)"""
    import shardwise.cli.arguments as arguments

    real = arguments.os.access
    monkeypatch.setattr(arguments.os, "access", lambda p, mode: False if str(p) == "/dev" else real(p, mode))
    result = in_process("schedule", "gpipe", "--ranks", "2", "--microbatches", "2", "--trace", "/dev/null")
    assert result.returncode == 0, result.stderr


# -- the mesh grammar and FILE:FUNCTION ------------------------------------------------------------
def test_mesh_grammar() -> None:
    assert parse_mesh("dp=2,pp=2") == Mesh(dp=2, pp=2)
    assert parse_mesh(" tp = 4 ") == Mesh(tp=4)


@pytest.mark.parametrize(
    ("text", "reason"),
    [("dp", "is not axis=size"), ("=2", "is not axis=size"), ("dp=two", "not a whole number"),
     ("dp=0", "sizes are at least 1"), ("dp=2,dp=2", "given twice"), ("2x=2", "must be an identifier"),
     ("dp=2,", "is not axis=size")],
)
def test_bad_mesh_is_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(UsageError, match=reason):
        parse_mesh(text)


def test_bad_mesh_is_a_usage_error_of_the_command(in_process: Callable[..., Ran]) -> None:
    result = in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2,pp")
    assert result.returncode == 2 and "argument --mesh" in result.stderr and "'pp' is not axis=size" in result.stderr


@pytest.mark.parametrize(
    ("target", "message"),
    [("nowhere.py:make", "no such file 'nowhere.py'"), (f"{STEPS}:missing", "has no function 'missing'"),
     (str(STEPS), "write FILE:FUNCTION")],
)
def test_missing_file_or_function_is_a_usage_error(target: str, message: str, in_process: Callable[..., Ran]) -> None:
    result = in_process("plan", target, "--mesh", "dp=2")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_errors_in_the_users_code_exit_1_in_one_line_that_says_where(
    tmp_path: Path, in_process: Callable[..., Ran]
) -> None:
    (tmp_path / "broken.py").write_text("def make():\n    raise RuntimeError('my model\\nis broken')\n")
    (tmp_path / "short.py").write_text("def make():\n    return 1, 2\n")
    raised = in_process("plan", "broken.py:make", "--mesh", "dp=2", cwd=tmp_path)
    assert raised.returncode == 1 and raised.stderr.count("\n") == 1, raised.stderr
    assert raised.stderr.startswith("shardwise plan: error: RuntimeError: my model; is broken (raised at ")
    assert "broken.py:2, in make)" in raised.stderr and "Traceback" not in raised.stderr
    whole = in_process("plan", "broken.py:make", "--mesh", "dp=2", "--traceback", cwd=tmp_path)
    assert whole.returncode == 1 and whole.stderr.startswith("Traceback (most recent call last):")
    assert whole.stderr.splitlines()[-1].startswith("shardwise plan: error: RuntimeError: my model; is broken")
    short = in_process("plan", "short.py:make", "--mesh", "dp=2", cwd=tmp_path)
    assert short.returncode == 2 and "must return (step, params, batch), got a tuple of 2" in short.stderr


def test_a_step_returned_in_another_place_is_named_as_a_usage_error(
    tmp_path: Path, in_process: Callable[..., Ran]
) -> None:
    """(params, step, batch) failed inside the command with "'dict' object has no attribute 'plan'"."""
    (tmp_path / "swapped.py").write_text(
        f"import importlib.util\nspec = importlib.util.spec_from_file_location('steps', {str(STEPS)!r})\n"
        "steps = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(steps)\n"
        "def make():\n    step, params, batch = steps.composed()\n    return params, step, batch\n"
    )
    result = in_process("plan", "swapped.py:make", "--mesh", "dp=2,pp=2", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert ("must return (step, params, batch): element 0 (step) is a dict, not a shardwise Step (a Step is element "
            "1: in another order?)") in result.stderr


@pytest.mark.parametrize(
    ("args", "status", "start"),
    [
        ([], 2, "shardwise: error: the following arguments are required: VERB (VERB is one of "),
        (["plan"], 2, "shardwise plan: error: the following arguments are required: FILE:FUNCTION, --mesh"),
        (["plan", f"{STEPS}:composed", "--mesh", "dp=2,pp"], 2, "shardwise plan: error: argument --mesh: "),
        (["plan", f"{STEPS}:composed", "--mesh", "dp=3,pp=2"], 1,
         "shardwise plan: error: ValueError: shard_params over axis 'dp' of size 3: batch size 8"),
        (["schedule", "gpipe"], 2, "shardwise schedule: error: schedule 'gpipe' needs --ranks and --microbatches"),
        (["checkpoint", "inspect", "no/such/dir"], 1, "shardwise checkpoint: error: no checkpoint at no/such/dir"),
        (["verify", f"{STEPS}:verified", "--mesh", "dp=2", "--rtol", "-1"], 2, "shardwise verify: error: argument"),
    ],
    ids=["no-verb", "no-arguments", "bad-mesh", "library-error", "schedule-flags", "no-checkpoint", "bad-rtol"],
)
def test_every_error_is_one_line(args: list[str], status: int, start: str, in_process: Callable[..., Ran]) -> None:
    """Usage errors (argparse's too, which print the usage first), a "no", an exception: one line on stderr."""
    result = in_process(*args)
    assert result.returncode == status and result.stderr.startswith(start), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


def test_one_line_joins_a_message_of_several_lines() -> None:
    assert one_line("deadlocks:\n  rank 0 waits\n  rank 1 waits\n") == "deadlocks: rank 0 waits; rank 1 waits"
    assert one_line("one") == "one"


def test_json_reports_an_error_in_the_users_code_as_one_object(tmp_path: Path, in_process: Callable[..., Ran]) -> None:
    """A program reading --json gets its object in every outcome (stdout was empty)."""
    (tmp_path / "broken.py").write_text("def make():\n    raise RuntimeError('my model is broken')\n")
    raised = in_process("plan", "broken.py:make", "--mesh", "dp=2", "--json", cwd=tmp_path)
    assert raised.returncode == 1
    data = json.loads(raised.stdout)
    assert data["ok"] is False and data["error"] == "RuntimeError: my model is broken"
    assert "broken.py" in data["traceback"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--timeout", "-1", "'-1' is not a positive number of seconds"),
        ("--timeout", "0", "'0' is not a positive number of seconds"),
        ("--timeout", "nan", "'nan' is not a finite number"),
        ("--rtol", "-1", "'-1' is negative; a tolerance is 0 or more"),
        ("--atol", "-0.5", "'-0.5' is negative"),
        ("--rtol", "inf", "'inf' is not a finite number"),
    ],
)
def test_verify_refuses_a_negative_timeout_or_tolerance(
    flag: str, value: str, message: str, in_process: Callable[..., Ran]
) -> None:
    """A negative tolerance made every step 'not equivalent'; a negative timeout, every wait fail."""
    result = in_process("verify", f"{STEPS}:verified", "--mesh", "dp=2", flag, value)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1


def test_plan_measure_counts_the_steps_collectives_and_says_they_equal_the_plan(
    in_process: Callable[..., Ran],
) -> None:
    step, params, batch = _cli_steps().composed()
    plan = step.plan(Mesh(dp=2, pp=2), params, batch)
    result = in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2,pp=2", "--measure", "--timeout", "60", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ledger_equals_plan"] is True
    # Only the step's: init's agreement all-gathers are not in the count.
    counted = sum(entry["count"] for entry in data["measured"].values())
    assert counted == sum(1 for rank in range(4) for _ in plan.collectives(rank))
    text = in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2,pp=2", "--measure")
    assert "every rank issued exactly the collectives its Plan lists" in text.stdout
    assert in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2", "--timeout", "-3").returncode == 2


# -- plan and verify -------------------------------------------------------------------------------
def _cli_steps():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("cli_steps_for_tests", STEPS)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_json_is_the_library_plan(in_process: Callable[..., Ran]) -> None:
    step, params, batch = _cli_steps().composed()
    mesh = Mesh(dp=2, pp=2)
    plan = step.plan(mesh, params, batch)
    result = in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2,pp=2", "--simulate", "--measure", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mesh"] == {"dp": 2, "pp": 2}
    assert [r["actions"] for r in data["ranks"]] == [[str(a) for a in plan.for_rank(r)] for r in range(4)]
    assert data["memory"] == {k: list(v) for k, v in plan.memory.items()}
    assert data["comm_bytes"] == {f"{axis}/{op}": list(v) for (axis, op), v in plan.comm_bytes().items()}
    assert data["comm_bytes"]["dp/all_gather"] and data["comm_bytes"]["pp/send"]
    assert data["simulation"]["bubble_fraction"] == simulate_plan(plan).bubble_fraction
    # One step really ran: ZeRO-3 gathered over dp, the pipeline sent activations over pp.
    assert data["measured"]["dp/all_gather"]["count"] > 0 and data["measured"]["pp/send"]["sent_bytes"] > 0


def test_plan_text(in_process: Callable[..., Ran]) -> None:
    step, params, batch = _cli_steps().composed()
    result = in_process("plan", f"{STEPS}:composed", "--mesh", "dp=2,pp=2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(str(step.plan(Mesh(dp=2, pp=2), params, batch)))
    assert "actions per rank:" in result.stdout


def test_verify_passes_on_an_equivalent_step(in_process: Callable[..., Ran]) -> None:
    result = in_process("verify", f"{STEPS}:verified", "--mesh", "dp=2,pp=2", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["equivalent"] is True and data["steps"] == 3 and max(data["max_rel_err"]) < 1e-10


DIVERGENT = '''
import torch
import shardwise as sw
from shardwise.testing.models import mlp


def make():
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 2]).double())
    reference = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.2)), "dp", stage=3)
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    return step, reference, params, [batch, batch]
'''


def test_verify_exits_1_at_a_divergence(tmp_path: Path, in_process: Callable[..., Ran]) -> None:
    (tmp_path / "divergent.py").write_text(DIVERGENT)
    result = in_process("verify", "divergent.py:make", "--mesh", "dp=2", "--json", cwd=tmp_path)
    assert result.returncode == 1
    assert "not equivalent: first divergence at step 1" in result.stderr and "Traceback" not in result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["equivalent"] is False and data["step"] == 1


@pytest.mark.gloo  # two gloo processes, each building the step from the file itself
def test_verify_on_processes() -> None:
    result = shardwise("verify", f"{STEPS}:verified", "--mesh", "dp=2,pp=2", "--backend", "processes")
    assert result.returncode == 0, result.stderr
    assert "equivalent over 3 steps" in result.stdout and "(processes)" in result.stdout


MISSING_VALUES = """
import torch, shardwise as sw


class Fill(torch.nn.Module):
    def forward(self, x):
        return torch.nan_to_num(x, nan=0.0)


def loss32(out, y):  # a float64 model's loss computed in float32, as transformers computes its labels= loss
    return torch.nn.functional.mse_loss(out.float(), y.float())


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Fill(), torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, loss32, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, dtype=torch.float64, generator=gen)
    x[0, 0] = x[5, 3] = float("nan")  # missing values
    batch = (x, torch.randn(8, 3, dtype=torch.float64, generator=gen))
    return sw.pipeline(step, "pp", "1f1b", 2), step, params, [batch, batch]
"""


@pytest.mark.gloo  # two gloo processes, each building the step from the file itself
def test_verify_on_processes_judges_as_on_threads(tmp_path: Path) -> None:
    """A batch holding NaN (missing values the model fills) was "different params or batches ... (seed it)" (NaN
    equals nothing), and a float32 loss of a float64 model was judged at float64's tolerance ("not equivalent" where
    the threads backend, at the loss's own dtype, says equivalent)."""
    (tmp_path / "missing.py").write_text(MISSING_VALUES)
    threads = shardwise("verify", "missing.py:make", "--mesh", "pp=2", cwd=tmp_path)
    processes = shardwise("verify", "missing.py:make", "--mesh", "pp=2", "--backend", "processes", cwd=tmp_path)
    assert threads.returncode == 0, threads.stderr
    assert processes.returncode == 0, processes.stderr
    assert "equivalent over 2 steps" in processes.stdout


def test_python_dash_m_shardwise_is_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "shardwise", "schedule", "gpipe", "--ranks", "2",
                             "--microbatches", "2", "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True


def test_assert_plan_is_run_names_the_rank_and_where_its_lists_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public check the CLI's --measure uses: a run whose rank 0 issued one collective fewer than its
    Plan lists is caught, naming the rank and the first collective listed where nothing was issued."""
    import torch

    import shardwise as sw
    from shardwise.collectives.ledger import Ledger
    from shardwise.testing import plan_check
    from shardwise.testing.models import mlp

    chain, params = sw.functionalize(mlp([4, 8, 2]))
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 1)
    batch = (torch.randn(4, 4), torch.randn(4, 2))
    plan = sw.testing.assert_plan_is_run(step, sw.Mesh(dp=2), params, batch)
    measured = plan_check.measure

    def one_short(*args: object, **kwargs: object) -> Ledger:
        ledger, short = measured(*args, **kwargs), Ledger()  # type: ignore[arg-type]
        last = max(i for i, r in enumerate(ledger.records) if r.rank == 0)
        for i, record in enumerate(ledger.records):
            if i != last:
                short.add(record)
        return short

    monkeypatch.setattr(plan_check, "measure", one_short)
    count = len(list(plan.collectives(0)))
    with pytest.raises(sw.testing.PlanNotRunError, match=rf"rank 0 issued {count - 1} collectives and its Plan lists "
                                                         rf"{count}; they part at #{count - 1}: issued nothing"):
        sw.testing.assert_plan_is_run(step, sw.Mesh(dp=2), params, batch)
