"""The per-model blending check (engine/model_check.py): it passes on every model kvrag runs, fails when the loader
rotates stored keys by the other rotary convention, and a KVRag over a model that failed answers with full prefill
and says so in one line."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch

from kvrag.blend.config import DEFAULT_RATIO
from kvrag.config import DEFAULT_SELECTION
from kvrag.engine import answer_check, model_check
from kvrag.engine.answer_set import make_items
from kvrag.engine.model_check import Check, CheckReport, cached_check, check_key, check_model, report_path
from kvrag.engine.prefiller import Prefiller, preamble_kv
from kvrag.model import rotary
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv
from kvrag.store.env import StoreEnv
from kvrag.store.open import store_table
from kvrag.tests.conftest import FAMILIES, WEIGHT_FORMS, run_cli_in_process

pytestmark = pytest.mark.model_check

TINY = ["tiny_llama_dir", "tiny_llama_hd64_dir", "tiny_qwen2_dir", "tiny_llama3_rope_dir"]
PASSAGES = [("Varnholt Bridge", "The Varnholt Bridge was finished in 1893 by the engineer Odile Marrant."),
            ("Odile Marrant", "Odile Marrant was born in Quessac in 1851 and taught at the mining school in Dunmore.")]
QUESTION = "Where was the engineer of the Varnholt Bridge born?"


def interleaved_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The other rotary convention (GPT-J's interleaved pairs (2i, 2i+1) instead of rotate-half's (i, i + d/2)),
    with rotary.rotate's signature: x [T, H, hd], cos/sin [T, 1, rot] (each frequency repeated over the halves)."""
    rot = cos.shape[-1]
    c, s = cos[..., :rot // 2], sin[..., :rot // 2]  # [T, 1, rot/2]: one angle per pair
    even, odd = x[..., 0:rot:2].clone(), x[..., 1:rot:2].clone()  # [T, H, rot/2]
    out = torch.empty_like(x) if out is None else out
    out[..., rot:] = x[..., rot:]
    out[..., 0:rot:2] = even * c - odd * s
    out[..., 1:rot:2] = odd * c + even * s
    return out


@pytest.fixture
def broken_rotary(monkeypatch):
    """The loader (and its in-memory chunks' copy-in) rotates loaded keys by the wrong convention; the full prefill's
    own rotary (model/rotary.py, used by every computed row) is untouched."""
    import kvrag.load.layer_work as layer_work

    wrong = types.SimpleNamespace(rotate=interleaved_rotate, cos_sin=rotary.cos_sin)
    monkeypatch.setattr(layer_work, "rotary", wrong)


@pytest.fixture(autouse=True)
def _one_thread():
    """The check's small prefills at one torch thread: on two cores, OpenMP's spinning threads (no GOMP_SPINCOUNT
    in a test process) made them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _figures(report) -> dict:
    return {c.name: c.figures for c in report.checks}


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("fixture", TINY)
def test_the_check_passes_on_the_tiny_llama_models(fixture, dtype, request):
    runtime = Runtime.load(str(request.getfixturevalue(fixture)), dtype=dtype)
    report = check_model(runtime)
    assert report.passed, _figures(report)
    if report.dtype == "float32":  # the blend's and the full prefill's rows are the same bits on the CPU
        assert _figures(report)["blend_ratio_1"]["max_rel_error"] < 1e-5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_check_passes_on_every_family(name, tiny_family):
    """The exact paths and the first-token judge per family; the answers' ladder is the same code for every family
    (the tiny llamas above and the real models run it) and a random model answers nothing, so it is left out here."""
    report = check_model(Runtime.load(str(tiny_family(name))), answers=False)
    assert report.passed and report.judged_by == "first_token", _figures(report)


@pytest.mark.real_model
def test_the_check_passes_on_smollm2(smol):
    """SmolLM2-135M answers too few of the long prompts for its answers to judge: the first-token checks do."""
    report = check_model(Runtime.load(None))
    assert report.passed and report.judged_by == "first_token", _figures(report)
    assert report.to_json()["schema"] == "kvrag.model-check/1"


def test_a_wrong_rotary_of_loaded_keys_fails_it(tiny_llama_dir, broken_rotary):
    report = check_model(Runtime.load(str(tiny_llama_dir), dtype="float32"))
    status = {c.name: c.passed for c in report.checks}
    assert status["blend_ratio_1"]  # every row computed: nothing loaded, nothing rotated by the loader
    assert not status["reuse_at_own_position"]
    assert not report.passed and report.failed().name == "reuse_at_own_position"


@pytest.mark.real_model
def test_a_wrong_rotary_fails_smollm2_on_reuse_and_on_the_default_blend(smol, broken_rotary):
    report = check_model(Runtime.load(None))
    status = {c.name: c.passed for c in report.checks}
    assert status == {"blend_ratio_1": True, "reuse_at_own_position": False, "prompt_start": True, "blend_default": False,
                      "blend_query": False}, _figures(report)
    assert report.rule is None and report.failed().name == "reuse_at_own_position"


def test_the_report_is_stored_by_model_and_dtype(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    f32, bf16 = (Runtime.load(str(tiny_llama_dir), dtype=d) for d in ("float32", "bfloat16"))
    assert report_path(f32) != report_path(bf16)
    assert cached_check(f32, run=False) is None
    first = cached_check(f32)
    assert report_path(f32).parent == tmp_path / "models" / f32.fingerprint
    assert json.loads(report_path(f32).read_text())["passed"] is True
    monkeypatch.setattr(model_check, "check_model", lambda runtime: pytest.fail("ran again"))
    assert cached_check(f32).to_json() == first.to_json()  # read back, not run again
    assert cached_check(bf16, run=False) is None  # another dtype is checked on its own
    # a lead-in set apart from the model's own (KVRAG_LEAD_IN) stores its chunks in another form: checked on its own
    led = dataclasses.replace(f32, lead_in=512)
    assert "lead_in" not in check_key(f32) and check_key(led)["lead_in"] == 512
    assert cached_check(led, run=False) is None


def test_kvrag_over_a_failing_model_answers_with_full_prefill(tiny_llama_dir, store_copy, tmp_path, monkeypatch,
                                                              capsys, broken_rotary):
    from kvrag import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))  # the broken report stays out of the session's home
    options = dict(model=str(tiny_llama_dir), dtype="float32", host_cache="0", preload_retriever=False)
    with KVRag(store_copy, **options) as rag:
        blended = rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=8)
        full = rag.ask(QUESTION, passages=PASSAGES, mode="full", max_tokens=8)
    lines = [line for line in capsys.readouterr().err.splitlines() if "blending check" in line]
    assert len(lines) == 1 and "reuse_at_own_position" in lines[0] and "full prefill" in lines[0], lines
    assert blended.mode == "full" and blended.token_ids == full.token_ids
    monkeypatch.setenv("KVRAG_MODEL_CHECK", "0")  # skipped: blends whatever the stored report says
    with KVRag(store_copy, **options) as rag:
        assert rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=2).mode == "blend"
    assert "blending check" not in capsys.readouterr().err


def test_kvrag_over_a_passing_model_blends(tiny_llama_dir, store_copy, tmp_path, monkeypatch, capsys):
    from kvrag import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    with KVRag(store_copy, model=str(tiny_llama_dir), dtype="float32", host_cache="0", preload_retriever=False) as rag:
        assert rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=2).mode == "blend"
    assert "blending check" not in capsys.readouterr().err
    assert cached_check(rag.runtime, run=False).passed  # stored at first use


def test_a_stored_answers_verdict_is_what_runs_and_every_answer_says_so(tiny_llama_dir, store_copy, tmp_path,
                                                                        monkeypatch):
    """A verdict stored under the model's key (the answers chose `query` from 0.05): a blend at `auto` runs that rule
    from that floor, an explicit ratio runs as asked, and each answer names its mode, ratio and rule."""
    from kvrag import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    runtime = Runtime.load(str(tiny_llama_dir), dtype="float32")
    exact = [Check(name, {}, {}, True) for name in ("blend_ratio_1", "reuse_at_own_position", "prompt_start")]
    answers = Check("blend_answers", {"rule": "query", "ratio": 0.05}, {}, True)
    model_check.store_report(runtime, CheckReport(runtime.fingerprint, "float32", model_check.check_key(runtime),
                                                  [*exact, answers]))
    options = dict(model=str(tiny_llama_dir), dtype="float32", host_cache="0", preload_retriever=False)
    with KVRag(store_copy, **options) as rag:
        assert (rag.engine.config.selection, rag.engine.config.ratio) == ("query", 0.05)
        assert rag.verdict == {"passed": True, "mode": "blend", "rule": "query", "ratio": 0.05, "judged_by": "answers",
                               "deferred": False}
        auto = rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=2).to_json()
        fixed = rag.ask(QUESTION, passages=PASSAGES, mode="blend", ratio=0.5, max_tokens=2).to_json()
        full = rag.ask(QUESTION, passages=PASSAGES, mode="full", max_tokens=2).to_json()
    assert (auto["mode"], auto["rule"]) == ("blend", "query") and auto["ratio"] >= 0.05
    assert (fixed["mode"], fixed["rule"]) == ("blend", "query") and fixed["ratio"] == 0.5
    assert (full["mode"], full["rule"], full["ratio"]) == ("full", None, None)


def test_model_check_cli_json(tiny_llama_dir, kvrag):
    proc = kvrag("model", "check", "--model", str(tiny_llama_dir), "--dtype", "float32", "--json")
    report = json.loads(proc.stdout)
    assert report["schema"] == "kvrag.model-check/1" and report["passed"] is True and report["dtype"] == "float32"
    assert [c["name"] for c in report["checks"]] == ["blend_ratio_1", "reuse_at_own_position", "prompt_start", "blend_default"]
    assert all({"passed", "bound"} <= set(c) for c in report["checks"])


def test_model_check_cli_table(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """Without --json: a table of every figure (the result, on stdout), the verdict on stderr, and exit 0."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    code, out, err = run_cli_in_process(monkeypatch, capsys, "model_cmd", "model", "check", "--model",
                                        str(tiny_llama_dir), "--dtype", "float32")
    assert code == 0, err
    assert all(name in out for name in ("blend_ratio_1", "reuse_at_own_position", "confident_prompts", "mean_kl"))
    assert f"blends with the '{DEFAULT_SELECTION}' selection rule" in err  # the rule it passed with


