"""Every model family through the whole product: `kvrag precompute` stores its chunks' KV, `ask` blends them, and
`kvrag serve` answers a conversation over them. The reference is the same model's full prefill: blending at ratio 1
recomputes every chunk token, so its answer is full prefill's (a family whose stored KV or its rotation were wrong
would differ), and the server answers as the Python API does."""

from __future__ import annotations

import shutil

import httpx
import pytest

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer

FAMILY_NAMES = ["qwen3", "qwen3_window", "phi3", "phi3_longrope", "mistral_window", "llama_yarn", "llama_dynamic",
                "qwen2_yarn", "gemma2", "gemma3_text", "gemma3"]
QUESTION = "Which lake is the deepest?"
STEPS = 6


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_family_precomputes_asks_and_serves(name, tiny_family, indexed_store, tmp_path, kvrag):
    from kvrag import KVRag

    model = tiny_family(name)
    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    kvrag("precompute", "--store", str(store), "--model", str(model), "--dtype", "float32")
    with KVRag(store, model=str(model), dtype="float32", host_cache="0") as rag:
        options = {"k": 3, "relative_cutoff": 0, "min_score": 0, "max_tokens": STEPS}
        full = rag.ask(QUESTION, mode="full", **options)
        blended = rag.ask(QUESTION, ratio=1.0, **options)
        assert blended.computed_chunks == [] and {s["tier"] for s in blended.to_json()["sources"]} == {"store"}
        assert blended.token_ids == full.token_ids
        default = rag.ask(QUESTION, **options)  # the default ratio: runs, from the stored KV
        assert default.recomputed_chunk_tokens < default.chunk_tokens and len(default.token_ids) > 0
        history = [("system", "Be brief."), ("user", "Hello."), ("assistant", "Hi.")]
        want = rag.ask(QUESTION, history=history, **options).text
        with BackgroundServer(rag, ServerSettings(name)) as server:
            reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "max_tokens": STEPS, "k": 3, "relative_cutoff": 0, "min_score": 0,
                "messages": [{"role": r, "content": t} for r, t in history] + [{"role": "user", "content": QUESTION}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == want
