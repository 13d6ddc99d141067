"""`kvrag ask` through a running `kvrag serve` on the same store (cli/ask_server.py, cli/announce.py): the real
server in its own process, the real CLI in another; the answer is the one `ask --no-server` gives in-process."""

from __future__ import annotations

import json
import signal

import httpx

from kvrag.cli.announce import announcement_path
from kvrag.tests.conftest import run_kvrag
from kvrag.tests.test_server_process import start_server

ONE_THREAD = {"KVRAG_THREADS": "1"}  # the server's too: the same arithmetic on both sides


def _ask(store, model_dir, *extra: str) -> dict:
    out = run_kvrag("ask", "How deep is Lake Baikal?", "--store", str(store), "--model", str(model_dir), "--json",
                    "--max-tokens", "8", *extra, env=ONE_THREAD)
    return json.loads(out.stdout)


def test_ask_answers_through_the_server_on_its_store_as_it_would_alone(store_copy, tiny_llama_dir):
    proc, url = start_server(store_copy, tiny_llama_dir)
    try:
        assert json.loads(announcement_path(store_copy).read_text())["url"] == url
        served = _ask(store_copy, tiny_llama_dir)
        alone = _ask(store_copy, tiny_llama_dir, "--no-server")
        apart = _ask(store_copy, tiny_llama_dir, "--weights", "dense")  # a setting the server was not given
        tuned = _ask(store_copy, tiny_llama_dir, "--selection", "cacheblend")  # a knob the API does not take
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        whole = httpx.post(url + "/v1/completions", timeout=120, json={  # not streamed: the records beside
            "model": model, "prompt": "How deep is Lake Baikal?", "max_tokens": 8, "answer_record": True}).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert served["served_by"] == url and alone["served_by"] is None
    assert apart["served_by"] is None and tuned["served_by"] is None
    for key in ("answer", "token_ids", "mode", "ratio", "rule", "tokens", "finish_reason"):
        assert served[key] == alone[key], key
    assert [s["chunk_id"] for s in served["sources"]] == [s["chunk_id"] for s in alone["sources"]]
    timings = served["timings"]
    assert timings["model_load"] == 0 and timings["embedder_load"] == 0 and timings["ttft"] > 0  # nothing loaded here
    assert alone["timings"]["model_load"] > 0
    assert not announcement_path(store_copy).exists()  # withdrawn as the server stopped
    (record,) = whole["answers"]
    assert record["question"] == "How deep is Lake Baikal?" and record["answer"].strip() == whole["choices"][0]["text"]


def test_a_killed_server_s_announcement_is_passed_over_and_removed(store_copy, tiny_llama_dir):
    proc, _ = start_server(store_copy, tiny_llama_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert announcement_path(store_copy).exists()  # nothing ran to withdraw it
    answer = _ask(store_copy, tiny_llama_dir)
    assert answer["served_by"] is None and answer["answer"]
    assert not announcement_path(store_copy).exists()


def test_a_refusal_from_the_server_is_one_line_as_here(store_copy, tiny_llama_dir):
    proc, _ = start_server(store_copy, tiny_llama_dir)
    try:
        args = ("ask", "Why?", "--store", str(store_copy), "--model", str(tiny_llama_dir), "--chunks", "no-such-chunk")
        served = run_kvrag(*args, env=ONE_THREAD, check=False)
        alone = run_kvrag(*args, "--no-server", env=ONE_THREAD, check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert served.returncode == alone.returncode != 0
    assert "no-such-chunk" in served.stderr and "Traceback" not in served.stderr
    assert len(served.stderr.strip().splitlines()) == 1, served.stderr


def test_a_server_that_wants_a_key_answers_only_an_ask_that_holds_it(store_copy, tiny_llama_dir):
    proc, url = start_server(store_copy, tiny_llama_dir, "--api-key", "sesame")
    try:
        without = _ask(store_copy, tiny_llama_dir)
        out = run_kvrag("ask", "How deep is Lake Baikal?", "--store", str(store_copy), "--model", str(tiny_llama_dir),
                        "--json", "--max-tokens", "8", env={**ONE_THREAD, "KVRAG_API_KEY": "sesame"})
        wrong = run_kvrag("ask", "How deep is Lake Baikal?", "--store", str(store_copy), "--model",
                          str(tiny_llama_dir), "--json", "--max-tokens", "8",
                          env={**ONE_THREAD, "KVRAG_API_KEY": "open"}, check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert without["served_by"] is None  # no key here: answered here, not refused
    assert json.loads(out.stdout)["served_by"] == url
    assert wrong.returncode != 0 and "incorrect API key" in wrong.stderr and "Traceback" not in wrong.stderr