def test_model_check_cli_fails_with_one_line(tiny_llama_dir, tmp_path, monkeypatch, capsys, broken_rotary):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    code, out, err = run_cli_in_process(monkeypatch, capsys, "model_cmd", "model", "check", "--model",
                                        str(tiny_llama_dir), "--dtype", "float32", "--json")
    assert code == 1
    assert json.loads(out)["passed"] is False
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if "reuse_at_own_position" in line]
    assert len(err.strip().splitlines()) == 1


def _report(**passed) -> CheckReport:
    return CheckReport("m", "float32", {}, [Check(name, {}, {}, ok) for name, ok in passed.items()])


def test_the_rule_is_the_first_blend_check_that_passed_and_none_where_exactness_fails():
    """Hand-made reports: the default rule where its check passes, `query` where only its check does, none (full
    prefill) where no blend check or any exactness check fails, and the failure named is the one that decided it."""
    exact = {"blend_ratio_1": True, "reuse_at_own_position": True, "prompt_start": True}
    assert _report(**exact, blend_default=True).rule == DEFAULT_SELECTION
    fallback = _report(**exact, blend_default=False, blend_query=True)
    assert fallback.rule == "query" and fallback.passed and fallback.failed() is None
    neither = _report(**exact, blend_default=False, blend_query=False)
    assert neither.rule is None and not neither.passed and neither.failed().name == "blend_default"
    broken = _report(**{**exact, "reuse_at_own_position": False}, blend_default=True)
    assert broken.rule is None and broken.failed().name == "reuse_at_own_position"
    assert CheckReport.from_json(fallback.to_json()).rule == "query"
    assert fallback.ratio == DEFAULT_RATIO and fallback.judged_by == "first_token"


