"""The bench's named data sets and their tuning / report splits (bench/rag/datasets.py)."""

from __future__ import annotations

import json

import pytest

from kvrag.bench.rag.datasets import load_dataset
from kvrag.errors import KvragError
from kvrag.tests.conftest import run_cli_in_process


def test_the_sample_set_asks_each_demo_question_over_every_bundled_document():
    data = load_dataset("sample")
    assert len(data.items) == 5 and data.indices("tune") == data.indices("report") == list(range(5))
    titles = {c["title"] for c in data.items[0]["ctxs"]}
    assert len(titles) == 5 and "Lighthouses of the northern coast" in titles
    for item in data.items:
        assert {c["title"] for c in item["ctxs"]} == titles
        assert any(a in c["text"] for a in item["answers"] for c in item["ctxs"])
    assert len({tuple(c["title"] for c in it["ctxs"]) for it in data.items}) > 1  # orders differ


def test_cross_passage_splits_are_its_halves():
    data = load_dataset("cross-passage")
    tune, report = data.indices("tune"), data.indices("report")
    assert len(tune) == len(report) == 120 and not set(tune) & set(report)
    assert data.indices("all") == sorted(tune + report)


@pytest.mark.benchmark_data
def test_musique_tunes_on_0_49_reports_on_50_99_and_holds_out_the_rest(musique_path, monkeypatch):
    data = load_dataset(str(musique_path))  # a path: every item in each split
    assert data.indices("report") == list(range(150))
    monkeypatch.setattr("kvrag.bench.rag.datasets.default_dataset", lambda: musique_path)
    named = load_dataset("musique")
    assert named.indices("tune") == list(range(50)) and named.indices("report") == list(range(50, 100))


def test_a_bad_split_or_name_is_one_line(tmp_path):
    with pytest.raises(KvragError, match="--split"):
        load_dataset("sample").indices("heldout")
    with pytest.raises(KvragError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.json"))


def test_bench_runs_a_named_set(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    code, out, err = run_cli_in_process(
        monkeypatch, capsys, "bench", "bench", "--dataset", "sample", "--split", "report", "--limit", "2",
        "--methods", "full,blend@0.15", "--model", str(tiny_llama_dir), "--dtype", "float32", "--store",
        str(tmp_path / "store"), "--max-tokens", "2", "--sequential-only", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["items"] == 2 and report["config"]["dataset"] == "sample" and report["config"]["split"] == "report"
