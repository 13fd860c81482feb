"""The public surface: small at the top level, the rest in namespaces, all of it listed in docs/api.md."""

from __future__ import annotations

import importlib
import re
import types
import warnings
from pathlib import Path

import pytest

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
    assert listed_names("- `sw.tp.NewStyle` — one line\n- `sw.x.y` z\n  - `sw.nested` no\n") == ["sw.tp.NewStyle", "sw.x.y"]


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
    assert len(sw.__all__) <= 25, sorted(sw.__all__)
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