def test_the_answers_check_decides_the_rule_and_the_ratio():
    """Hand-made: where the answers judged the blend, its choice is what runs (rule and the ratio auto starts from),
    and a failed answers check means full prefill, whatever a first-token check would have said."""
    exact = [Check(name, {}, {}, True) for name in ("blend_ratio_1", "reuse_at_own_position", "prompt_start")]
    chosen = CheckReport("m", "bfloat16", {}, [*exact, Check("blend_answers", {"rule": "query", "ratio": 0.05}, {}, True)])
    assert (chosen.rule, chosen.ratio, chosen.judged_by, chosen.passed) == ("query", 0.05, "answers", True)
    assert chosen.verdict() == {"passed": True, "mode": "blend", "rule": "query", "ratio": 0.05, "judged_by": "answers",
                               "deferred": False}
    again = CheckReport.from_json(json.loads(json.dumps(chosen.to_json())))
    assert (again.rule, again.ratio) == ("query", 0.05)
    lost = CheckReport("m", "bfloat16", {}, [*exact, Check("blend_answers", {"rule": None, "ratio": None,
                                                                             "summary": "best chunks@0.05"}, {}, False)])
    assert lost.rule is None and lost.ratio is None and lost.failed().name == "blend_answers"
    assert lost.verdict()["mode"] == "full" and "no ratio" in lost.failed().failure()


