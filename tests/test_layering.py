"""The package layering of DESIGN.md, checked on the import statements themselves.

collectives imports nothing of ours; engine imports only collectives;
transforms import engine and collectives but never each other; testing and
cli sit on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardwise"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the shardwise modules that ``path`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path).split(".")
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("shardwise"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("shardwise"):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _transform(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "transforms" else ""


ALLOWED = {
    "collectives": {"collectives"},
    "engine": {"collectives", "engine"},
    "transforms": {"collectives", "engine", "transforms"},
}

SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_sources_found() -> None:
    assert any(_layer(_module_name(p)) == "collectives" for p in SOURCES)
    assert any(_layer(_module_name(p)) == "engine" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layering(path: Path) -> None:
    module = _module_name(path)
    layer = _layer(module)
    allowed = ALLOWED.get(layer)
    if allowed is None:
        return  # testing/, cli and the top-level package sit on top and may import anything
    for target in _imports(path):
        target_layer = _layer(target)
        if target_layer and target_layer in {"collectives", "engine", "transforms", "testing", "cli"}:
            assert target_layer in allowed, f"{module} imports {target}: {layer} may import only {sorted(allowed)}"
        if layer == "transforms" and target_layer == "transforms":
            mine, theirs = _transform(module), _transform(target)
            assert not theirs or not mine or mine == theirs, (
                f"{module} imports {target}: transforms never import each other (DESIGN.md)"
            )


def test_scanner_sees_relative_imports() -> None:
    """The import scanner must see relative imports, or the test above could never fail."""
    fake = PACKAGE / "collectives" / "mesh.py"
    assert "shardwise.collectives.runtime" in _imports(fake)
