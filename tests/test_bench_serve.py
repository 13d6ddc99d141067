"""`kvrag bench serve` end to end on the tiny random model over the small indexed corpus: real `kvrag serve`
processes, a real `openai` client. Checks the report's shape, that every request was served and counted by the
server, and what each configuration reused; timings are measured, never asserted."""

from __future__ import annotations

import json

import pytest

from kvrag.bench.serve_report import markdown
from kvrag.tests.conftest import run_cli_in_process, run_kvrag

QUESTIONS = ["How deep is Lake Baikal?", "Which river is the longest in Africa?", "How high is Mount Everest?",
             "Where is the lowest land on Earth?"]
REQUESTS = 4


@pytest.fixture
def served_inputs(monkeypatch, tmp_path, store_copy, tiny_llama_dir):
    """The store precomputed for the tiny model, the questions' file and a work folder; one thread a server."""
    monkeypatch.setenv("KVRAG_THREADS", "1")
    run_kvrag("precompute", "--store", str(store_copy), "--model", str(tiny_llama_dir), "--dtype", "float32")
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")
    return questions, tmp_path / "work"


def test_bench_serve_serves_every_request(monkeypatch, capsys, served_inputs, store_copy, tiny_llama_dir):
    questions, work = served_inputs
    # a limit no answer can miss: every rate runs, so the shape does not depend on this machine's speed
    code, out, err = run_cli_in_process(
        monkeypatch, capsys, "bench", "bench", "serve", "--store", str(store_copy), "--questions",
        str(questions), "--work", str(work), "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--configs", "full,blend+tiers", "--rates", "20,5", "--requests-per-rate", str(REQUESTS),
        "--seconds-per-rate", "60", "--ttft-limit", "1000", "--max-tokens", "4", "--latency-runs", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "kvrag.bench-serve/1" and report["config"]["questions"] == len(QUESTIONS)
    assert report["config"]["ttft_limit_s"] == 1000 and "given" in report["config"]["ttft_limit_rule"]
    assert json.loads((work / "report.json").read_text())["configs"].keys() == {"full", "blend+tiers"}
    for name, config in report["configs"].items():
        assert config["server_exit_status"] == 0, name  # SIGTERM: a graceful stop
        assert [p["rate_qps"] for p in config["points"]] == [5, 20], name  # rising
        for p in config["points"]:
            assert p["sent"] == p["served"] == REQUESTS and p["failed"] == 0 and p["errors"] == {}, (name, p)
            assert p["within_limit"] and None not in (p["ttft_p50_s"], p["ttft_mean_s"], p["ttft_p99_s"])
            assert p["ttft_p50_s"] <= p["latency_p50_s"]
            server = p["server"]
            assert sum(server["requests"].values()) == REQUESTS, (name, server)  # the server counted each one
            assert server["prompt_tokens_reused"] + server["prompt_tokens_computed"] == \
                REQUESTS * p["prompt_tokens_mean"]
        assert config["throughput_qps"] == 20
        single = config["single_question"]
        assert len(single["runs"]) == 2, single  # one question, two A/B pairs
        for run in single["runs"]:  # B was asked with A's chunks by id: the same prompt without retrieval
            assert "error" not in run and run["chunks"] >= 1 and run["same_prompt"], run
            assert run["completion_tokens"] >= 1 and run["question"] == 0, run
        assert len(config["simulated"]) == len(config["points"])
    full, tiers = report["configs"]["full"], report["configs"]["blend+tiers"]
    assert all(p["server"]["prompt_tokens_reused"] == 0 and p["cached_tokens_share"] == 0 for p in full["points"])
    # every chunk's KV is stored: a blend reuses most prompt tokens, and the usage field says so too
    assert all(p["server"]["reused_share"] > 0.5 and p["cached_tokens_share"] > 0.5 for p in tiers["points"])
    assert report["throughput_ratio_tiers_to_full"] == 1.0
    table = markdown(report)
    assert "| blend+tiers | 20 |" in table and "blend with tiers ÷ full prefill: 1.00×" in table


def test_bench_serve_bad_options_are_one_line(monkeypatch, capsys, tmp_path, store_copy):
    for args, message in ((["--store", str(store_copy)], "--store and --questions go together"),
                          (["--configs", "full,turbo"], "--configs takes"),
                          (["--configs", "blend"], "without --ttft-limit"),
                          (["--rates", "1,-2"], "--rates takes positive numbers")):
        code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "serve", "--work",
                                          str(tmp_path), *args)
        assert code == 1 and err.count("\n") == 1 and message in err, (args, err)


def test_bench_serve_soak_reads_the_servers_memory_each_window(monkeypatch, capsys, served_inputs, store_copy,
                                                                tiny_llama_dir):
    """`--soak` at a toy size (three windows of 4 s, one of warm-up): one real server under the mixed load, every
    request served, each window's RSS read off the running server; the ratios are measurements, not asserted."""
    questions, work = served_inputs
    code, out, err = run_cli_in_process(
        monkeypatch, capsys, "bench", "bench", "serve", "--store", str(store_copy), "--questions", str(questions),
        "--work", str(work), "--model", str(tiny_llama_dir), "--dtype", "float32", "--soak", "0.1",
        "--soak-rate", "1", "--soak-window", "4", "--max-tokens", "4", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "kvrag.bench-serve-soak/1" and report["server_exit_status"] == 0
    windows = report["windows"]
    assert [w["mode"] for w in windows] == ["blend", "full", "reuse"] and windows[0]["warmup"]
    assert report["failed"] == 0 and all(w["served"] == w["sent"] > 0 for w in windows)
    assert all(w["rss_mb"] > 50 for w in windows)  # a Python process with torch and a model loaded
    assert report["rss_end_over_start"] == windows[-1]["rss_mb"] / windows[1]["rss_mb"]
    assert json.loads((work / "soak.json").read_text())["windows"] == windows


def test_bench_serve_mixed_soak_then_a_kill_loses_nothing_stored(monkeypatch, capsys, served_inputs, store_copy,
                                                                  tiny_llama_dir):
    """`--soak --mixed` at a toy size: every kind of client against one real server (the tiny model), each answered
    or, for the broken request, refused in the API's format; then kill -9 as a write-back begins: `store verify`
    passes, no corpus chunk is lost, no kept passage's record names missing KV, and the restarted server answers
    every kind."""
    from kvrag.bench.serve_mixed import KINDS

    questions, work = served_inputs
    code, out, err = run_cli_in_process(
        monkeypatch, capsys, "bench", "bench", "serve", "--store", str(store_copy), "--questions", str(questions),
        "--work", str(work), "--model", str(tiny_llama_dir), "--dtype", "float32", "--soak", "0.1",
        "--soak-rate", "2", "--soak-window", "3", "--max-tokens", "4", "--mixed", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "kvrag.bench-serve-mixed/1"
    assert report["hangs"] == 0 and report["server_errors"] == 0
    got = {kind for w in report["windows"] for kind in w["kinds"]}
    assert got == set(KINDS)
    for w in report["windows"]:
        for kind, outcomes in w["kinds"].items():
            assert outcomes == {"4xx" if kind == "bad" else "ok": sum(outcomes.values())}, (kind, outcomes)
    crash = report["crash"]
    assert crash["statuses"] == [200, 200] and crash["verify_exit"] == 0
    assert crash["corpus_lost"] == [] and crash["corpus_before"] > 0 and crash["records_without_kv"] == []
    assert crash["kept_bytes"] <= crash["kept_bound"]
    assert report["restart"] == {kind: "4xx" if kind == "bad" else "ok" for kind in KINDS}
