"""`kvrag index` and `kvrag search` through `kvrag.cli.app.main`: stdout/stderr, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrag.tests.conftest import run_cli_in_process
from kvrag.tests.corpus_samples import make_pdf

CHEESE = "Brennkase is a smoked sheep cheese from the Alpine village of Obergau, aged for nine months in caves."
ROCKET = "The Kestrel-9 rocket engine burns liquid methane and oxygen and first flew from Andøya in 2031."


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli_in_process(monkeypatch, capsys, "index_cmd", *args)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "cheese.md").write_text(f"# Cheese\n\n{CHEESE}\n", encoding="utf-8")
    (root / "rocket.pdf").write_bytes(make_pdf([ROCKET], title="Kestrel"))
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    return root


@pytest.fixture
def indexed(smol, monkeypatch, capsys, corpus, tmp_path):
    """A store built by the real command (the default model, converted once per session by `smol`)."""
    store = tmp_path / "store"
    code, out, err = run(monkeypatch, capsys, "index", str(corpus), "--store", str(store), "--json")
    assert code == 0, err
    return store, json.loads(out), err


def test_index_prints_progress_on_stderr_and_json_on_stdout(indexed, corpus):
    store, summary, err = indexed
    assert (summary["documents"], summary["chunks"], summary["files"]) == (2, 2, 3)
    assert summary["skipped_by_reason"] == {"binary file": 1}
    assert summary["skipped"] == [{"source": str(corpus / "blob.bin"), "reason": "binary file", "detail": ""}]
    assert summary["index_type"] == "Flat" and summary["tokens"] > 40
    for stage in ("reading", "chunking", "embedding"):
        assert stage in err
    assert "kvrag index" not in err and "skipped" not in err  # with --json, the summary is the JSON alone
    assert (store / "data.mdb").is_file() and (store / "index" / "current.json").is_file()


def test_search_json_and_table(indexed, monkeypatch, capsys):
    store = indexed[0]
    code, out, err = run(monkeypatch, capsys, "search", "smoked sheep cheese", "-k", "2", "--store", str(store), "--json")
    assert code == 0, err
    hits = json.loads(out)
    assert [h["rank"] for h in hits] == [1, 2]
    assert CHEESE in hits[0]["text"] and hits[0]["title"] == "Cheese"
    assert hits[0]["score"] > hits[1]["score"]
    code, out, _ = run(monkeypatch, capsys, "search", "methane rocket engine", "--store", str(store))
    assert code == 0
    assert "Kestrel" in out and "rocket.pdf" in out  # the table goes to stdout: it is the result


def test_reindex_reports_unchanged_documents(indexed, monkeypatch, capsys, corpus):
    store = indexed[0]
    code, out, _ = run(monkeypatch, capsys, "index", str(corpus), "--store", str(store), "--json")
    assert code == 0
    again = json.loads(out)
    assert (again["docs_unchanged"], again["chunks_new"], again["embedded"]) == (2, 0, 0)
    code, out, err = run(monkeypatch, capsys, "index", str(corpus), "--store", str(store))
    assert code == 0  # without --json, the summary (the result) on stdout, the skipped inputs noted on stderr
    assert "kvrag index" in out and "unchanged 2" in out and f"skipped {corpus / 'blob.bin'}: binary file" in err
    assert "kvrag index" not in err and "blob.bin" not in out


def test_store_defaults_to_kvrag_store(smol, monkeypatch, capsys, corpus, tmp_path):
    monkeypatch.setenv("KVRAG_STORE", str(tmp_path / "from-env"))
    code, _, err = run(monkeypatch, capsys, "index", str(corpus / "cheese.md"))
    assert code == 0, err
    assert (tmp_path / "from-env" / "data.mdb").is_file()


@pytest.mark.parametrize("args, message", [
    (["index", "{tmp}/missing"], "error: no such file or directory: {tmp}/missing"),
    (["index", "{tmp}/*.nothing"], "error: no file matches {tmp}/*.nothing"),
    (["index", "{tmp}", "--chunk-tokens", "4"], "error: --chunk-tokens must be at least 16 (got 4)"),
    (["index", "{tmp}", "--overlap", "400"], "error: --overlap must be between 0 and half of --chunk-tokens (got 400)"),
    (["index", "{tmp}/empty-dir"], "error: no files found in {tmp}/empty-dir"),
    (["search", "x", "--store", "{tmp}/nostore"], "error: no kvrag store at {tmp}/nostore (run `kvrag index` first)"),
    (["search", "x", "-k", "0", "--store", "{tmp}"], "error: -k must be at least 1 (got 0)"),
])
def test_user_errors_are_one_line_and_exit_1(monkeypatch, capsys, tmp_path, args, message):
    (tmp_path / "empty-dir").mkdir()
    code, out, err = run(monkeypatch, capsys, *[a.format(tmp=tmp_path) for a in args])
    assert (code, out) == (1, "")
    assert err == message.format(tmp=tmp_path) + "\n"


def test_nothing_indexable_is_an_error(smol, monkeypatch, capsys, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.bin").write_bytes(bytes(range(256)))
    code, out, err = run(monkeypatch, capsys, "index", str(tmp_path / "bad"), "--store", str(tmp_path / "s"))
    assert (code, out) == (1, "")
    assert err.strip().splitlines()[-1] == "error: nothing to index in 1 file(s) (skipped: 1 binary file)"
    assert not (tmp_path / "s").exists()


def test_a_real_process_exits_1_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvrag", "index", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"error: no such file or directory: {tmp_path / 'nope'}\n"
