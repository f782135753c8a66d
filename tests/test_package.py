"""What `pip install deltaserve` gives: `deltaserve --version`, and every library that `deltaserve serve`,
`deltaserve bench serve` and `deltaserve plan` import is brought by the core dependencies (no extra needed)."""

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import deltaserve

tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib to read pyproject.toml with")
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def installed_version() -> str:
    try:
        return metadata.version("deltaserve")
    except metadata.PackageNotFoundError:
        pytest.skip("deltaserve is not installed (pip install -e .): it has no package metadata to read")


def test_version_is_the_installed_package_metadata_of_pyproject():
    assert deltaserve.__version__ == installed_version() == PYPROJECT["version"]


def test_version_flag_prints_the_version():
    done = subprocess.run([sys.executable, "-m", "deltaserve", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{installed_version()}\n", "")


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Distributions these requirements install, transitively (extras and markers that do not apply dropped)."""
    seen, todo = set(), [r for r in requirements]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _name(str(req))
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # declared but not installed here: nothing further to follow
            pass
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a module imports unconditionally (its body's own import statements; not those inside
    functions, which run only when called, nor inside try/if, which are optional)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_commands_need_no_extra():
    """Load what each command loads at start-up in a fresh interpreter; every library that one of the
    deltaserve modules then loaded imports unconditionally must be installed by the core dependencies."""
    code = ("import sys, deltaserve.cli, deltaserve.server.api_server, deltaserve.bench.cli, "
            "deltaserve.cache.plan_cli, deltaserve.engine.llm_engine; "
            "print(' '.join(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'deltaserve'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    imported = set().union(*(_module_level_imports(Path(file)) for file in done.stdout.split()))
    assert {"fastapi", "uvicorn", "pydantic", "prometheus_client", "aiohttp"} <= imported  # what issue 28 names
    providers = metadata.packages_distributions()
    core = _closure(PYPROJECT["dependencies"])
    missing = {}
    for module in sorted(imported - set(sys.stdlib_module_names) - {"deltaserve", "__future__"}):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [module])}
        if not dists & core:
            missing[module] = sorted(dists)
    assert not missing, f"imported at start-up but not installed by the core dependencies: {missing}"


def test_the_wheel_carries_every_shipped_config():
    """Each published config file in deltaserve/model_configs matches a package-data pattern of
    pyproject.toml: a wheel leaves any other behind."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    configs = ROOT / "deltaserve" / "model_configs"
    files = [p for p in configs.rglob("*") if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert len(files) >= 17
    patterns = package_data.get("deltaserve.model_configs", [])
    unshipped = [str(p.relative_to(configs)) for p in files
                 if not any(p.relative_to(configs).match(pattern) for pattern in patterns)]
    assert not unshipped, f"not in [tool.setuptools.package-data] of pyproject.toml: {unshipped}"
