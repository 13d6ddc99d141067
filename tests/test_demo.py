"""`make demo`'s path with the real default model: every demo question is answered right, blended and in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag.kernels import native
from kvrag.kernels.native import cpu_has_amx, cpu_has_fast_bf16
from kvrag.tests.conftest import run_kvrag

ROOT = Path(__file__).resolve().parents[1]
SAMPLE, QUESTIONS = ROOT / "corpus" / "sample", ROOT / "corpus" / "demo-questions.jsonl"


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory, smol) -> Path:
    store = tmp_path_factory.mktemp("demo") / "store"
    run_kvrag("index", str(SAMPLE), "--store", str(store))
    run_kvrag("precompute", "--store", str(store))
    return store


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["blend", "full"])
def test_every_demo_question_gets_its_answer(kvrag, demo_store, mode):
    expected = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    assert len(expected) == len(list(SAMPLE.iterdir()))  # one question per bundled document
    out = json.loads(kvrag("ask", "--questions", str(QUESTIONS), "--store", str(demo_store), "--mode", mode,
                           "--json").stdout)
    right = []
    for item, answer in zip(expected, out, strict=True):
        right.append(any(a.lower() in answer["answer"].lower() for a in item["answers"]))
        assert answer["computed_chunks"] == []  # precomputed: every chunk's KV came from the store
        assert len(answer["sources"]) == 1  # the other documents score far below the right one
    # The 135M model's wording follows the CPU's arithmetic, so each path has its own answer (measured on each):
    # with AVX512-BF16 and no AMX (bf16, native kernels) all five are right; with AMX, whose bf16 attention is SDPA's,
    # the blend's LMDB answer misses (the full prefill's does not); on an AVX2-only CPU (float32, or bf16 without
    # the kernels) the VEI and LMDB answers miss, in both modes. The ones each path gets are all asserted.
    # LMDB is a tie in the model itself, not a blending error: in float32 blend and full prefill agree (KV to 1e-12)
    # and both say "a cache" (' cache' over ' L' by 0.007 logits); with AMX, bf16's full prefill puts ' L' ahead by
    # 0.023 and its blend ' cache' by 0.053, each as far from float32's KV as from the other (issue 59).
    bf16_path = cpu_has_fast_bf16() and native.library() is not None
    want = (4 if mode == "blend" and cpu_has_amx() else len(expected)) if bf16_path else 3
    assert all(right[:want]), [a["answer"] for a in out]


@pytest.mark.real_model
def test_with_every_chunk_kept_the_small_model_loses_the_lighthouse_answer(kvrag, demo_store):
    """Why retrieval drops far-off chunks (--relative-cutoff): with all five documents in the prompt, the
    135M model no longer names the keeper. If this starts passing, the cutoff's reason should be measured again."""
    out = json.loads(kvrag("ask", "Who was the last keeper of the Skerry Point lighthouse?", "--store",
                           str(demo_store), "--relative-cutoff", "0", "--min-score", "0", "--json").stdout)
    assert len(out["sources"]) == 5
    assert "margaret ross" not in out["answer"].lower()
