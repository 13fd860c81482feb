"""examples/hf_gpt2.py, shortened: an unmodified transformers GPT-2 checked under ZeRO-3 and a
pipeline, then trained. CI installs the [hf] extra; without it the test says so and skips."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="examples/hf_gpt2.py needs the [hf] extra: pip install -e '.[hf]'")

ROOT = Path(__file__).resolve().parents[1]


def test_hf_gpt2_example_is_equivalent_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("hf_gpt2", ROOT / "examples" / "hf_gpt2.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_gpt2"] = module
    spec.loader.exec_module(module)
    losses = module.main(["--steps", "16", "--check-steps", "2"])
    out = capsys.readouterr().out
    assert "embed, transformer.h.0, transformer.h.1, head" in out
    assert re.search(r"^ZeRO-3 at dp=2: equivalent over 2 steps", out, re.MULTILINE), out
    assert re.search(r"^1F1B at pp=2: +equivalent over 2 steps", out, re.MULTILINE), out
    assert len(losses) == 16 and sum(losses[-4:]) < sum(losses[:4])
