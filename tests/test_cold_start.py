"""What a cold `kvrag ask` imports, and on which thread (issue 47): the guard against start-up work creeping back.

A cold ask's critical path is the main thread: imports, then the model load, then the prefill. The embedder and the
vector index (faiss) load in the retriever's thread beside the model, so nothing on the main thread may import them
first; the optional stacks (the server, Ray, object storage, constrained decoding, Triton, transformers) have no
part in a plain ask at all. A real `kvrag ask` process records every first import and its thread (an audit hook),
so the checks hold whatever the timing. No timings are asserted: they moved by 50 % under this machine's load.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

# Loaded by the retriever's thread: importing them on the main thread puts them in front of the model load.
RETRIEVAL = ("faiss", "kvrag.corpus.vector_index", "kvrag.corpus.retrieve", "kvrag.corpus.embedder")
# Never needed by a plain `kvrag ask` over a local store on the CPU.
UNUSED = ("ray", "obstore", "fastapi", "uvicorn", "starlette", "llguidance", "transformers", "sentence_transformers",
          "triton", "sklearn", "scipy", "matplotlib", "openai", "kvrag.server", "kvrag.store.remote.object_store",
          "kvrag.precompute.ray", "kvrag.engine.decode_graphs")

# The CLI in this process, with each module's first import and the thread that did it written to stderr at the end.
LAUNCH = """
import json, os, sys, threading
first = {}
def hook(event, args):
    if event == "import" and args[0] not in first:
        first[args[0]] = threading.current_thread() is threading.main_thread()
sys.addaudithook(hook)
sys.argv[0] = "kvrag"
from kvrag.cli.app import main
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
sys.stdout.flush()
sys.stderr.write("\\nIMPORTS " + json.dumps(first) + "\\n")
sys.stderr.flush()
os._exit(code)
"""


def _imports(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, bool]]:
    """Run `kvrag *args`; its result and {module: first imported on the main thread}."""
    proc = subprocess.run([sys.executable, "-c", LAUNCH, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("IMPORTS "))
    return proc, json.loads(line.removeprefix("IMPORTS "))


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_a_cold_ask_loads_retrieval_beside_the_model_and_nothing_it_does_not_use(indexed_store, tiny_llama_dir,
                                                                                    tmp_path):
    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    proc, first = _imports("ask", "How deep is Lake Baikal?", "--store", str(store), "--model", str(tiny_llama_dir),
                           "--dtype", "float32", "--device", "cpu", "-k", "1", "--max-tokens", "4", "--json")
    assert json.loads(proc.stdout)["sources"]  # it retrieved: the retrieval modules were needed, and loaded
    assert all(m in first for m in RETRIEVAL)
    on_main = sorted(m for m, main in first.items() if main and _under(m, RETRIEVAL))
    assert on_main == [], f"imported on the main thread, ahead of the model load: {on_main}"
    unused = sorted(m for m in first if _under(m, UNUSED))
    assert unused == [], f"a plain ask imported {unused}"


def test_the_ask_commands_imports_leave_retrieval_out():
    """What `kvrag ask` imports before it runs (the CLI, its command modules, the API): no retrieval, no extras."""
    code = ("import sys, json; import kvrag.cli.app as app; app._register_commands(); import kvrag.api; "
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(proc.stdout)
    assert [m for m in loaded if _under(m, RETRIEVAL + UNUSED)] == []


def test_bench_cold_reports_cpu_time_and_load_beside_wall():
    """`kvrag bench cold`'s medians (its --json) and table carry CPU seconds and the load average beside wall."""
    from kvrag.bench import cold

    def run(wall: float, load: float) -> dict:
        return {"wall": wall, "cpu_s": wall - 0.5, "rss_mb": 900.0, "load1": load, "startup": 1.0, "answer": "Ross"}

    rows = {"this": [run(2.0, 1.0), run(4.0, 3.0)], "baseline": [run(3.0, 2.0)]}
    median = cold.medians(rows)
    assert median["this"]["wall"] == 3.0 and median["this"]["cpu_s"] == 2.5 and median["this"]["load1"] == 2.0
    assert median["baseline"]["prefill"] is None  # a part no run reported
    table = cold.report(rows).splitlines()
    assert "| cpu_s | 2.500 | 2.500 |" in table and "| load1 | 2.000 | 2.000 |" in table and "| prefill | - | - |" in table
