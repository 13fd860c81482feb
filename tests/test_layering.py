"""The package layering of DESIGN.md, checked on the import statements themselves.

collectives imports nothing of ours; engine imports only collectives;
transforms import engine and collectives but never each other; testing and
cli sit on top, and plan_search between them (it uses testing; the CLI uses it). Inside the engine,
each folder imports only the folders before it in
``ENGINE_ORDER`` (the order ``shardwise/engine/__init__.py`` states), and nothing outside the
engine imports an engine module whose name is private. And no shardwise module imports itself back through others:
the module graph has no cycle.

Every import statement counts, at module level or inside a function (a lazy
import is still a dependency, and hiding one in a function is how a cycle
survives). For the layering, imports under ``if TYPE_CHECKING:`` count too;
for cycles they do not: they never run, so they cannot make a module see
another half-initialised, and two modules whose signatures name each other's
types are one design, not an import order.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardwise"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node under ``node``; without ``type_checking``, not the bodies of ``if TYPE_CHECKING:``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not type_checking and _is_type_checking(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:
                yield from _walk(other, type_checking)
            continue
        yield from _walk(child, type_checking)


@functools.cache
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per version of the file (each source is scanned by five tests, and
    the cycle check scans them all again: parsing them afresh each time was most of this file's time). The
    trees are only read."""
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


def _import_statements(
    path: Path, package: Path = PACKAGE, type_checking: bool = True
) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``: ``import m`` gives (m, []), ``from m import a, b``
    gives (m, [a, b]) with relative modules made absolute."""
    tree = _parse(path)
    here = _module_name(path, package).split(".")
    for node in _walk(tree, type_checking):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if path.name == "__init__.py" else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, [alias.name for alias in node.names]


def _imports(path: Path) -> set[str]:
    """Absolute names of the shardwise modules (and imported names) that ``path`` imports."""
    found: set[str] = set()
    for module, names in _import_statements(path):
        if module.startswith("shardwise"):
            found.add(module)
            found.update(f"{module}.{name}" for name in names)
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
    # The plan search sits on top beside testing (it certifies with the checker); the CLI uses it.
    "plan_search": {"collectives", "engine", "transforms", "testing", "plan_search"},
}

SOURCES = sorted(PACKAGE.rglob("*.py"))

# The engine's folders, each importing only those before it (shardwise/engine/__init__.py).
ENGINE_ORDER = ("torch_api", "model", "optim", "layout", "stack", "plan", "simulate", "run", "checkpoint", "step")
# simulate reads Plans only; run never needs the simulation.
ENGINE_NOT_IMPORTED = {("run", "simulate")}


def _engine_room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else ""


def test_engine_rooms_are_the_stated_ones() -> None:
    """Every engine module is in one of the stated folders: no flat module beside them."""
    rooms = {_engine_room(_module_name(p)) for p in SOURCES if _layer(_module_name(p)) == "engine"}
    assert rooms - {""} == set(ENGINE_ORDER), sorted(rooms)
    stated = (PACKAGE / "engine" / "__init__.py").read_text()
    for room in ENGINE_ORDER:
        assert f"``{room}" in stated, f"shardwise/engine/__init__.py does not say what {room} owns"


@pytest.mark.parametrize(
    "path",
    [p for p in SOURCES if _engine_room(_module_name(p))],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_engine_room_order(path: Path) -> None:
    room = _engine_room(_module_name(path))
    for target in _imports(path):
        theirs = _engine_room(target)
        if not theirs or theirs == room:
            continue
        assert ENGINE_ORDER.index(theirs) < ENGINE_ORDER.index(room), (
            f"{_module_name(path)} imports {target}: engine/{room} may import only the folders before it, "
            f"{list(ENGINE_ORDER[: ENGINE_ORDER.index(room)])}"
        )
        assert (room, theirs) not in ENGINE_NOT_IMPORTED, f"{_module_name(path)} imports {target}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_engine_module_from_outside(path: Path) -> None:
    """Transforms, testing and the CLI reach the engine through its public names only."""
    if _layer(_module_name(path)) == "engine":
        return
    for target in _imports(path):
        if _layer(target) == "engine":
            private = [part for part in target.split(".")[2:] if part.startswith("_") and not part.startswith("__")]
            assert not private, f"{_module_name(path)} imports {target}: {private[0]} is private to the engine"


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
        if target_layer and target_layer in {"collectives", "engine", "transforms", "testing", "plan_search", "cli"}:
            assert target_layer in allowed, f"{module} imports {target}: {layer} may import only {sorted(allowed)}"
        if layer == "transforms" and target_layer == "transforms":
            mine, theirs = _transform(module), _transform(target)
            assert not theirs or not mine or mine == theirs, (
                f"{module} imports {target}: transforms never import each other (DESIGN.md)"
            )


def test_scanner_sees_relative_imports() -> None:
    """The import scanner must see relative imports, or the test above could never fail."""
    fake = PACKAGE / "collectives" / "mesh.py"
    assert "shardwise.collectives.backends.current" in _imports(fake)


# -- import cycles ------------------------------------------------------------------
def import_graph(modules: Mapping[str, Path], package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules among ``modules`` its import statements name.

    ``from pkg import name`` depends on the module ``pkg.name`` when there is
    one, else on ``pkg`` (``name`` is something its ``__init__`` defines).
    Importing ``a.b.c`` also runs ``a`` and ``a.b`` first, but a package never
    imports its child back that way, so only ``a.b.c`` is an edge.
    """
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for module, names in _import_statements(path, package, type_checking=False):
            for target in [f"{module}.{n}" for n in names] or [module]:
                if target in modules:
                    edges.add(target)
                elif module in modules:
                    edges.add(module)
        graph[name] = edges
    return graph


