"""The blending check resumes where it stopped (its journal, engine/answer_check.py), and a first use whose check
would run past its budget is answered in full at once, saying so, instead of checking for an hour."""

from __future__ import annotations

import json

import pytest
import torch

from kvrag.engine import answer_check, model_check
from kvrag.engine.answer_check import Journal
from kvrag.engine.model_check import check_key, check_model, report_path
from kvrag.model.runtime import Runtime
from tests.conftest import run_kvrag
from tests.test_model_check import PASSAGES, QUESTION

pytestmark = pytest.mark.model_check


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_check_put_off_by_its_budget_resumes_from_its_journal(tiny_llama_dir, tmp_path, monkeypatch):
    runtime = Runtime.load(str(tiny_llama_dir), dtype="float32")  # answers nothing right: judged by first tokens
    path = tmp_path / "journal.json"
    put_off = check_model(runtime, journal=Journal(path, check_key(runtime)), budget_s=1e-3)
    assert put_off.deferred and put_off.rule is None and put_off.verdict()["mode"] == "full"
    assert put_off.judged_by is None and "put off" in put_off.failed().failure()
    saved = json.loads(path.read_text())
    assert len(saved["full"]) == 1 and len(saved["exact"]) == 3 and saved["key"] == check_key(runtime)

    calls = []
    real = answer_check.answer
    monkeypatch.setattr(answer_check, "answer", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(model_check, "last_logits", _no_exactness_again(model_check.last_logits))
    resumed = check_model(runtime, journal=Journal.load(path, check_key(runtime)))
    journal = Journal.load(path, check_key(runtime))
    assert not resumed.deferred and journal.full[0] == saved["full"][0]
    assert calls.count("full") == len(journal.full) - 1  # the first prompt's full prefill was not run again
    assert [c.name for c in resumed.checks[:3]] == [c.name for c in put_off.checks[:3]]
    assert Journal.load(path, {**check_key(runtime), "dtype": "bfloat16"}).full == []  # another key starts afresh


def _no_exactness_again(real):
    def runs(runtime, prefiller, wanted, progress=None):
        assert "blend_ratio_1" not in wanted, "the exactness checks ran again"
        return real(runtime, prefiller, wanted, progress)
    return runs


def test_a_first_use_over_the_budget_answers_in_full_and_says_so(tiny_llama_dir, store_copy, tmp_path, monkeypatch,
                                                                 capsys):
    from kvrag import KVRag

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    options = dict(model=str(tiny_llama_dir), dtype="float32", host_cache="0", preload_retriever=False)
    with KVRag(store_copy, check_budget=0, **options) as rag:
        blended = rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=4)
        full = rag.ask(QUESTION, passages=PASSAGES, mode="full", max_tokens=4)
        runtime = rag.runtime
    lines = [line for line in capsys.readouterr().err.splitlines() if "checked for blending" in line]
    assert len(lines) == 1 and "full prefill" in lines[0] and "kvrag model check" in lines[0], lines
    assert blended.mode == "full" and blended.token_ids == full.token_ids
    assert not report_path(runtime).exists()  # put off, not failed: nothing stored as the model's verdict
    assert len(model_check.journal_for(runtime).full) == 1  # what the first use did is kept for the check
    info = json.loads(run_kvrag("model", "info", "--model", str(tiny_llama_dir), "--dtype", "float32", "--json",
                                env={"KVRAG_HOME": str(tmp_path), "KVRAG_MODEL_CHECK": "1"}).stdout)
    assert info["blend"]["verdict"]["deferred"] and info["blend"]["rule"] is None
    assert "put off or interrupted (1 long prompts done)" in info["blend"]["summary"]
    with KVRag(store_copy, **options) as rag:  # the default budget: the check resumes and finishes
        assert rag.ask(QUESTION, passages=PASSAGES, mode="blend", max_tokens=2).mode == "blend"
    assert report_path(runtime).exists() and model_check.journal_for(runtime).full == []
