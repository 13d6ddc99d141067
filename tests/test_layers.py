"""The house's layering (docs/design.md, "Layout"): checked on every run, so a change that breaks it fails here.

The import contracts live in pyproject.toml ([tool.importlinter]): folders import only the ones below them, no two
modules of a package import each other in a circle, and the server reaches the engine through the API alone.
Every room (each folder and top-level module, found on disk, not listed here) stands in the layers contract.
The rest are read off the source: nothing imports the tests, the environment is read only at the edge (the CLI,
the API's config and home.py; bench/ and tools/ are edges of their own), and no module passes 400 lines."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Not rooms of the house: the tests (outside the contracts, and nothing may import them: checked below), the docs,
# and what tools and builds leave beside the source.
NOT_ROOMS = {"tests", "docs", "build", "dist", "__pycache__", "__init__.py"}
# Where configuration is read from the environment: the edge (docs/design.md, "Configuration"): config.py resolves
# every setting, home.py where kvrag keeps its files, the CLI sets the process's own (offline, OpenMP), and the
# benchmarks and tools, top-level edges of their own, start subprocesses with environments they build.
ENVIRONMENT_READERS = {"config.py", "home.py", "cli/app.py"}
EDGE_PACKAGES = ("bench/", "tools/")
MAX_LINES = 400


def _rooms() -> list[Path]:
    """Every top-level folder holding Python and every top-level module but the package's own __init__.py."""
    return sorted(p for p in ROOT.iterdir()
                  if not p.name.startswith(".") and p.name not in NOT_ROOMS and not p.name.endswith(".egg-info")
                  and (p.suffix == ".py" if p.is_file() else p.is_dir() and any(p.rglob("*.py"))))


def _modules() -> list[Path]:
    """Every module of the house, the root's __init__.py too."""
    out = [ROOT / "__init__.py"]
    for room in _rooms():
        out += [room] if room.is_file() else sorted(room.rglob("*.py"))
    return out


def test_the_import_contracts_hold():
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if linter is None:
        pytest.fail("import-linter is not installed (it is in the dev extra: make install)")
    result = subprocess.run([linter, "--no-cache", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_every_room_stands_in_the_layers_contract():
    """A new folder or top-level module outside the layers would be a room whose imports nothing checks; a layer
    naming no room is a stale contract. A folder needs its __init__.py for import-linter to see it."""
    (block,) = re.findall(r"^layers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)  # no tomllib on 3.10
    layers = re.findall(r'"([^"]+)"', block)
    named = {name.removeprefix("kvrag.") for layer in layers for name in re.split(r"\s*\|\s*", layer.strip())}
    rooms = {p.stem for p in _rooms()}
    assert (rooms - named, named - rooms) == (set(), set())
    assert [p.name for p in _rooms() if p.is_dir() and not (p / "__init__.py").is_file()] == []


def test_nothing_imports_the_tests():
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
