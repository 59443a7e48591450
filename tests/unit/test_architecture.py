"""The shape of the package: import layers (pyproject.toml [tool.importlinter]), file sizes, and where aitune
modules may be imported inside functions instead of at module top."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "aitune"
MAX_LINES = 500


_CLI = "the command line imports torch and aitune.torch only in the command that runs (--version and --help stay fast)"

# (file relative to the repository root, imported module) -> why the import stays inside a function.
LOCAL_IMPORTS_ALLOWED = {
    ("aitune/_jit_bootstrap.py", "aitune.torch.jit.runtime"):
        "runs from a .pth file at interpreter start: torch is imported only when a script opts in "
        "(NOTE [lazy bootstrap])",
    ("aitune/cli.py", "aitune.demo"): _CLI,
    ("aitune/cli.py", "aitune.serve"): _CLI,
    ("aitune/cli.py", "aitune.serve.app"): "needs Ray (the optional serve extra); " + _CLI,
    ("aitune/cli.py", "aitune.torch.backend"): _CLI,
    ("aitune/cli.py", "aitune.torch.check.native_watch"): _CLI,
    ("aitune/cli.py", "aitune.torch.checkpoint"): _CLI,
    ("aitune/cli.py", "aitune.torch.checkpoint.manifest"): _CLI,
    ("aitune/cli.py", "aitune.torch.common.environment"): _CLI,
    ("aitune/cli.py", "aitune.torch.report.html"): _CLI,
    ("aitune/cli.py", "aitune.torch.report.rows"): _CLI,
    ("aitune/cli.py", "aitune.torch.search.crashes"): _CLI,
    ("aitune/cli.py", "aitune.torch.search.rankings"): _CLI,
    ("aitune/cli.py", "aitune.torch.storage"): _CLI,
    ("aitune/cli.py", "aitune.torch.tuning"): _CLI,
    ("aitune/serve/__init__.py", "aitune.serve"): "aitune.serve.app needs Ray (optional): imported only when it is used",
}


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _local_aitune_imports(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import of an aitune module inside a function body of ``path``."""
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:  # relative: resolve against the file's package
                    package = path.relative_to(root).with_suffix("").parts[:-child.level]
                    module = ".".join((*package, *([module] if module else [])))
                if module == "aitune" or module.startswith("aitune."):
                    found.append((module, child.lineno))
            elif in_function and isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names
                             if alias.name == "aitune" or alias.name.startswith("aitune."))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def test_import_layers_contract_is_kept():
    """import-linter's contracts of pyproject.toml: a stage imports only from the layers below it."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code, "--no-cache"],  # reads pyproject.toml of the cwd
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "Contracts: " in result.stdout, result.stdout + result.stderr  # it ran and checked them
    assert result.returncode == 0, result.stdout[result.stdout.find("Broken contracts"):] + result.stderr


def test_no_import_circle_between_modules():
    """No module of aitune reaches itself through imports, counting those under TYPE_CHECKING and inside
    functions (grimp's graph, the one import-linter checks)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("aitune")
    circles = {(module, tuple(chain)) for module in graph.modules
               for imported in graph.find_modules_directly_imported_by(module)
               if (chain := graph.find_shortest_chain(importer=imported, imported=module)) is not None}
    assert circles == set()


def test_no_file_in_the_package_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): lines for path in _sources()
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_function_local_imports_of_aitune_modules_are_only_the_allowed_ones():
    found = {}
    for path in _sources():
        for module, line in _local_aitune_imports(path):
            found.setdefault((str(path.relative_to(ROOT).as_posix()), module), []).append(line)
    unexpected = {f"{file}:{lines[0]} imports {module}" for (file, module), lines in found.items()
                  if (file, module) not in LOCAL_IMPORTS_ALLOWED}
    assert unexpected == set(), "import these at module top (or add a reason to LOCAL_IMPORTS_ALLOWED)"
    stale = set(LOCAL_IMPORTS_ALLOWED) - set(found)
    assert stale == set(), "these allowed imports are gone: drop them from LOCAL_IMPORTS_ALLOWED"
    assert all(reason.strip() for reason in LOCAL_IMPORTS_ALLOWED.values())


def test_the_local_import_scan_finds_nested_relative_and_plain_imports(tmp_path):
    """The scanner itself: imports inside methods, nested functions and relative imports count; module-level and
    TYPE_CHECKING imports do not."""
    package = tmp_path / "aitune" / "torch"
    package.mkdir(parents=True)
    source = package / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from aitune.errors import ConfigError\n"
        "if TYPE_CHECKING:\n"
        "    from aitune.torch.module import Module\n"
        "class A:\n"
        "    def f(self):\n"
        "        from aitune.torch.record import samples\n"
        "        def g():\n"
        "            import aitune.torch.backend\n"
        "            from .common import files\n"
        "            import json\n"
        "        return g\n")
    assert _local_aitune_imports(source, tmp_path) == [("aitune.torch.record", 7), ("aitune.torch.backend", 9),
                                             ("aitune.torch.common", 10)]
