"""Precompute: stored KV against transformers' own cache, resuming, crashes, refusals."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import PrecomputeInterrupted, precompute
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.keys import preamble_chunk_id
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify
from kvrag.store.manifest import preamble_hash


def _hf_cache_keys_values(path: Path, ids: torch.Tensor):
    """transformers' own KV cache for ids: per layer (rotated keys [T, Hkv, hd], values [T, Hkv, hd])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def _check_stored_against_transformers(store: Path, model_path: Path, runtime: Runtime, atol: float):
    with StoreEnv.open(store) as env:
        table = LocalKVTable(env, runtime.fingerprint, "fp16")
        record = next(ChunkTable(env).iter())
        pre = runtime.prompts.preamble_ids
        ids = torch.tensor(pre + list(record.token_ids))
        ref = _hf_cache_keys_values(model_path, ids)
        positions = torch.arange(len(pre), len(ids))
        for layer, (ref_k, ref_v) in enumerate(ref):
            got = table.get_layer(record.chunk_id, layer, expect_token_ids=record.token_ids)
            k = torch.from_numpy(got.k).float()
            # stored keys are pre-rotary: rotate them to their positions to compare with HF's cache
            k_rot = runtime.model.rotate_keys(k, positions)
            torch.testing.assert_close(k_rot, ref_k[len(pre):], atol=atol, rtol=1e-2)
            torch.testing.assert_close(torch.from_numpy(got.v).float(), ref_v[len(pre):], atol=atol, rtol=1e-2)


def test_stored_kv_equals_transformers_cache_tiny(store_copy, tiny_llama_dir):
    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    with StoreEnv.open(store_copy) as env:
        summary = precompute(env, runtime)
    assert summary.computed == summary.indexed_chunks == 5
    _check_stored_against_transformers(store_copy, tiny_llama_dir, runtime, atol=2e-3)


@pytest.mark.real_model
def test_stored_kv_equals_transformers_cache_real(store_copy, smol):
    runtime = Runtime.load(None, "float32")
    with StoreEnv.open(store_copy) as env:
        precompute(env, runtime, limit=1)
    _check_stored_against_transformers(store_copy, smol.path, runtime, atol=2e-2)


def test_resume_computes_each_chunk_once(store_copy, tiny_llama_dir):
    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    with StoreEnv.open(store_copy) as env:
        first = precompute(env, runtime, limit=2)
        second = precompute(env, runtime)
        third = precompute(env, runtime)
        assert (first.computed, second.already_stored, second.computed) == (2, 2, 3)
        assert (third.computed, third.already_stored) == (0, 5)
        assert len(list(LocalKVTable(env, runtime.fingerprint, "fp16").iter_chunks())) == 5


def test_two_codecs_and_a_preamble_share_one_store(store_copy, tiny_llama_dir):
    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    with StoreEnv.open(store_copy) as env:
        precompute(env, runtime, codec="fp16")
        precompute(env, runtime, codec="int8")
        for codec in ("fp16", "int8"):
            table = LocalKVTable(env, runtime.fingerprint, codec)
            assert len(list(table.iter_chunks())) == 5
            assert table.has(preamble_chunk_id(preamble_hash(runtime.prompts.template.preamble)))


@pytest.mark.slow
def test_killed_precompute_resumes_cleanly(indexed_store, tmp_path, tiny_llama_dir, kvrag):
    """kill -9 a real `kvrag precompute` at random moments; the store verifies clean each time and the
    runs together store every chunk exactly once."""
    for seed in range(3):
        store = tmp_path / f"store{seed}"
        shutil.copytree(indexed_store, store)
        proc = subprocess.Popen([sys.executable, "-m", "kvrag", "precompute", "--store", str(store),
                                 "--model", str(tiny_llama_dir), "--dtype", "float32", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(random.Random(seed).uniform(2.0, 5.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with StoreEnv.open(store) as env:
            report = verify(env)
            assert report.ok, report
        done = json.loads(kvrag("precompute", "--store", str(store), "--model", str(tiny_llama_dir),
                                "--dtype", "float32", "--json").stdout)
        assert done["already_stored"] + done["computed"] == done["indexed_chunks"] == 5


def test_interrupt_releases_claims(store_copy, tiny_llama_dir, monkeypatch):
    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    calls = []

    def interrupt(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with StoreEnv.open(store_copy) as env:
        with pytest.raises(PrecomputeInterrupted) as interrupted:  # a KeyboardInterrupt, with a count
            precompute(env, runtime, on_progress=interrupt)
        # the claims of the interrupted run are gone: a new run (same pid) takes every remaining chunk
        # (the writer may have committed one more chunk behind the interrupted forward loop)
        again = precompute(env, runtime)
        assert again.already_stored in (2, 3) and again.skipped_by_others == 0
        assert again.already_stored + again.computed == 5
        assert interrupted.value.stored == again.already_stored


def test_refusals_are_one_clear_line(tmp_path, store_copy, tiny_llama_dir, kvrag):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    proc = kvrag("precompute", "--store", str(tmp_path / "junk"), check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "not a kvrag store" in proc.stderr

    proc = kvrag("precompute", "--store", str(tmp_path / "missing"), check=False)
    assert proc.returncode == 1 and "no kvrag store" in proc.stderr

    proc = kvrag("precompute", "--store", str(store_copy), "--codec", "fp8", check=False)
    assert proc.returncode == 1 and "fp8" in proc.stderr and "Traceback" not in proc.stderr

    # a model with another tokenizer cannot use chunks tokenized for SmolLM2
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 49152, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    proc = kvrag("precompute", "--store", str(store_copy), "--model", str(other), check=False)
    assert proc.returncode == 1 and "another tokenizer" in proc.stderr and "Traceback" not in proc.stderr


def test_full_store_keeps_what_was_stored(store_copy, tiny_llama_dir, kvrag):
    runtime = Runtime.load(str(tiny_llama_dir), "float32")
    with StoreEnv.open(store_copy) as env:
        precompute(env, runtime, limit=2)
    # a map capped at its current size: the next new page cannot be had, as on a full disk
    proc = kvrag("precompute", "--store", str(store_copy), "--model", str(tiny_llama_dir), "--codec", "bf16",
                 env={"KVRAG_MAX_MAP_SIZE": "1"}, check=False)
    assert proc.returncode == 1 and "full" in proc.stderr and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "full" in line][0].startswith("error: ")
    with StoreEnv.open(store_copy) as env:
        assert verify(env).ok
        assert ChunkTable(env).count() == 5
        assert len(list(LocalKVTable(env, runtime.fingerprint, "fp16").iter_chunks())) == 2
