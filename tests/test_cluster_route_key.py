"""cluster/route_key.py, the front's work before routing, on a real store and tokenizer (no Ray): a request is
authenticated before it costs a retrieval, and its chunks are found under the salt the one-process server gives it
(server/auth.py), so a passage kept for one API key steers that key's routing alone."""

from __future__ import annotations

import json

import pytest

from kvrag.api import KVRagConfig
from kvrag.cluster.route_key import Routed, RouteKeys
from kvrag.model.prompt import encode
from kvrag.server.auth import tenant_salt
from kvrag.server.errors import ApiError
from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv

KEYS = "key-a,key-b"
CHAT = "/v1/chat/completions"
KEPT = "cd" * 16
PASSAGE = ("Ledger nine records that in 1802 the harbour lamp keeper of the granite tower rowed out through the winter "
           "gale to the reef, carried the copper lantern up the cliff rope, and kept the northern light burning for "
           "eleven nights until the relief boat from the southern village reached the island pier.")
PROMPT = f"{PASSAGE}\n\nWho kept the northern light?"


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": PROMPT}], **fields}).encode()


@pytest.fixture
def keys(store_copy, tiny_llama_dir, smol_tokenizer):
    """The front's RouteKeys over a store where key-a's prompts left PASSAGE kept (a record under key-a's salt, as
    engine/admission.py writes one): its ids are the prompt's own first tokens, so the prompt holds it whole."""
    ids = tuple(encode(smol_tokenizer, PROMPT)[:len(encode(smol_tokenizer, PASSAGE)) - 1])
    salt = tenant_salt(KEYS, "Bearer key-a", None)
    with StoreEnv.open(str(store_copy)) as env:
        ChunkTable(env).put_records([ChunkRecord(KEPT, CLIENT_DOC + salt, "", PASSAGE, 0, len(PASSAGE), ids)])
    keys = RouteKeys(store_copy, KVRagConfig.resolve(model=str(tiny_llama_dir), threads=1), KEYS)
    yield keys, len(ids)
    keys.close()


def test_a_kept_passage_steers_its_own_keys_routing_alone(keys):
    keys, tokens = keys
    assert keys.route(CHAT, "Bearer key-a", body()).chunks == ((KEPT, tokens),)
    assert keys.route(CHAT, "Bearer key-b", body()).chunks == ()  # another tenant: its prompt names nothing kept
    # within a key, cache_salt parts tenants as the one-process server does
    assert keys.route(CHAT, "Bearer key-a", body(cache_salt="other")).chunks == ()


def test_a_bad_key_is_a_401_before_any_retrieval(keys):
    keys, _ = keys
    question = json.dumps({"model": "m", "messages": [{"role": "user", "content": "How deep is Lake Baikal?"}]})
    for authorization, message in [("Bearer nope", "incorrect API key provided"),
                                   (None, "an API key is required: Authorization: Bearer <key>")]:
        with pytest.raises(ApiError) as refused:
            keys.route(CHAT, authorization, question.encode())
        assert (refused.value.status, refused.value.headers) == (401, {"WWW-Authenticate": "Bearer"})
        assert refused.value.body() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                                  "code": "invalid_api_key"}}
    assert keys.chunks.retrieval.load_s == 0.0  # the embedder and index were never loaded: nothing was retrieved
    routed = keys.route(CHAT, "Bearer key-b", question.encode())
    assert routed.chunks and json.loads(routed.body)["chunk_ids"] == [c for c, _ in routed.chunks]
    assert keys.chunks.retrieval.load_s > 0  # the same question, authenticated: retrieved at the front


def test_options_are_read_as_the_server_reads_them(keys):
    """A field the server refuses (here chat's deprecated `functions`) routes by load alone, unchanged: the replica
    answers it with the server's 400; a tool's result is plain chat, no retrieval."""
    keys, _ = keys
    refused = body(functions=[{"name": "f"}])
    assert keys.route(CHAT, "Bearer key-a", refused) == Routed((), refused)
    tool = json.dumps({"model": "m", "messages": [{"role": "user", "content": "How deep is Lake Baikal?"},
                                                  {"role": "tool", "content": "1,642 m"}]}).encode()
    routed = keys.route(CHAT, "Bearer key-a", tool).chunks  # no chunk: only its conversation's key
    assert [c for c in routed if not c[0].startswith("conversation:")] == [] and len(routed) == 1


def test_a_conversation_s_turns_share_a_key_of_their_own(keys):
    """Every turn of one conversation routes by the same conversation key (its home replica holds the history),
    weighted by the history; another conversation, or another tenant's, has another."""
    keys, _ = keys

    def turns(*texts: str) -> bytes:
        roles = ["user", "assistant"] * len(texts)
        messages = [{"role": r, "content": t} for r, t in zip(roles, texts, strict=False)]
        return json.dumps({"model": "m", "messages": messages, "k": 0}).encode()

    def conversation(routed: Routed) -> tuple[str, int]:
        (found,) = [c for c in routed.chunks if c[0].startswith("conversation:")]
        return found

    second = conversation(keys.route(CHAT, "Bearer key-a", turns("Tell me of lighthouses.", "They guide.", "Why?")))
    third = conversation(keys.route(CHAT, "Bearer key-a", turns("Tell me of lighthouses.", "They guide.", "Why?",
                                                                "Ships.", "And now?")))
    assert second[0] == third[0] and third[1] > second[1]
    assert conversation(keys.route(CHAT, "Bearer key-b", turns("Tell me of lighthouses.", "They guide.", "Why?"))
                        )[0] != second[0]
    assert conversation(keys.route(CHAT, "Bearer key-a", turns("Tell me of harbours.", "They shelter.", "Why?"))
                        )[0] != second[0]
    assert not [c for c in keys.route(CHAT, "Bearer key-a", turns("Tell me of lighthouses.")).chunks
                if c[0].startswith("conversation:")]  # a first turn: no history yet
