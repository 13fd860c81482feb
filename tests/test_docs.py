"""The docs run: every module's doctests, every ``python`` block of README.md and docs/*.md,
and the README's commands are the ones CI runs."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
import re
import shlex
import socket
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import shardwise

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))


# -- doctests ------------------------------------------------------------------------------------
def _modules() -> list[str]:
    names = [shardwise.__name__]
    for info in pkgutil.walk_packages(shardwise.__path__, prefix="shardwise."):
        if not info.name.endswith("__main__"):  # importing it would run the command
            names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_module_is_found() -> None:
    assert {"shardwise", "shardwise.cli", "shardwise.transforms.pipeline.schedule"} <= set(MODULES)


def doctest_failures(module: types.ModuleType, name: str) -> list[str]:
    """The report of every failing doctest of ``module`` (its own objects, not re-exported ones)."""
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures = []
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        report: list[str] = []
        if runner.run(test, out=report.append).failed:
            failures.append(f"{test.name}:\n{''.join(report)}")
    return failures


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    """Each module's doctests, by name: a failure says which module and which example."""
    failures = doctest_failures(importlib.import_module(name), name)
    assert not failures, "\n".join(failures)


def test_a_wrong_doctest_is_reported() -> None:
    module = types.ModuleType("fake", "A module whose example is wrong.\n\n>>> 1 + 1\n3\n")
    failures = doctest_failures(module, "fake")
    assert len(failures) == 1 and "Expected:\n    3\nGot:\n    2" in failures[0]


def test_the_package_has_doctests() -> None:
    """The collection above must see the examples the docstrings carry, or it could never fail."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    count = sum(len(t.examples) for n in MODULES for t in finder.find(importlib.import_module(n), n))
    assert count >= 50, count


# -- Markdown code blocks --------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    info: str  # the fence's info string: "python", "python no-run", "python torchrun", "bash"
    line: int  # where the code starts in the file (1-based)
    code: str


def blocks(path: Path) -> list[Block]:
    found, info, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = re.fullmatch(r"\s*```(.*)", line)
        if fence is None:
            if info is not None:
                lines.append(line)
        elif info is None:
            info, start, lines = fence[1].strip(), number + 1, []
        else:
            found.append(Block(info, start, "\n".join(lines)))
            info = None
    assert info is None, f"{path.name}: a code block opened at line {start - 1} is never closed"
    return found


def _run_blocks(path: Path, selected: list[Block]) -> None:
    """Run the blocks in order in one namespace, each compiled under its file and line."""
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for block in selected:
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        exec(code, namespace)


def test_readme_has_python_examples() -> None:
    assert len([b for b in blocks(ROOT / "README.md") if b.info == "python"]) >= 3


README_BLOCKS = len([b for b in blocks(ROOT / "README.md") if b.info == "python"])


@pytest.mark.parametrize("index", range(README_BLOCKS))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    """README blocks stand alone: each runs in its own namespace."""
    block = [b for b in blocks(ROOT / "README.md") if b.info == "python"][index]
    _run_blocks(ROOT / "README.md", [block])
    assert capsys.readouterr().out.strip()


def test_docs_pages_exist() -> None:
    assert [p.name for p in PAGES] and all([b for b in blocks(p) if b.info == "python"] for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_page_runs(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run_blocks(page, [b for b in blocks(page) if b.info == "python"])
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: p.name)
def test_blocks_not_run_still_compile(page: Path) -> None:
    for block in blocks(page):
        if block.info.startswith("python") and block.info != "python":
            compile("\n" * (block.line - 1) + block.code, str(page), "exec")


@pytest.mark.gloo  # two torchrun processes on gloo
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_torchrun_blocks_run(page: Path, tmp_path: Path) -> None:
    for number, block in enumerate(b for b in blocks(page) if b.info == "python torchrun"):
        script = tmp_path / f"block{number}.py"
        script.write_text(block.code)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", f"--master-port={port}", str(script)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert result.returncode == 0, f"{page.name}:{block.line}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        assert result.stdout.strip(), f"{page.name}:{block.line} printed nothing"


# -- the README's commands are CI's ----------------------------------------------------------------
def readme_commands() -> tuple[list[str], str]:
    """The first bash block of the README: (install commands of command 1, the test command)."""
    first = next(b for b in blocks(ROOT / "README.md") if b.info == "bash")
    commands = [line for line in first.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, f"the README's first block should hold two commands, found {commands}"
    install = [part.strip() for part in commands[0].split("&&") if part.strip().startswith("pip install")]
    return install, commands[1].strip()


def test_ci_installs_and_tests_as_the_readme_says() -> None:
    install, test_command = readme_commands()
    assert install and install[0].startswith("pip install torch=="), "the pinned torch comes first"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_commands = [line for line in ci if line and not line.startswith("#")]
    assert [c for c in ci_commands if c.startswith("pip install")] == install, (
        f".ci/run's installs differ from the README's {install}"
    )
    assert "python -m venv" in (ROOT / ".ci" / "run").read_text(), ".ci/run must start from a fresh virtualenv"
    assert ci_commands[-1] == test_command, f".ci/run ends with {ci_commands[-1]!r}, not {test_command!r}"


def test_pinned_torch_is_within_the_declared_floor() -> None:
    install, _ = readme_commands()
    pinned = shlex.split(install[0])[-1].split("==")[1]
    declared = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared, "pyproject.toml declares no torch floor"
    assert tuple(map(int, pinned.split("."))) >= tuple(map(int, declared[1].split(".")))


def test_license_matches_pyproject() -> None:
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.gloo  # two local gloo processes, as the README's comment offers
def test_the_readmes_processes_alternative_runs_as_its_comment_says(tmp_path: Path) -> None:
    """The first example with its threads launch swapped for the commented processes one, called as the
    comment says (under ``if __name__ == "__main__":``: every process re-imports the script)."""
    code = next(b for b in blocks(ROOT / "README.md") if b.info == "python").code
    threads = re.search(r"^print\(sw\.launch\(main, world=2\)\).*$", code, flags=re.MULTILINE)
    offered = re.search(r'^# (sw\.launch\(main, world=2, backend="processes"\))  # .*if __name__ == "__main__":$',
                        code, flags=re.MULTILINE)
    assert threads and offered, "the README's first example no longer offers the processes launch in a comment"
    script = tmp_path / "readme_processes.py"
    script.write_text(code[: threads.start()] + f'if __name__ == "__main__":\n    print({offered[1]})\n')
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert len(losses) == 2 and losses[0] == losses[1], result.stdout
