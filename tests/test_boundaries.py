"""Import boundaries, read from the source with ``ast`` (nothing is imported or executed).

The layering (DESIGN.md, "Boundaries"): ``events/`` is the wire vocabulary both sides share
and imports nothing of ours; ``router/`` and ``engine_adapter/`` never import each other; a
router never imports torch, so the base install (no extras) runs it. Every import counts:
module level, inside functions, under ``TYPE_CHECKING``, relative, and ``import_module``
or ``__import__`` with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("events", "engine_adapter", "router", "bench", "stack", "kvroute_cli")
# Modules only the optional extras install (pyproject.toml: engine, bench).
EXTRA_ONLY = ("torch", "matplotlib", "hypothesis", "vllm_router", "sglang_router")


@dataclass(frozen=True)
class Import:
    file: str  # relative to the scanned root
    line: int
    module: str  # absolute dotted name
    lazy: bool  # inside a function body: runs only when the function does

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}"


class _Collector(ast.NodeVisitor):
    def __init__(self, file: str, package: list[str]) -> None:
        self.file, self.package = file, package
        self.found: list[Import] = []
        self.depth = 0  # enclosing function bodies

    def _add(self, node: ast.AST, module: str) -> None:
        self.found.append(Import(self.file, node.lineno, module, self.depth > 0))  # type: ignore[attr-defined]

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            self._add(node, node.module or "")
            return
        base = self.package[: len(self.package) - (node.level - 1)]
        if node.module:
            self._add(node, ".".join([*base, node.module]))
        else:  # from . import a, b: each may be a submodule
            for alias in node.names:
                self._add(node, ".".join([*base, alias.name]))

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if (
            name in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


def imports(package: str, root: Path = REPO) -> Iterator[Import]:
    """Every import in every ``.py`` file under ``root/package``."""
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        pkg = parts[:-1]  # a module's package; for __init__.py, the package itself
        collector = _Collector(str(rel), pkg)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        yield from collector.found


def _violations(package: str, forbidden: set[str], *, lazy_too: bool = True) -> list[str]:
    return [
        str(i)
        for i in imports(package)
        if i.top in forbidden and i.top != package and (lazy_too or not i.lazy)
    ]


RULES = [
    pytest.param("events", set(OURS), id="events_imports_nothing_of_ours"),
    pytest.param("router", {"engine_adapter"}, id="router_never_imports_engine_adapter"),
    pytest.param("engine_adapter", {"router"}, id="engine_adapter_never_imports_router"),
    pytest.param("router", {"torch"}, id="router_never_imports_torch"),
    # router imports events, so events must stay torch-free too for a torch-less router.
    pytest.param("events", {"torch"}, id="events_never_imports_torch"),
    pytest.param("router", set(EXTRA_ONLY), id="router_needs_no_extra"),
    pytest.param("events", set(EXTRA_ONLY), id="events_needs_no_extra"),
    # The demo and the test kit are product code: benchmarks may use them, never the reverse.
    pytest.param("stack", {"bench"}, id="stack_never_imports_bench"),
]


@pytest.mark.parametrize(("package", "forbidden"), RULES)
def test_package_keeps_its_import_boundary(package, forbidden):
    assert _violations(package, forbidden) == []


def test_cli_modules_import_product_and_extras_only_inside_commands():
    """``kvroute --help`` and ``kvroute events tail`` load no router, engine or torch: each
    command imports what it runs when it runs (and says which extra is missing)."""
    heavy = (set(OURS) - {"kvroute_cli"}) | set(EXTRA_ONLY)
    assert _violations("kvroute_cli", heavy, lazy_too=False) == []


def test_only_the_benchmark_tests_import_bench():
    """Tests stand on the product and the kit (``stack``), not on benchmark code; only the
    tests *of* the benchmarks (``tests/bench``) import it."""
    bad = [
        str(i)
        for i in imports("tests")
        if i.top == "bench" and not i.file.replace("\\", "/").startswith("tests/bench/")
    ]
    assert bad == []


def test_scanner_sees_top_level_lazy_relative_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import sibling\n")
    (pkg / "mod.py").write_text(
        "import torch.nn as nn\n"
        "from ..other import thing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from router.index import base\n"
        "def f():\n"
        "    import importlib\n"
        "    from engine_adapter import sim\n"
        "    return importlib.import_module('stack.demo')\n"
    )
    found = {(i.file.replace("\\", "/"), i.module, i.lazy) for i in imports("pkg", tmp_path)}
    assert found == {
        ("pkg/sub/__init__.py", "pkg.sub.sibling", False),
        ("pkg/sub/mod.py", "torch.nn", False),
        ("pkg/sub/mod.py", "pkg.other", False),
        ("pkg/sub/mod.py", "typing", False),
        ("pkg/sub/mod.py", "router.index", False),
        ("pkg/sub/mod.py", "importlib", True),
        ("pkg/sub/mod.py", "engine_adapter", True),
        ("pkg/sub/mod.py", "stack.demo", True),
    }


def test_router_and_engine_adapter_do_import_events():
    """Guard against a vacuous pass (a renamed folder would scan nothing)."""
    for package in ("router", "engine_adapter"):
        assert any(i.top == "events" for i in imports(package)), package
