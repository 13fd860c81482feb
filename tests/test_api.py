"""The public surface: small at the top level, the rest in namespaces, all of it listed in docs/api.md;
and what users read names public things: no internal module path (``shardwise.engine....``,
``engine/stack/compose.py``) in the messages the package raises or warns, in the docstrings of the
public names, or in the names of the exceptions a traceback shows."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import traceback
import types
import warnings
from pathlib import Path

import pytest
import torch

import shardwise as sw

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
# Public modules below a namespace, imported by name (``from shardwise.testing import models``).
SUBMODULES = ("testing.models", "testing.strategies")


def public_names() -> set[str]:
    """Every public name as ``sw.a`` or ``sw.ns.a``: the top-level ``__all__``, each namespace's ``__all__``
    (less the names the top level re-exports as the same object), and the submodules' ``__all__``."""
    names: set[str] = set()
    namespaces = {n: getattr(sw, n) for n in sw.__all__ if isinstance(getattr(sw, n), types.ModuleType)}
    for name in sw.__all__:
        if name not in namespaces:
            names.add(f"sw.{name}")
    for dotted in SUBMODULES:
        namespaces[dotted] = importlib.import_module(f"shardwise.{dotted}")
    for dotted, module in namespaces.items():
        assert hasattr(module, "__all__"), f"the public module shardwise.{dotted} has no __all__"
        for name in module.__all__:
            if not (name in sw.__all__ and vars(sw)[name] is getattr(module, name)):
                names.add(f"sw.{dotted}.{name}")
    return names


def listed_names(text: str) -> list[str]:
    """The names of docs/api.md's entries: each a list item that starts with a backticked ``sw.`` name."""
    return re.findall(r"^- `(sw(?:\.\w+)+)`", text, flags=re.MULTILINE)


def test_the_api_page_lists_exactly_the_public_surface() -> None:
    listed = listed_names(API_PAGE.read_text())
    doubles = sorted({n for n in listed if listed.count(n) > 1})
    assert not doubles, f"docs/api.md lists these more than once: {doubles}"
    public = public_names()
    missing, unknown = sorted(public - set(listed)), sorted(set(listed) - public)
    assert not missing, f"public names docs/api.md does not list (add a line each): {missing}"
    assert not unknown, f"docs/api.md lists names that are not public (remove them, or export them): {unknown}"


def test_the_comparison_sees_a_name_added_or_removed() -> None:
    text = API_PAGE.read_text()
    assert "sw.tp.Colwise" in listed_names(text)
    assert "sw.tp.Colwise" not in listed_names(text.replace("- `sw.tp.Colwise`", "- sw.tp.Colwise"))
    listing = "- `sw.tp.NewStyle` — one line\n- `sw.x.y` z\n  - `sw.nested` no\n"
    assert listed_names(listing) == ["sw.tp.NewStyle", "sw.x.y"]


def test_every_listed_name_resolves_without_a_warning() -> None:
    for dotted in SUBMODULES:
        importlib.import_module(f"shardwise.{dotted}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in listed_names(API_PAGE.read_text()):
            obj: object = sw
            for part in name.split(".")[1:]:
                obj = getattr(obj, part)


def test_the_top_level_is_small() -> None:
    """What a first program uses: a newcomer holds it in mind; anything more goes in a namespace."""
    # 28: the 25 of a first program, sw.search (issue 29 names it there: the layout search is a first
    # program's question too), and expert_parallel and context_parallel beside tensor_parallel (the
    # transforms are what a first program applies), and router_aux_loss (a transform on the step's loss,
    # which the single-device reference applies too).
    assert len(sw.__all__) <= 29, sorted(sw.__all__)
    assert sorted(sw.__all__) == sw.__all__, "keep the top-level __all__ sorted, as docs/api.md reads it"


@pytest.mark.parametrize("name", sorted(sw._MOVED))
def test_an_old_top_level_name_still_works_and_says_where_it_moved(name: str) -> None:
    namespace = sw._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"^sw\.{name} moved to sw\.{namespace}\.{name};"):
        old = getattr(sw, name)
    assert old is getattr(getattr(sw, namespace), name)
    assert name not in sw.__all__


