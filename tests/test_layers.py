"""The house's layering (docs/design.md, "Layout"): checked on every run, so a change that breaks it fails here.

The import contracts live in pyproject.toml ([tool.importlinter]): folders import only the ones below them, no two
modules of a package import each other in a circle, and the server reaches the engine through the API alone.
The rest are read off the source: nothing in the package imports the tests, the environment is read only at the
edge (the CLI, the server, the API's config and home.py), and no module passes 400 lines."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("api.py", "blend", "load", "cli", "corpus", "engine", "kernels", "model", "precompute", "server", "store",
                "bench", "home.py", "errors.py", "config.py", "__init__.py", "__main__.py")
# Where configuration is read from the environment: the edge (docs/design.md, "Configuration"): config.py resolves
# every setting, home.py where kvrag keeps its files, the CLI sets the process's own (offline, OpenMP), and the
# benchmarks, a top-level edge of their own, start subprocesses with environments they build.
ENVIRONMENT_READERS = {"config.py", "home.py", "cli/app.py"}
EDGE_PACKAGES = ("bench/",)
MAX_LINES = 400


def _modules() -> list[Path]:
    out = []
    for name in PACKAGE_DIRS:
        path = ROOT / name
        out += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [p for p in out if p.exists()]


def test_the_import_contracts_hold():
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if linter is None:
        pytest.fail("import-linter is not installed (it is in the dev extra: make install)")
    result = subprocess.run([linter, "--no-cache", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_nothing_in_the_package_imports_the_tests():
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("kvrag.tests")]
    assert offenders == []


def test_the_environment_is_read_only_at_the_edge():
    readers = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        source = path.read_text()
        if rel in ENVIRONMENT_READERS or rel.startswith(EDGE_PACKAGES):
            continue
        if "os.environ" in source or "getenv(" in source:
            readers.append(rel)
    assert readers == [], "read the setting in config.py and pass it down"


def test_no_module_passes_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
