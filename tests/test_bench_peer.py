"""`kvrag bench peer` (bench/peer.py) end to end, llama-server's place taken by a second real `kvrag serve` (no
llama.cpp build in CI): every workload runs on both servers over HTTP and each answer is held to its length; served RAG
reads the prompts' passages from the store kvrag's side built for them."""

from __future__ import annotations

import json
import signal

from kvrag.tests.conftest import run_cli_in_process
from kvrag.tests.test_server_process import start_server


def test_bench_peer_measures_both_servers_on_the_same_requests(monkeypatch, capsys, tmp_path, store_copy, smol,
                                                               short_items):
    peer, url = start_server(store_copy, "smollm2")
    try:
        code, out, err = run_cli_in_process(
            monkeypatch, capsys, "bench", "bench", "peer", "--model", "smollm2", "--peer-url", url, "--weights",
            "dense", "--prompts", "96", "--batches", "1,3", "--decode-tokens", "4", "--chat-turns", "2",
            "--chat-words", "20", "--rag-items", "1", "--rag-passages", "3", "--concurrency", "1,2",
            "--dataset", str(short_items), "--work", str(tmp_path / "work"), "--json")
    finally:
        peer.send_signal(signal.SIGTERM)
        peer.wait(60)
    assert code == 0, err
    report = json.loads(out)
    assert list(report["servers"]) == ["peer", "kvrag dense"]
    for name, side in report["servers"].items():
        prefill = side["prefill"]["96"]
        assert prefill["prompt_tokens"] >= 96 and prefill["prefill_tokens_per_s"] > 0, name
        assert prefill["decode_tokens_per_s"] > 0, name
        for b in (1, 3):  # min_tokens held every answer to its length, on both
            assert side["batch"][str(b)]["tokens"] == 4 * b, (name, side["batch"])
        chat = side["chat"]
        assert len(chat["turn_ttft_s"]) == 2 and chat["repeat_ttft_s"] > 0, name
    assert json.loads((tmp_path / "work" / "report.json").read_text())["servers"].keys() == report["servers"].keys()
    # served RAG: the same prompts to the peer and to a kvrag server over a store of their passages, a level each
    assert list(report["rag"]) == ["peer", "kvrag"]
    for name, side in report["rag"].items():
        assert list(side["levels"]) == ["1", "2"], name
        for level in side["levels"].values():
            assert level["requests"] == 1 and level["requests_per_s"] > 0 and level["prompt_tokens_p50"] > 0, name
    for level in report["rag"]["kvrag"]["levels"].values():  # kvrag found its stored passages in the prompt
        assert level["cached_tokens_p50"] >= 3 * 40, level


def test_bench_peer_wants_one_server_to_compare_with(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "peer", "--work", str(tmp_path))
    assert code == 1 and err.strip().splitlines() == [
        "error: give --llama-server PATH (llama.cpp's llama-server) or --peer-url URL, one of them"]
