"""`kvrag bench chat` end to end on the tiny random model: a real `kvrag serve`, the real openai client, a plain chat
of three turns and an exact repeat. Checks what the server reused and copied, never the timings."""

from __future__ import annotations

import json
from itertools import pairwise

from kvrag.bench.chat import markdown
from kvrag.tests.conftest import run_cli_in_process


def _bench_chat(monkeypatch, capsys, tmp_path, store, model_dir, *args: str) -> dict:
    """`kvrag bench chat` on the tiny model in float32, 40-word turns, 4-token answers, one thread: its JSON report."""
    monkeypatch.setenv("KVRAG_THREADS", "1")
    code, out, err = run_cli_in_process(
        monkeypatch, capsys, "bench", "bench", "chat", "--store", str(store), "--work", str(tmp_path / "work"),
        "--model", str(model_dir), "--dtype", "float32", "--words", "40", "--max-tokens", "4", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_bench_chat_reuses_each_turn_and_copies_only_the_rows_after_the_hit(monkeypatch, capsys, tmp_path,
                                                                             store_copy, tiny_llama_dir):
    report = _bench_chat(monkeypatch, capsys, tmp_path, store_copy, tiny_llama_dir, "--turns", "3", "--repeats", "2",
                         "--restart")
    assert report["schema"] == "kvrag.bench-chat/1" and report["failed"] == 0
    turns, repeats = report["turns"], report["repeats"]
    assert len(turns) == 3 and len(repeats) == 2
    for before, turn in pairwise(turns):  # the history so far comes from the prefix cache, whole blocks of it
        assert turn["prompt_tokens"] > before["prompt_tokens"] and turn["cached_tokens"] >= before["prompt_tokens"] - 16
    for repeat in repeats:
        assert repeat["prompt_tokens"] == turns[-1]["prompt_tokens"]
        assert repeat["cached_tokens"] > repeat["prompt_tokens"] - 16
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    for request in turns + repeats:  # a hit's rows are referenced: only the rows after it go into the pool
        assert request["rows_admitted"] == request["prompt_tokens"] - request["cached_tokens"]
        # and each layer reads the hit by a copy on this CPU (a gather, or the row kernel's packing): once, or twice
        # where the head runs past the hit (its rest is computed over the hit, then the tail over both)
        assert request["rows_read_out"] in (layers * request["cached_tokens"], 2 * layers * request["cached_tokens"])
    for repeat in repeats:  # an exact repeat's head is the hit: read once
        assert repeat["rows_read_out"] == layers * repeat["cached_tokens"]
    assert report["server_peak_rss_mb"] > 0 and report["repeat_ttft_p50_s"] > 0
    # after a kill -9 and a restart, the next turn's history comes from the store: as many rows cached as warm, none
    # under another salt
    restart = report["restart"]
    assert restart["full"]["cached_tokens"] == 0 and restart["warm"]["cached_tokens"] > 0
    assert restart["restarted"]["cached_tokens"] == restart["warm"]["cached_tokens"]
    assert "| repeat 2 |" in markdown(report)


def test_bench_chat_bad_options_are_one_line(monkeypatch, capsys, tmp_path, store_copy):
    code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "chat", "--store", str(store_copy),
                                      "--work", str(tmp_path), "--turns", "400", "--words", "5000")
    assert code != 0 and "fewer than 400 turns" in err and "Traceback" not in err


def test_bench_chat_moves_a_conversation_to_a_second_replica_on_the_same_store(monkeypatch, capsys, tmp_path,
                                                                                store_copy, tiny_llama_dir):
    """--move: a second `kvrag serve` started beside the first on the same store answers the next turn with the
    history the first one spilled to the store's prefix table, as many rows cached as the first had warm."""
    report = _bench_chat(monkeypatch, capsys, tmp_path, store_copy, tiny_llama_dir, "--turns", "2", "--repeats", "0",
                         "--move")
    moved = report["move"]
    assert moved["full"]["cached_tokens"] == 0 and moved["warm"]["cached_tokens"] > 0
    assert moved["moved"]["cached_tokens"] == moved["warm"]["cached_tokens"]
    assert "on another replica" in markdown(report)
