"""A newcomer's first two commands, word for word from the README, in a fresh virtualenv.

Minutes long (the install, the example's 300 steps, the whole suite again), so it runs only
with ``SHARDWISE_SLOW=1``. CI covers the same ground without it: ``.ci/run`` itself starts
from a fresh virtualenv and runs the README's commands (``tests/test_docs.py`` checks that).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SHARDWISE_SLOW") != "1", reason="minutes long: set SHARDWISE_SLOW=1"),
]


def readme_commands() -> list[str]:
    """The command lines of the README's first bash block (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no bash block"
    return [line for line in block[1].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def working_tree_copy(target: Path) -> Path:
    """The files git tracks or would track (not ignored), copied: the checkout a newcomer has."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())
    return target


def test_the_readme_commands_pass_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    install_and_train, run_tests = readme_commands()
    checkout = working_tree_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SHARDWISE_SLOW", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1")

    first = subprocess.run(["bash", "-c", install_and_train], cwd=checkout, env=env, capture_output=True,
                           text=True, timeout=1800)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert re.search(r"^loss [\d.]+ -> [\d.]+ ", first.stdout, re.MULTILINE), first.stdout[-2000:]

    second = subprocess.run(["bash", "-c", run_tests], cwd=checkout, env=env, capture_output=True,
                            text=True, timeout=1800)
    assert second.returncode == 0, second.stdout[-6000:] + second.stderr[-2000:]
    assert re.search(r"\d+ passed", second.stdout.splitlines()[-1]), second.stdout[-2000:]