@pytest.mark.real_model
def test_the_answers_judge_reads_the_dense_stored_kv_and_fails_a_wrong_rotary(qwen05, broken_rotary, tmp_path):
    """Qwen2.5-0.5B answers enough of the check's long prompts for its answers to judge. Its ladder reads the
    prompts' chunks as `ask` reads them, the dense model's KV from a store (each prompt's stored before its first
    blend), with int8 weights too (before: the int8 model's KV, in memory, which `ask` never reads). With loaded keys
    rotated by the wrong convention no rung keeps the answers (each stops at its first loss), so the model would be
    answered with full prefill."""
    form = "int8" if "int8" in WEIGHT_FORMS else "dense"  # the Qwen models' default where the CPU has VNNI
    # no prepared files: 3.5 GB of them filled CI's disk, and this test is the only one loading the model so
    runtime = Runtime.load(str(qwen05.path), dtype="float32", weights=form, keep_prepared=False)
    torch.set_num_threads(2)  # a 0.5B model's 1,500-token prefills: a second core halves them
    # shorter prompts than the check's own, of the kinds this model answers (a suite on two cores has no 3 minutes)
    items = make_items(4, answer_check.SEED, tokens=(1500, 1800), kinds=("lookup", "comparison"))
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        # the cheapest rung and the most generous one: a wrong rotary loses the answers at both
        result = answer_check.run_answers(runtime, Prefiller.open(runtime, env), rules=(DEFAULT_SELECTION,),
                                          items=items, ladder=(0.05, 0.3))
        table = store_table(env, runtime.fingerprint)
        chunks = answer_check.item_chunks(runtime, items[0])  # every rung blends the first prompt at least
        assert not table.missing([c for c, _ in chunks])
        chunk_id, ids = chunks[-1]  # a passage that is not first
        k, _ = table.get_layer(chunk_id, 1, dtype=np.float32)
    assert result.judged, result.figures()
    assert result.choice is None and result.rungs, result.figures()
    assert all(r.kept < answer_check.KEPT_BOUND * r.right or r.agreed < r.items for r in result.rungs), result.figures()
    dense = runtime.with_weights("dense")
    want = chunk_kv(dense, preamble_kv(dense), ids)
    want_k = want.k[1].float()
    assert (torch.from_numpy(k) - want_k).abs().max() <= 1e-3 * want_k.abs().max()  # fp16's rounding
