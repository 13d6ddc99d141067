"""kvrag without its optional extras (obstore for `s3://` stores, Ray for `precompute --ray`), as a plain
`pip install kvrag` or a GPU image leaves it: a local store answers, and asking for the missing extra gives one
line that says how to install it. The packages are hidden from a real CLI process (a None in sys.modules makes
their import fail), since the suite's own venv has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HIDE = ("obstore", "ray")
LAUNCH = ("import sys; sys.modules.update(dict.fromkeys({hide!r})); sys.argv[0] = 'kvrag'; "
          "from kvrag.cli.app import run; run()")


def _kvrag_without_extras(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCH.format(hide=HIDE), *args], capture_output=True, text=True,
                          env={**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})


def test_a_local_store_answers_without_obstore_or_ray(indexed_store, tiny_llama_dir, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    proc = _kvrag_without_extras("ask", "How deep is Lake Baikal?", "--store", str(store), "--model",
                                 str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"]


def test_an_s3_store_without_obstore_says_how_to_install_it():
    proc = _kvrag_without_extras("ask", "How deep is Lake Baikal?", "--store", "s3://bucket/prefix")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["error: --store s3://... needs obstore: pip install 'kvrag[s3]'"]
