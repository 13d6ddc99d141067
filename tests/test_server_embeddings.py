"""`POST /v1/embeddings` through the real `openai` client against a real `kvrag serve`: the store's embedder's
vectors, held to sentence-transformers' own for the same model (the independent reference), in both encodings,
with OpenAI's errors for what it cannot take."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from kvrag.server.app import ServerSettings
from kvrag.server.run import BackgroundServer
from kvrag.tests.conftest import copied_store

MODEL = "tiny-llama"
TEXTS = ["Who was the last keeper of the Skerry Point lighthouse?", "bread", "Zürich and 東京 in one line."]


@pytest.fixture(scope="module")
def server(indexed_store, tiny_llama_dir, tmp_path_factory):
    from kvrag import KVRag

    store = copied_store(indexed_store, tmp_path_factory)  # the server writes what it computes
    with KVRag(store, model=str(tiny_llama_dir), host_cache="0") as rag, \
            BackgroundServer(rag, ServerSettings(MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from kvrag.corpus.embedder import model_dir

    model = sentence_transformers.SentenceTransformer(str(model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)  # [3, 384]


def test_the_openai_client_gets_the_embedders_vectors(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the client asks for base64
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert [d.index for d in got.data] == [0, 1, 2] and vectors.shape == (3, 384)
    # the server's embedder runs in bf16 where the CPU has it: its vectors stay within bf16 of the reference
    assert (vectors * reference).sum(axis=1).min() >= 0.998
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    # the same batch as floats, under the served name: the encodings carry the same vectors, bit for bit (a text
    # embedded alone may differ from it in a batch by a float32 rounding, where the CPU has no bf16: other GEMM shapes)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data], dtype=np.float32), vectors, rtol=0, atol=0)


@pytest.mark.parametrize("body, param, status", [
    ({"model": "all-MiniLM-L6-v2", "input": [1, 2, 3]}, "input", 400),
    ({"model": "all-MiniLM-L6-v2", "input": []}, "input", 400),
    ({"model": "all-MiniLM-L6-v2", "input": "text", "dimensions": 128}, "dimensions", 400),
    ({"model": "no-such-model", "input": "text"}, "model", 404),
])
def test_what_it_cannot_take_is_an_openai_error(server, body, param, status):
    reply = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
