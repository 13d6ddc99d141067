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
    proc = _ask(kvrag, ready_store, tiny_llama_dir, "Which lake is the deepest?", "-k", "3", "--json",
                "--max-tokens", "8", "--relative-cutoff", "0", "--min-score", "0")
    out = json.loads(proc.stdout)
    assert proc.stderr == ""  # --json: nothing on stderr but progress, and there is none to show here
    assert len(out["sources"]) == 3 and out["sources"][0]["score"] >= out["sources"][-1]["score"]
    assert "Baikal" in json.dumps(out["sources"][0]) or out["sources"][0]["title"]
    assert out["mode"] == "blend" and out["ratio"] == round(out["tokens"]["recomputed"] / out["tokens"]["chunks"], 4)
    assert out["ratio"] >= 0.15  # auto: never below the floor
    assert 0 < out["tokens"]["recomputed"] < out["tokens"]["chunks"]
    assert len(out["token_ids"]) == out["tokens"]["answer"] <= 8
    assert out["finish_reason"] == ("length" if len(out["token_ids"]) == 8 else "stop")
    timings = out["timings"]
    assert timings["startup"] > 0 and timings["model_load"] > 0 and timings["embedder_load"] > 0
    assert timings["since_start"] > timings["startup"] + timings["ttft"]
    assert {s["tier"] for s in out["sources"]} == {"store"} and out["computed_chunks"] == []


def test_json_has_the_same_keys_in_every_mode_and_a_list_for_many(kvrag, ready_store, tiny_llama_dir, tmp_path):
    shapes = set()
    for mode in ("blend", "full", "prefix", "reuse"):
        out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "Where does the Nile flow?", "--mode", mode,
                              "--json", "--max-tokens", "2", "-k", "3", "--relative-cutoff", "0", "--min-score", "0").stdout)
        assert out["schema"] == "kvrag.answer/1" and out["mode"] == mode
        tiers = [s["tier"] for s in out["sources"]]  # prefix caching loads the first chunk's KV alone
        loaded = {"full": 0, "prefix": 1}.get(mode, 3)
        assert len(tiers) == 3 and None not in tiers[:loaded] and tiers[loaded:] == [None] * (3 - loaded)
        shapes.add((tuple(out), tuple(out["timings"]), tuple(out["tokens"]), tuple(out["sources"][0])))
    assert len(shapes) == 1
    qfile = tmp_path / "one.txt"
    qfile.write_text("Where does the Nile flow?\n")
    many = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "--questions", str(qfile), "--json",
                           "--max-tokens", "2").stdout)
    assert isinstance(many, list) and len(many) == 1 and tuple(many[0]) == next(iter(shapes))[0]


def test_relative_cutoff_drops_far_off_chunks(kvrag, ready_store, tiny_llama_dir):
    def scores(*args):
        out = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, "Which lake is the deepest?", "-k", "5",
                              "--json", "--max-tokens", "1", *args).stdout)
        return [s["score"] for s in out["sources"]]

    every = scores("--relative-cutoff", "0", "--min-score", "0")
    assert len(every) == 5
    kept = scores("--relative-cutoff", "0.5")
    assert kept == [s for s in every if s >= 0.5 * every[0]] and len(kept) < 5


def test_missing_kv_is_computed_stored_and_said(kvrag, ready_store, tiny_llama_dir, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(ready_store, store)
    args = ("Which lake is the deepest?", "-k", "2", "--relative-cutoff", "0", "--min-score", "0", "--codec", "int8", "--max-tokens", "2")
    first = _ask(kvrag, store, tiny_llama_dir, *args)
    assert "2 of 2 chunks had no stored KV" in first.stderr and "int8" in first.stderr
    again = json.loads(_ask(kvrag, store, tiny_llama_dir, *args, "--json").stdout)
    assert again["computed_chunks"] == [] and {s["tier"] for s in again["sources"]} == {"store"}
    shutil.copytree(ready_store, tmp_path / "cold")
    cold = json.loads(_ask(kvrag, tmp_path / "cold", tiny_llama_dir, *args, "--json").stdout)
    assert cold["computed_chunks"] == [s["chunk_id"] for s in cold["sources"]]


def test_ratio_one_and_full_prefill_give_the_same_answer(kvrag, ready_store, tiny_llama_dir):
    args = ("Where does the Nile flow?", "--json", "--max-tokens", "12")
    full = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--mode", "full").stdout)
    blend = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--ratio", "1.0").stdout)
    reuse = json.loads(_ask(kvrag, ready_store, tiny_llama_dir, *args, "--mode", "reuse").stdout)
    assert blend["token_ids"] == full["token_ids"]
    assert blend["tokens"]["recomputed"] == blend["tokens"]["chunks"]
    assert reuse["tokens"]["recomputed"] == 0 and reuse["bytes_loaded"] > 0


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
    assert {s["tier"] for s in out[0]["sources"]} <= {"store", "computed"}
    assert {s["tier"] for s in out[1]["sources"]} == {"tree"}
    assert out[1]["tokens"]["recomputed"] == 0 and out[0]["answer"] == out[1]["answer"]

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


def test_ctrl_c_ends_the_partial_answer_with_a_marker_and_status_130(ready_store, tiny_llama_dir):
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvrag", "ask", "Which lake is the deepest?", "--store",
                             str(ready_store), "--model", str(tiny_llama_dir), "--dtype", "float32",
                             "--max-tokens", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = proc.stdout.read(1)  # the answer has started streaming: decoding is under way
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    out = (first + rest).decode()
    assert proc.returncode == 130, err
    assert out.endswith(" [interrupted]\n") and len(out) > len(" [interrupted]\n")
    err = err.decode()
    assert err.splitlines()[-1] == "interrupted; answered 0 of 1 questions in full" and "Traceback" not in err
