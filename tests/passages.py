"""A store of four invented passages for the tiny model (three with KV, as `index` + `precompute` leave them; the
fourth indexed only), a client's RAG template around passages, and a request run to its end on the engine: shared by
the tests of prompt reuse, kept passages and the write-back (the fixtures reach them through conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.llm_engine import LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord, chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable


@pytest.fixture(scope="module")
def tiny_runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


@pytest.fixture
def corpus(tmp_path, tiny_runtime, invented_items):
    """A store whose chunk table and KV table hold four invented passages (as index + precompute leave them)."""
    rt = tiny_runtime
    env = StoreEnv.open(tmp_path / "store", create=True)
    prefiller = Prefiller.open(rt, env)
    texts = [" ".join(ctx["text"].split()[:60]) for ctx in invented_items[0]["ctxs"][:4]]
    records = []
    for i, text in enumerate(texts):
        ids = tuple(rt.prompts.passage_ids(f"Doc {i}", text))
        records.append(ChunkRecord(chunk_id_for(ids, rt.local.tokenizer_fingerprint), "d", f"Doc {i}", text, 0,
                                   len(text), ids))
    ChunkTable(env).put_docs([(DocRecord("d", "d.txt", "", "h", tuple(DocChunk(r.chunk_id, 0, 1, len(r.token_ids))
                                                                       for r in records)), records)])
    table = LocalKVTable(env, rt.fingerprint, "fp16")
    with torch.inference_mode():
        for r in records[:3]:  # the fourth is indexed, its KV not computed yet
            table.put_chunk(r.chunk_id, r.token_ids, layers_to_numpy(chunk_kv(rt, prefiller.preamble, r.token_ids)))
    yield env, prefiller, texts
    env.close()


TASK = "Respond to the user query using the provided context."
OTHER_TASK = "Answer from the sources below."  # another application's template: the passages' KV is computed again


def client_prompt(texts: list[str], task: str = TASK) -> str:
    """An Open WebUI-style RAG template: the passages inside <source> tags, the question after."""
    sources = "\n".join(f'<source id="{i + 1}">{t}</source>' for i, t in enumerate(texts))
    return (f"### Task:\n{task}\n\n<context>\n" + sources +
            "\n</context>\n\n<user_query>\nWho was the spouse of the performer?\n</user_query>")


def run_to_end(engine: LLMEngine, request: Request):
    """A request answered, and what it sent to the write-back worker stored."""
    seq = engine.add(request)
    while not seq.done.is_set():
        engine.step()
    engine.writes.drain()
    return seq


def plain_request(question: str, mode: str = "blend", ratio: float = 0.15, **extra) -> Request:
    return Request(question, (), mode, BlendConfig(ratio=ratio), RatioPolicy.parse(ratio, "ratio"),
                   sampling=SamplingConfig(max_tokens=4), rag=False, keep_first_logits=True, **extra)
