"""`kvrag bench fidelity` end to end on the tiny random model: two short invented items and one RULER-style needle,
every rule at two ratios; the report's figures against what they must be by construction (full prefill against
itself, full reuse against itself, ratio 1 against full prefill), and an interrupted sweep resumed from its records.
Timings are measured, never asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvrag.bench.fidelity import agreed_prefix, summarize, tolerance_speedups
from kvrag.bench.rag.methods import Method
from kvrag.bench.rag.runner import BenchRun, MethodRun
from kvrag.engine.prefiller import preamble_kv
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv
from kvrag.store.env import StoreEnv
from kvrag.store.open import store_table
from kvrag.tests.conftest import WEIGHT_FORMS, run_cli_in_process


def test_agreed_prefix_and_tolerance_by_hand():
    assert agreed_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5 and agreed_prefix([1, 2], [1, 2, 3]) == 1.0
    assert agreed_prefix([], []) == 1.0 and agreed_prefix([5], [6]) == 0.0
    summary = {  # KL / reuse falls with the ratio; TTFT rises
        "query@0.1": {"mode": "blend", "rule": "query", "ratio": 0.1, "kl_vs_reuse": 0.3, "median_ttft_ratio_to_full": 0.2},
        "query@0.2": {"mode": "blend", "rule": "query", "ratio": 0.2, "kl_vs_reuse": 0.15, "median_ttft_ratio_to_full": 0.25},
        "epic@0.2": {"mode": "blend", "rule": "epic", "ratio": 0.2, "kl_vs_reuse": 0.5, "median_ttft_ratio_to_full": 0.25},
    }
    hits = tolerance_speedups(summary, (0.2, 0.4))
    assert hits["query"]["0.2"]["ratio"] == 0.2 and hits["query"]["0.2"]["speedup"] == pytest.approx(4.0)
    assert hits["query"]["0.4"]["ratio"] == 0.1 and hits["epic"]["0.2"] is None


def test_kept_right_answers_by_hand():
    """Full prefill right (F1 >= 0.5) on items 0, 1 and 3; the blend right on 0 and 2 and half right on 3: it keeps
    1 of full prefill's 3 right answers, whatever it gets right where full prefill did not (item 2)."""
    def run(item: int, method: str, f1: float) -> MethodRun:
        return MethodRun(item, method, 0, None, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 10, 5, 0, 0, "", [],
                         f1=f1, em=float(f1 == 1.0))
    bench = BenchRun([Method("full", "full"), Method("blend", "blend", 0.15)], [])
    bench.runs = [run(0, "full", 1.0), run(1, "full", 0.5), run(2, "full", 0.0), run(3, "full", 0.8),
                  run(0, "blend", 1.0), run(1, "blend", 0.4), run(2, "blend", 1.0), run(3, "blend", 0.3)]
    summary = summarize(bench)
    assert summary["full"]["kept_right"] == 1.0 and summary["full"]["items_full_right"] == 3
    assert summary["blend"]["kept_right"] == pytest.approx(1 / 3)
    assert summary["blend"]["em"] == 0.5 and summary["full"]["em"] == 0.25