def find_cycle(graph: Mapping[str, Collection[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None.

    Iterative depth-first search in sorted order, so the cycle reported is the
    same on every run.
    """
    on_path, done = 1, 2
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        path, branches = [root], [iter(sorted(graph[root]))]
        state[root] = on_path
        while branches:
            child = next(branches[-1], None)
            if child is None:
                state[path.pop()] = done
                branches.pop()
            elif state.get(child) == on_path:
                return [*path[path.index(child) :], child]
            elif not state.get(child):
                state[child] = on_path
                path.append(child)
                branches.append(iter(sorted(graph.get(child, ()))))
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph({_module_name(p): p for p in SOURCES}))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {
        "pkg.a": {"pkg.b", "pkg.leaf"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.leaf": set(),
        "pkg.other": {"pkg.leaf", "pkg.a"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert find_cycle({"pkg.me": {"pkg.me"}}) == ["pkg.me", "pkg.me"]
    graph["pkg.c"] = set()
    assert find_cycle(graph) is None


def test_the_scan_finds_a_planted_cycle_through_lazy_imports(tmp_path: Path) -> None:
    package = tmp_path / "shardwise"
    files = {
        "__init__.py": "from .a import thing\n",
        "a.py": "def thing():\n    from . import b  # lazy\n    return b\n",
        "b.py": "from .sub.c import x\nif TYPE_CHECKING:\n    from . import a\nelse:\n    from . import d\n",
        "d.py": "",
        "sub/__init__.py": "",
        "sub/c.py": "import shardwise.a\nfrom ..a import thing as x\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    modules = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph = import_graph(modules, package)
    assert graph["shardwise"] == {"shardwise.a"}
    assert graph["shardwise.a"] == {"shardwise.b"}  # ``from . import b`` names the module, not the package
    assert graph["shardwise.b"] == {"shardwise.sub.c", "shardwise.d"}  # not the TYPE_CHECKING import
    assert graph["shardwise.sub.c"] == {"shardwise.a"}
    assert find_cycle(graph) == ["shardwise.a", "shardwise.b", "shardwise.sub.c", "shardwise.a"]


# -- the engine asks roles, never a transform by name ---------------------------------------
# Identifiers that name a split transform (tensor, expert or context parallel) or what only one of
# them has, rather than the role: outside engine/stack/ (whose compose.py states the rules, which may
# name transforms) the engine says "split" and asks the SPLIT role (engine/stack/roles.py).
_TRANSFORM_NAMES = re.compile(
    r"tensor_parallel|expert_parallel|context_parallel|(^|_)(tp|ep|cp)($|_)|split_spec|expert|moe|router|ulysses|"
    r"ring_attention",
    re.IGNORECASE,
)
# Split transforms by name: engine code may compare with them (a string equal to one) in compose.py only.
SPLIT_TRANSFORMS = ("tensor_parallel", "expert_parallel", "context_parallel")


def _identifiers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of every name the code binds or reads: variables, attributes, functions, classes, arguments."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.value.lineno, node.arg


def transform_names_in(path: Path) -> list[str]:
    tree = _parse(path)
    return [f"{path.name}:{line}: {name}" for line, name in _identifiers(tree) if _TRANSFORM_NAMES.search(name)]


@pytest.mark.parametrize(
    "path",
    [p for p in SOURCES if _engine_room(_module_name(p)) and _engine_room(_module_name(p)) != "stack"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_engine_names_no_split_transform_outside_the_stack(path: Path) -> None:
    assert transform_names_in(path) == [], "ask the SPLIT role (engine/stack/roles.py) instead"


def test_the_transform_name_scan_finds_a_planted_name(tmp_path: Path) -> None:
    planted = tmp_path / "x.py"
    planted.write_text(
        "def f(step, ep_size):\n    tp = step.split_spec\n    return TP_PSUM, split, step.tensor_parallel_axis, "
        "INSIDE_ALL_TO_ALL, step.sequence_parts, moe_slots(cut=step.context_parallel)\n"
    )
    found = sorted(entry.split(": ")[1] for entry in transform_names_in(planted))
    # not ``split``, ``step``, ``sequence_parts`` (a generic batch cut) nor ``INSIDE_ALL_TO_ALL`` (an op)
    assert found == ["TP_PSUM", "context_parallel", "ep_size", "moe_slots", "split_spec", "tensor_parallel_axis",
                     "tp"]


def transform_strings_in(path: Path) -> list[str]:
    """``file:line: value`` of every string in ``path``'s code equal to a split transform's name."""
    tree = _parse(path)
    return [f"{path.name}:{node.lineno}: {node.value}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in SPLIT_TRANSFORMS]


@pytest.mark.parametrize(
    "path",
    [p for p in SOURCES if _engine_room(_module_name(p)) and p.name != "compose.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_engine_compares_with_a_split_transform_by_name_only_in_compose(path: Path) -> None:
    """A new split transform touches the engine through its role and compose.py's rules, nowhere else."""
    assert transform_strings_in(path) == [], "state the rule in engine/stack/compose.py, or ask the SPLIT role"


def test_compose_is_where_the_split_transforms_are_named() -> None:
    """The scan above can fail: compose.py's rules do name a split (tensor_parallel, in SPLIT_ORDER).
    expert_parallel and context_parallel compose with every other transform: no rule names them."""
    found = {entry.split(": ")[1] for entry in transform_strings_in(PACKAGE / "engine" / "stack" / "compose.py")}
    assert found == {"tensor_parallel"}
