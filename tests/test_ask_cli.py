"""`kvrag ask` end to end on a tiny random model: retrieval, modes, baselines, errors."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def ready_store(indexed_store, tiny_llama_dir, tmp_path_factory):
    """The indexed sample corpus with the tiny model's KV precomputed."""

    store = tmp_path_factory.mktemp("ask") / "store"
    shutil.copytree(indexed_store, store)
    return store


def _ask(kvrag, store, model, *args, check=True):
    return kvrag("ask", *args, "--store", str(store), "--model", str(model), "--dtype", "float32", check=check)


def test_ask_answers_with_sources_and_timings(kvrag, ready_store, tiny_llama_dir):
    kvrag("precompute", "--store", str(ready_store), "--model", str(tiny_llama_dir), "--dtype", "float32")
    out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "Which lake is the deepest?", "-k", "3", "--json",
                          "--max-tokens", "8").stdout)
    assert len(out["sources"]) == 3 and out["sources"][0]["score"] >= out["sources"][-1]["score"]
    assert "Baikal" in json.dumps(out["sources"][0]) or out["sources"][0]["title"]
    for key in ("retrieve", "load", "compute", "ttft", "decode_tokens_per_s"):
        assert key in out["timings"]
    assert out["mode"] == "blend" and out["ratio"] == 0.15
    assert 0 < out["recomputed_chunk_tokens"] < out["chunk_tokens"]
    assert len(out["token_ids"]) <= 8


def test_ratio_one_and_full_prefill_give_the_same_answer(kvrag, ready_store, tiny_llama_dir):
    args = ("Where does the Nile flow?", "--json", "--max-tokens", "12")
    full = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--mode", "full").stdout)
    blend = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--ratio", "1.0").stdout)
    reuse = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--mode", "reuse").stdout)
    assert blend["token_ids"] == full["token_ids"]
    assert blend["recomputed_chunk_tokens"] == blend["chunk_tokens"]
    assert reuse["recomputed_chunk_tokens"] == 0 and reuse["bytes_loaded"] > 0


def test_questions_file_and_stdin(kvrag, ready_store, tiny_llama_dir, tmp_path):
    qfile = tmp_path / "q.txt"
    qfile.write_text("How deep is Lake Baikal?\n\nWhat is the Sahara?\n")
    out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "--questions", str(qfile), "--json",
                          "--max-tokens", "4").stdout)
    assert [a["question"] for a in out] == ["How deep is Lake Baikal?", "What is the Sahara?"]

    # the same question twice in one process: the second reuses the first's chunks from the memory tiers
    qfile.write_text("How deep is Lake Baikal?\nHow deep is Lake Baikal?\n")
    out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "--questions", str(qfile), "--json",
                          "--max-tokens", "4", "--host-cache", "64MiB").stdout)
    assert set(out[0]["chunk_tiers"]) <= {"store", "computed"} and set(out[1]["chunk_tiers"]) == {"tree"}
    assert out[1]["recomputed_chunk_tokens"] == 0 and out[0]["text"] == out[1]["text"]

    items = tmp_path / "items.json"  # MuSiQue-style items bring their own passages
    items.write_text(json.dumps([{"question": "Who?", "ctxs": [{"title": "", "text": "Ada wrote it."},
                                                                 {"title": "T", "text": "Bob read it."}]}]))
    out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "--questions", str(items), "--json",
                          "--max-tokens", "4").stdout)
    assert len(out[0]["sources"]) == 2 and out[0]["sources"][1]["title"] == "T"


@pytest.mark.parametrize("args, message", [
    (("   ",), "empty"),
    (("q", "--ratio", "2"), "--ratio"),
    (("q", "--ratio", "lots"), "--ratio"),
    (("q", "--mode", "magic"), "--mode"),
    (("q", "--chunks", "deadbeef"), "not in the store"),
    (("q", "--host-cache", "lots"), "--host-cache"),
    (("q", "--cache-policy", "fifo"), "cache policy"),
])
def test_bad_input_is_one_clear_line(kvrag, ready_store, tiny_llama_dir, args, message):
    proc = _ask(kvrag, ready_store, tiny_llama_dir, *args, check=False)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_no_store_and_no_index(kvrag, tmp_path, tiny_llama_dir):
    proc = _ask(kvrag, tmp_path / "nowhere", tiny_llama_dir, "q", check=False)
    assert proc.returncode == 1 and "no kvrag store" in proc.stderr
    from kvrag.store.env import StoreEnv

    StoreEnv.open(tmp_path / "empty", create=True).close()  # a store with nothing indexed
    proc = _ask(kvrag, tmp_path / "empty", tiny_llama_dir, "q", check=False)
    assert proc.returncode == 1 and "kvrag index" in proc.stderr and "Traceback" not in proc.stderr