def test_bench_fidelity_sweeps_rules_and_resumes(monkeypatch, capsys, tmp_path, tiny_llama_dir, short_items):
    records = tmp_path / "fid.jsonl"
    args = ("bench", "fidelity", "--dataset", str(short_items), "--split", "tune", "--items", "2",
            "--model", str(tiny_llama_dir), "--dtype", "float32", "--store", str(tmp_path / "store"),
            "--rules", "cacheblend,query,chunks,epic", "--ratios", "0.3,1", "--max-tokens", "4",
            "--ruler", "needle", "--ruler-lengths", "700", "--ruler-per-cell", "1", "--records", str(records))
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", *args, "--out", str(tmp_path / "out"), "--json")
    assert code == 0, err
    report = json.loads(out)
    methods = report["methods"]
    assert list(methods) == ["full", "reuse"] + [f"{rule}@{r}" for rule in ("cacheblend", "query", "chunks", "epic")
                                                 for r in ("0.3", "1")]
    assert methods["full"]["top1_agreement"] == 1.0 and methods["full"]["mean_kl"] == 0.0
    assert methods["full"]["agreed_prefix"] == 1.0 and methods["reuse"]["kl_vs_reuse"] == pytest.approx(1.0)
    for rule in ("cacheblend", "query", "chunks", "epic"):
        whole = methods[f"{rule}@1"]
        assert whole["items"] == 2 and whole["top1_agreement"] == 1.0 and whole["mean_kl"] < 1e-6, rule
        assert methods[f"{rule}@0.3"]["median_ttft_ratio_to_full"] is not None
    assert set(report["tolerances"]) == {"cacheblend", "query", "chunks", "epic"}
    assert report["ruler"]["tasks"] == 1 and set(report["ruler"]["kept_right"]) == set(methods)
    forms = report["chunk_forms"]  # a model with no sliding layer: one form, every chunk read in it
    assert forms["stored"] == ["after_preamble"] and forms["lead_in_tokens"] == 0
    assert forms["read"]["after_preamble"] > 0 and forms["read"]["after_lead_in"] == 0
    assert (tmp_path / "out" / "fidelity_pareto.png").stat().st_size > 0
    assert "| query@0.3 |" in (tmp_path / "out" / "report.md").read_text()
    # an interrupted sweep: drop the second item's runs, and the rerun runs that item alone
    lines = records.read_text().splitlines()
    first = json.loads(lines[0])["item"]
    records.write_text("\n".join(line for line in lines if json.loads(line)["item"] == first) + "\n")
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", *args, "--json")
    assert code == 0, err
    assert "item 1/2 (in the records)" in err and "item 2/2\n" in err
    again = json.loads(out)
    assert again["methods"]["cacheblend@1"]["items"] == 2 and again["methods"]["full"]["mean_kl"] == 0.0
    # the chunks read are this process's, and the report says the other item came from the records
    assert report["items_from_records"] == 0 and again["items_from_records"] == 1
    assert again["chunk_forms"]["read"]["after_preamble"] < forms["read"]["after_preamble"]


def test_bench_fidelity_refuses_bad_options_in_one_line(monkeypatch, capsys):
    code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "fidelity", "--rules", "nope")
    assert code != 0 and "--rules takes names from cacheblend" in err and "Traceback" not in err
    code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "fidelity", "--ratios", "0.1,2")
    assert code != 0 and "--ratios takes ratios between 0 and 1" in err


def test_answer_shares_by_hand():
    """Three generated items; full prefill right on 0 and 1 (a whole sentence naming the value counts), the blend
    right on 0 and 2: it keeps 1 of 2, turns 1 of 1 right, and agrees with full prefill on item 0 alone."""
    from kvrag.bench.answers import cannot_answer, markdown, summarize_answers
    from kvrag.bench.rag.items import BenchItem

    def run(item: int, method: str, answer: str) -> MethodRun:
        return MethodRun(item, method, 0, None, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 10, 5, 0, 0, answer, [],
                         ttft_ratio_to_full=1.0 if method == "full" else 0.25)
    meta = {0: {"kind": "lookup", "wrong": ["Gindtrol"]}, 1: {"kind": "lookup", "wrong": ["Bile"]},
            2: {"kind": "comparison", "wrong": ["Libaus Club"]}}
    golds = {0: ["Tunvan"], 1: ["Himfaus"], 2: ["Lortson League", "Lortson"]}
    bench = BenchRun([Method("full", "full"), Method("blend", "blend", 0.15)],
                     [BenchItem(i, "q?", golds[i], [("c", [1])]) for i in golds])
    bench.runs = [run(0, "full", "Tunvan"), run(1, "full", "Her dog was named Himfaus."), run(2, "full", "Libaus Club"),
                  run(0, "blend", "The Tunvan."), run(1, "blend", "Bile"), run(2, "blend", "The Lortson League")]
    summary = summarize_answers(bench, meta)
    blend, full = summary["blend"], summary["full"]
    assert (full["accuracy"]["k"], full["kept"]["k"], full["kept"]["n"], full["agreement"]["k"]) == (2, 2, 2, 3)
    assert (blend["kept"]["k"], blend["kept"]["n"], blend["turned_right"]["k"], blend["turned_right"]["n"]) == (1, 2, 1, 1)
    assert blend["agreement"]["k"] == 1 and blend["median_ttft_ratio_to_full"] == 0.25
    assert blend["by_kind"]["lookup"]["kept"]["k"] == 1 and blend["by_kind"]["comparison"]["accuracy"]["k"] == 1
    # a guess between two candidates is right half the time: full prefill, wrong on the one comparison, is no better
    assert full["by_kind"]["lookup"]["chance"] == 0.5 and cannot_answer(summary) == {
        "comparison": (full["by_kind"]["comparison"]["accuracy"], 0.5)}
    assert "no better than a guess among the candidates: comparison (0/1" in markdown(summary)


