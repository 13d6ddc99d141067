"""A package installed without the `bench` extra (`pip install .`: no matplotlib, no openai) runs every other
command, and `kvrag bench` says in one line how to get the extra."""

from __future__ import annotations

import subprocess
import sys

HIDE_AND_RUN = """
import importlib.abc, sys

class Hidden(importlib.abc.MetaPathFinder):  # as if the bench extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "openai"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hidden())
sys.argv = ["kvrag", *sys.argv[1:]]
from kvrag.cli.app import main
main()
"""


def _kvrag(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_AND_RUN, *args], capture_output=True, text=True, timeout=120)


def test_kvrag_bench_without_the_extra_is_one_line_saying_how_to_get_it():
    proc = _kvrag("bench", "--dataset", "sample")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: the benchmarks need matplotlib, which is not installed: pip install 'kvrag[bench]'"]
    assert "Traceback" not in proc.stderr


def test_the_other_commands_run_without_the_extra():
    proc = _kvrag("--help")
    assert proc.returncode == 0 and "ask" in proc.stdout and "precompute" in proc.stdout
    proc = _kvrag("model", "--help")
    assert proc.returncode == 0 and "info" in proc.stdout
