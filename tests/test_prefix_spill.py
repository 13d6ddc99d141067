"""The prefix cache spilled to the store (engine/prefix_spill.py, store/prefix_table.py): a new engine on the same
store (a restarted server, another replica) takes a prompt's head from the table, and answers as a fresh full prefill
does; another scope never hits; the table keeps its bound and never serves a block that is not whole."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest
import torch

from kvrag.bench.chat_restart import wait_for_writes
from kvrag.bench.serve_load import labelled
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefix_spill import PrefixSpill
from kvrag.store.env import StoreEnv
from kvrag.store.prefix_table import PrefixTable, bad_blocks, drop, table_stats
from kvrag.tests.conftest import run_cli_in_process, run_kvrag
from kvrag.tests.passages import client_prompt as _client_prompt
from kvrag.tests.passages import plain_request as _request
from kvrag.tests.passages import run_to_end as _run
from kvrag.tests.test_server_process import start_server


def _engine(prefiller, spill_bytes: int) -> LLMEngine:
    return LLMEngine(prefiller, EngineConfig(kv_budget_bytes=64 << 20, prompt_spans=False,
                                             prefix_store_bytes=spill_bytes))


def test_a_new_engine_takes_a_head_from_the_store_and_answers_as_a_full_prefill(corpus):
    env, prefiller, texts = corpus
    question = _client_prompt(texts[:3])
    first = _engine(prefiller, 64 << 20)
    done = _run(first, _request(question, mode="full"))
    assert first.kv.spill.saved == done.prompt_tokens // 16  # every whole block, all exact
    assert table_stats(env)["blocks"] == first.kv.spill.saved
    follow_up = question + " And who was the performer's teacher?"

    restarted = _engine(prefiller, 64 << 20)  # a new pool: nothing cached but what the store holds
    again = _run(restarted, _request(follow_up, mode="full"))
    assert restarted.kv.spill.restored > 0 and again.head_reused >= restarted.kv.spill.restored * 16
    fresh = _run(_engine(prefiller, 0), _request(follow_up, mode="full"))  # no spill: a full prefill
    assert fresh.head_reused == 0
    torch.testing.assert_close(again.first_logits, fresh.first_logits, rtol=1e-4, atol=2e-4)
    assert again.output == fresh.output

    other = _engine(prefiller, 64 << 20)  # another model, dtype or weights form has another scope: no hit
    other.kv.spill = PrefixSpill(other.kv, PrefixTable(env, "0" * 16 + ".other", 64 << 20), other.writes.call)
    assert _run(other, _request(follow_up, mode="full")).head_reused == 0 and other.kv.spill.restored == 0


def test_the_table_keeps_its_bound_by_value_and_skips_blocks_that_are_not_whole(tmp_path):
    env = StoreEnv.open(tmp_path / "store", create=True)
    table = PrefixTable(env, "f" * 16 + ".s", bound=10 * 100)
    rows = {f"k{i}": bytes([i]) * 100 for i in range(8)}
    assert table.put(rows.items()) == 8 and table.put(rows.items()) == 0  # put once
    assert table.leading(["k0", "k1", "nope", "k3"]) == [rows["k0"], rows["k1"]]  # in order, up to the first gap
    table.used(["k0", "k1"])  # read again: worth more than the rest
    table.put((f"n{i}", b"\x07" * 100) for i in range(4))  # 12 blocks > 10: the lowest go, down to 9
    stats = table_stats(env)
    assert stats["blocks"] == 9 and stats["bytes"] == 900
    assert table.has("k0") and table.has("k1") and table.has("n3")
    assert not table.has("k2")  # one use, as the new ones: equal value, and ties go by key
    table.put((f"m{i}", b"\x08" * 100) for i in range(2))  # the clock has risen past the evicted: newer is worth more
    assert table.has("m0") and table.has("m1") and not table.has("k5") and not table.has("k6") and table.has("k7")
    assert table_stats(env)["blocks"] == 9
    # a block damaged in place (a torn disk write, a bad sector) is never served, and verify finds it
    key = b"b/" + table.scope.encode() + b"/k1"
    env.write(lambda txn: txn.put(key, txn.get(key, db=env.db("prefix"))[:-1] + b"\xff", db=env.db("prefix")))
    assert table.leading(["k0", "k1"]) == [rows["k0"]]
    assert bad_blocks(env) == [key] and drop(env, bad_blocks(env)) == 1
    assert table_stats(env) == {"blocks": 8, "bytes": 800, "bad": 0}
    assert table.put([("z", b"\x09" * 100)]) == 1 and table_stats(env)["blocks"] == 9  # the bytes kept right
    env.close()


@pytest.mark.slow
def test_a_chat_survives_kill_9_its_next_turn_s_head_from_the_store(store_copy, tiny_llama_dir, tmp_path):
    """Three turns, the writes done, SIGKILL; a new server on the store answers the fourth turn with the history's
    blocks (and its kept turns' ids) from the store, and its first token's logprobs are those of a server that never
    died (the same conversation on a copy of the store; tests/test_paged_prefix.py holds that path to a full prefill of
    the same ids, and test_a_new_engine_... above the restored one); verify finds the table whole."""
    twin = tmp_path / "twin"
    shutil.copytree(store_copy, twin)
    turns = ("Tell me about lighthouses.", "And about their keepers?", "Which was the tallest?", "Who built it?")
    proc, url = start_server(store_copy, tiny_llama_dir)
    try:
        history = _converse(url, turns[:3])
        wait_for_writes(url)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    restarted, url = start_server(store_copy, tiny_llama_dir)
    try:
        after = _chat(url, history + [{"role": "user", "content": turns[3]}], 1)
        metrics = httpx.get(url + "/metrics").text
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(60)
    alive, url = start_server(twin, tiny_llama_dir)
    try:
        assert _converse(url, turns[:3]) == history  # greedy: the same conversation
        warm = _chat(url, history + [{"role": "user", "content": turns[3]}], 1)
    finally:
        alive.send_signal(signal.SIGTERM)
        alive.wait(60)
    assert after["cached"] == warm["cached"] >= after["prompt"] - 2 * 16  # the history's whole blocks
    restored = labelled(metrics, "kvrag_prefix_store_blocks_total", "event")["restored"]
    assert restored == after["cached"] // 16  # each from the store, none from its own pool
    assert after["top"] == warm["top"]  # the stored rows are the pool's, bit for bit
    verified = run_kvrag("store", "verify", "--store", str(store_copy), "--json")
    assert json.loads(verified.stdout)["bad_prefix_blocks"] == 0


def _converse(url: str, turns) -> list[dict]:
    history: list[dict] = []
    for turn in turns:
        answer = _chat(url, history + [{"role": "user", "content": turn}], 8)
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer["text"]}]
    return history


def _chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "k": 0,
            "logprobs": True, "top_logprobs": 5}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert "choices" in reply, reply
    choice, usage = reply["choices"][0], reply["usage"]
    return {"text": choice["message"]["content"], "top": choice["logprobs"]["content"][0]["top_logprobs"],
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


@pytest.mark.slow
def test_kill_9_during_spills_leaves_whole_blocks_within_the_bound(monkeypatch, capsys, store_copy, tiny_llama_dir,
                                                                   tmp_path):
    """`kvrag bench kills`: servers killed as their writes run (the answer's last byte, then SIGKILL at once), the
    table's bound small enough that they evict: every block read after each kill is whole, the table never holds more
    than its bound, and `store verify` agrees."""
    bound = 40 * 1024
    monkeypatch.setenv("KVRAG_THREADS", "1")
    code, out, err = run_cli_in_process(monkeypatch, capsys, "bench", "bench", "kills", "--store", str(store_copy),
                                        "--kills", "2", "--bound", str(bound), "--model", str(tiny_llama_dir),
                                        "--work", str(tmp_path / "work"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and len(report["rounds"]) == 2
    assert all(r["bad"] == 0 and 0 < r["bytes"] <= bound for r in report["rounds"])  # the writes done before the kills
    verified = run_kvrag("store", "verify", "--store", str(store_copy), "--json")
    assert json.loads(verified.stdout)["bad_prefix_blocks"] == 0
