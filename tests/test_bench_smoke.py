"""`kvrag bench` end to end on the tiny random model over 2 invented MuSiQue-shaped items cut short.

Checks the report's structure and that every method ran on every item; timings are measured, never
asserted.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest

from kvrag.tests.conftest import run_cli_in_process

METHODS = ["full", "prefix", "reuse", "blend@0.15", "blend@1", "blend@auto"]


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli_in_process(monkeypatch, capsys, "bench", *args)


def test_bench_runs_every_method_and_writes_the_report(monkeypatch, capsys, tmp_path, tiny_llama_dir, short_items):
    out_dir = tmp_path / "out"
    code, out, err = run(monkeypatch, capsys, "bench", "--dataset", str(short_items), "--model", str(tiny_llama_dir),
                         "--dtype", "float32", "--store", str(tmp_path / "store"), "--ratios", "0.15,1,auto",
                         "--max-tokens", "4", "--arrivals", "200", "--cache-requests", "200",
                         "--cache-sizes", "1MiB,64MiB", "--out", str(out_dir), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "kvrag-bench/1" and report["items"] == 2
    assert set(report["machine"]["versions"]) >= {"kvrag", "python", "torch", "transformers"}
    assert list(report["methods"]) == METHODS
    for name, m in report["methods"].items():
        assert m["runs"] == 2, name
        for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_ttft_ratio_to_full",
                    "compute_share_of_ttft", "f1", "exact_match", "top1_agreement", "mean_kl",
                    "identical_answer_share", "f1_vs_full", "mean_recomputed_tokens", "mean_bytes_loaded"):
            assert m[key] is not None, (name, key)
    full, reuse = report["methods"]["full"], report["methods"]["reuse"]
    assert full["top1_agreement"] == 1.0 and full["mean_kl"] == 0.0 and full["identical_answer_share"] == 1.0
    assert full["mean_bytes_loaded"] == 0 and reuse["mean_recomputed_tokens"] == 0 and reuse["mean_bytes_loaded"] > 0
    assert report["methods"]["blend@1"]["recompute_share"] == 1.0
    assert report["methods"]["blend@1"]["top1_agreement"] == 1.0  # ratio 1 is a full prefill
    assert report["methods"]["blend@auto"]["mean_ratio_used"] >= 0.15  # never below the quality floor
    distinct = {(c["title"], c["text"]) for it in json.loads(short_items.read_text()) for c in it["ctxs"]}
    assert report["setup"]["chunks_computed"] == report["setup"]["chunks"] == len(distinct)
    assert report["setup"]["missing_after"] == 0  # so no timed run computed a chunk
    for item in report["per_item"]:
        assert sorted(item["order"]) == sorted(METHODS) and set(item["runs"]) == set(METHODS)
    poisson = report["workloads"]["poisson"]
    assert "simulated" in poisson["kind"] and set(poisson["methods"]) == set(METHODS)
    assert report["cache"]["chosen"]["policy"] == "pgdsf" and len(report["cache"]["hit_rate_vs_size"]) == 8
    assert report["store"]["bytes_per_token"] > 0
    plots = {"ttft_vs_ratio.png", "quality_vs_ratio.png", "quality_vs_ttft.png", "hit_rate_vs_size.png"}
    if importlib.util.find_spec("matplotlib") is None:  # plots are skipped, with a note on stderr
        plots = set()
    assert {p.name for p in out_dir.iterdir()} == {"report.json", "report.md"} | plots
    assert json.loads((out_dir / "report.json").read_text())["methods"].keys() == report["methods"].keys()
    assert "median TTFT" not in err and "| blend@auto |" in (out_dir / "report.md").read_text()  # --json: no tables

    # questions bringing their own passages (JSON Lines) over the same store: every chunk is there already
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(it) + "\n" for it in json.loads(short_items.read_text())))
    code, out, err = run(monkeypatch, capsys, "bench", "--questions", str(questions), "--model", str(tiny_llama_dir),
                         "--dtype", "float32", "--store", str(tmp_path / "store"), "--methods", "full,reuse",
                         "--limit", "1", "--max-tokens", "2", "--sequential-only", "--no-warmup", "--json")
    assert code == 0, err
    again = json.loads(out)
    assert again["setup"]["chunks_computed"] == 0 and again["items"] == 1 and list(again["methods"]) == ["full", "reuse"]
    assert again["config"]["questions"] == str(questions) and again["config"]["max_tokens"] == 2
    assert again["workloads"] == {"sequential": again["workloads"]["sequential"]} and again["cache"] == {}


@pytest.mark.parametrize("args, message", [
    ((), "exactly one of --dataset"),
    (("--dataset", "nope.json"), "does not exist"),
    (("--dataset", "x.json", "--questions", "y.txt"), "exactly one of --dataset"),
])
def test_user_errors_are_one_line(monkeypatch, capsys, args, message):
    code, out, err = run(monkeypatch, capsys, "bench", *args)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1 and out == ""


def test_bad_options_fail_before_loading_a_model(monkeypatch, capsys, short_items):
    for args, message in ((("--methods", "magic"), "unknown method"), (("--ratios", "2"), "between 0 and 1"),
                          (("--cache-policy", "fifo"), "unknown cache policy"), (("--codec", "fp8"), "codec"),
                          (("--rates", "fast"), "--rates")):
        code, _, err = run(monkeypatch, capsys, "bench", "--dataset", str(short_items), *args)
        assert code == 1 and message in err, (args, err)


def test_progress_without_a_terminal_prints_plain_lines(monkeypatch):
    """Under nohup or in a CI log a progress bar shows nothing until the end: a plain line comes instead when a
    phase starts or ends, and at most every PLAIN_PROGRESS_EVERY_S seconds in between."""
    import io

    from rich.console import Console

    import kvrag.bench.commands as bench_cmd

    clock = iter([0.0, 1.0, 2.0, 40.0, 41.0, 42.0])
    monkeypatch.setattr(bench_cmd.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with bench_cmd._progress(console) as update:  # starts the clock at 0
        update("run", "full · item 1/3", 0, 6)  # 1 s: the phase starts
        update("run", "blend · item 1/3", 1, 6)  # 2 s: too soon
        update("run", "full · item 2/3", 2, 6)  # 40 s: due
        update("setup", "chunk KV", 1, 2)  # 41 s: another phase
        update("run", "done", 6, 6)  # 42 s: the end, however soon
    assert out.getvalue().splitlines() == ["run 0/6 full · item 1/3 (1 s)", "run 2/6 full · item 2/3 (40 s)",
                                           "setup 1/2 chunk KV (41 s)", "run 6/6 done (42 s)"]


def test_bench_stores_and_reads_a_sliding_window_model_s_two_forms(monkeypatch, capsys, tmp_path, tiny_family,
                                                                    short_items):
    """As `kvrag precompute` and `ask` do (precompute/lead_in.py): chunks stored after a lead-in drawn from the data
    set's passages as well as after the preamble, and read in both, the first chunk in its exact form. Before, the
    bench stored the one form, so its Gemma figures measured a store no user has."""
    code, out, err = run(monkeypatch, capsys, "bench", "--dataset", str(short_items), "--model",
                         str(tiny_family("gemma3_text")), "--dtype", "float32", "--store", str(tmp_path / "store"),
                         "--methods", "full,reuse", "--max-tokens", "2", "--arrivals", "50", "--cache-requests", "50",
                         "--json")
    assert code == 0, err
    forms = json.loads(out)["config"]["chunk_forms"]
    assert forms["stored"] == ["after_preamble", "after_lead_in"] and forms["lead_in_tokens"] > 0
    assert forms["read"]["after_preamble"] > 0 and forms["read"]["after_lead_in"] > 0


def test_a_missing_benchmark_data_set_is_one_line_naming_the_file_and_its_source(monkeypatch, capsys, tmp_path):
    """A clone has no ../shared/data: the benchmarks that read MuSiQue by default say so and exit 1."""
    monkeypatch.chdir(tmp_path)  # no ../shared/data/musique_s.json from here
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "codec", "--items", "2")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "../shared/data/musique_s.json is missing" in err and "YaoJiayi/CacheBlend" in err
    for command in (["bench", "model", "--no-cold"], ["model", "bench", "--no-cold"]):  # the old name: an alias
        code, out, err = run_cli_in_process(monkeypatch, capsys, "model_cmd", *command)
        assert code == 1 and "musique_s.json" in err and len(err.strip().splitlines()) == 1 and out == ""


def test_a_dataset_without_passages_is_refused(monkeypatch, capsys, tmp_path):
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps([{"question": "Who?", "answers": ["x"]}]))
    code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "codec", "--dataset", str(questions))
    assert code == 1 and "needs its passages in 'ctxs'" in err and len(err.strip().splitlines()) == 1


def test_bench_decode_prints_a_row_per_prompt_and_the_agreement(monkeypatch, capsys, tiny_llama_dir):
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "decode", "--model",
                                        str(tiny_llama_dir), "--prompts", "16,40", "--steps", "3", "--rounds", "1",
                                        "--items", "2", "--answer-tokens", "3")
    assert code == 0, err
    rows = [line.split()[0] for line in out.splitlines()[2:] if line[:6].strip().isdigit()]
    assert rows == ["16", "40"]
    assert out.splitlines()[-1].endswith("of 2 invented items")


def test_bench_decode_and_cold_refuse_bad_input_in_one_line(monkeypatch, capsys, tmp_path):
    for args, message in ((["decode", "--batches", "4,x"], "--batches takes whole numbers"),
                          (["cold", "--store", str(tmp_path / "none")], "is not a store directory")):
        code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", *args)
        assert code == 1 and out == "" and message in err and len(err.strip().splitlines()) == 1