def test_bench_fidelity_answerable_set_with_auto(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    """--set answerable on the tiny model: generated items among MuSiQue passages of the split (a file of two items
    here), full prefill agreeing with itself, and blend@auto run as the model's verdict says (none stored: r*)."""
    data = tmp_path / "musique.json"
    data.write_text(json.dumps([{"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": f"Passage {i} " * 30}
                                                                            for i in range(6)]}] * 2))
    args = ("bench", "fidelity", "--dataset", str(data), "--set", "answerable", "--split", "tune", "--items", "4",
            "--tokens", "300,400", "--model", str(tiny_llama_dir), "--dtype", "float32", "--store",
            str(tmp_path / "store"), "--rules", "chunks", "--ratios", "0.3,auto", "--max-tokens", "3", "--ruler", "")
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    answers = report["answers"]
    assert list(answers) == ["full", "reuse", "blend@auto", "chunks@0.3"]
    assert answers["full"]["agreement"]["share"] == 1.0 and answers["full"]["items"] == 4
    assert set(answers["full"]["by_kind"]) == {"lookup", "bridge", "comparison", "aggregation"}
    assert report["set"] == "answerable" and report["auto"]["rule"] == "chunks" and report["auto"]["ratio"] == 0.15


@pytest.mark.skipif("int8" not in WEIGHT_FORMS, reason="int8 weights need AVX512-VNNI (kernels/quant.py)")
def test_a_quantized_model_benches_over_the_dense_models_stored_kv(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    """With int8 weights (the default of the Qwen models on a VNNI CPU) the bench's chunks are stored as `kvrag
    precompute` stores them, from the dense weights, and every timed run reads them: before, an int8 engine stored
    nothing, so each method computed every chunk inside its timed run, with int8 weights `ask` never reads."""
    monkeypatch.setenv("KVRAG_WEIGHTS", "int8")
    data = tmp_path / "musique.json"
    data.write_text(json.dumps([{"question": "q", "answers": ["a"], "ctxs": [{"title": "", "text": f"Passage {i} " * 30}
                                                                            for i in range(6)]}] * 2))
    store = tmp_path / "store"
    args = ("bench", "fidelity", "--dataset", str(data), "--set", "answerable", "--split", "tune", "--items", "2",
            "--tokens", "300,400", "--model", str(tiny_llama_dir), "--dtype", "float32", "--store", str(store),
            "--rules", "chunks", "--ratios", "0.3", "--max-tokens", "2", "--ruler", "")
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["chunk_forms"]["read"]["after_preamble"] > 0
    dense = Runtime.load(str(tiny_llama_dir), "float32", weights="dense")
    int8 = dense.with_weights("int8")
    with StoreEnv.open(store) as env:
        stored = list(store_table(env, dense.fingerprint).iter_chunks())
        assert len(stored) >= 4  # every passage of both prompts (the fact records and the filler)
        chunk_id, record = stored[-1]
        ids = list(record.token_ids)
        k, v = store_table(env, dense.fingerprint).get_layer(chunk_id, 1, dtype=np.float32)
    for runtime, close in ((dense, True), (int8, False)):  # the dense model's KV, within fp16's rounding
        want = chunk_kv(runtime, preamble_kv(runtime), ids)
        err_k = (torch.from_numpy(k) - want.k[1].float()).abs().max().item()
        assert (err_k < 2e-3) == close, (runtime.model.weights, err_k)