def test_an_unknown_top_level_name_points_to_the_api_page() -> None:
    with pytest.raises(AttributeError, match=r"no attribute 'Colwize' \(docs/api.md lists the public names\)"):
        sw.Colwize  # noqa: B018


# -- no internal module paths in what users read ---------------------------------------------------
PACKAGE = Path(__file__).resolve().parents[1] / "shardwise"
STEMS = sorted({p.stem for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")})
INTERNAL = re.compile(
    r"shardwise\.(engine|transforms)\b|\b(engine|transforms|collectives)/|\b(" + "|".join(STEMS) + r")\.py\b"
)
# Calls whose strings reach the user: the messages of exceptions and warnings, the command's output.
SHOWN = {"warn", "print", "UsageError", "CommandFailed"}


def shown_strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant (f-string parts too) in a ``raise`` or a call that shows it to the user."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        roots: list[ast.AST] = []
        if isinstance(node, ast.Raise) and node.exc is not None:
            roots.append(node.exc)
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in SHOWN:
                roots.append(node)
        for root in roots:
            found += [(sub.lineno, sub.value) for sub in ast.walk(root)
                      if isinstance(sub, ast.Constant) and isinstance(sub.value, str)]
    return found


def test_no_message_the_package_raises_names_an_internal_module() -> None:
    offending = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}" for path in sorted(PACKAGE.rglob("*.py"))
                 for line, text in shown_strings(path) if INTERNAL.search(text)]
    assert not offending, "point to the public name or to docs/ instead:\n" + "\n".join(offending)


def test_the_scan_sees_a_raise_that_names_an_internal_module(tmp_path: Path) -> None:
    source = tmp_path / "bad.py"
    source.write_text('def f(x):\n    raise ValueError(f"bad {x}; see engine/stack/compose.py")\n'
                      'import warnings\nwarnings.warn("see shardwise.engine.plan.lower")\nprint("fine")\n')
    assert [text for _, text in shown_strings(source) if INTERNAL.search(text)] == [
        "; see engine/stack/compose.py", "see shardwise.engine.plan.lower"]


def test_no_public_docstring_names_an_internal_module() -> None:
    for dotted in SUBMODULES:
        __import__(f"shardwise.{dotted}")
    offending = []
    for name in sorted(public_names()):
        obj: object = sw
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
        docs = {name: inspect.getdoc(obj) or ""}
        if isinstance(obj, type):  # and its public methods
            docs |= {f"{name}.{n}": inspect.getdoc(m) or "" for n, m in vars(obj).items()
                     if not n.startswith("_") and callable(m)}
        offending += [f"{where}: {match[0]!r}" for where, doc in docs.items() for match in INTERNAL.finditer(doc)]
    assert not offending, "\n".join(offending)


@pytest.mark.parametrize("name", sorted(n for n in public_names() if n.endswith(("Error", "Deadlock", "Mismatch"))))
def test_a_public_exception_is_named_by_its_public_module(name: str) -> None:
    obj: object = sw
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    assert isinstance(obj, type) and issubclass(obj, Exception)
    assert not obj.__module__.startswith(("shardwise.engine", "shardwise.transforms")), obj.__module__


def test_a_save_handle_prints_as_a_public_class(tmp_path: Path) -> None:
    chain, params = sw.functionalize(torch.nn.Linear(2, 2))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    handle = sw.checkpoint.save(tmp_path / "c", step.init(params), step)
    assert repr(handle).startswith("<shardwise.checkpoint.SaveHandle object at ")


def test_a_traceback_names_the_public_exception() -> None:
    """The last line of the traceback an uncaught error prints (sys.excepthook formats it as
    ``traceback.format_exception_only`` does), here: no interpreter to start for it."""
    chain, _ = sw.functionalize(torch.nn.Linear(2, 2))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(Exception) as info:
        sw.checkpoint.load("no/such/checkpoint", step)
    last = traceback.format_exception_only(info.value)[-1]
    assert last.startswith("shardwise.checkpoint.CheckpointError: "), last
