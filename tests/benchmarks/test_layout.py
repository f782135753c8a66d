"""benchmarks/ stays outside the product: no deltaserve module imports it, and the wheel does not pack it."""

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib to read pyproject.toml with")
ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_package_never_imports_benchmarks():
    importers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "deltaserve").rglob("*.py")
                       if any(name.split(".")[0] == "benchmarks" for name in _imported_modules(path)))
    assert not importers, f"deltaserve modules importing benchmarks/: {importers}"


def test_the_wheel_leaves_benchmarks_out():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["deltaserve*"]
    assert (ROOT / "benchmarks" / "offline.py").is_file()
