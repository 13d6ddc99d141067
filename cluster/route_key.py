"""What the cluster's front does with a request before any replica sees it: checks its API key as `kvrag serve` does
(server/auth.py), so an unauthenticated request is refused before it costs a retrieval, then finds its chunks
(request_chunks.py) with the server's own reading of its options (protocol.py) and under its tenant's salt, so one
tenant's kept passages never steer another's routing. A conversation (a request with earlier turns) adds a key of its
own, its tenant's salt and first user message, weighted by its history's length: every turn of it has one home replica,
which holds its history in the pool (prefix affinity, as SGLang's router and llm-d route); a turn sent elsewhere, past
the load bound or after its replica died, finds the history in the store's prefix table (engine/prefix_spill.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrag.api import KVRagConfig, KvragError
from kvrag.request_chunks import RequestChunks
from kvrag.server.auth import check_key, tenant_salt
from kvrag.server.protocol import BadField, ChatRequest, CompletionRequest

GENERATE = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}
FIND = ("k", "relative_cutoff", "min_score", "chunk_ids", "passages", "rag", "last_role")  # what chooses the chunks
CONVERSATION = "conversation:"  # the routing key of a conversation's turns (never a chunk id: those are hex digests)
CHARS_PER_TOKEN = 4  # a history's weight in tokens, estimated from its text (the router needs no tokenizer for it)


def conversation_key(history, salt: str) -> tuple[str, int] | None:
    """A conversation's routing key and weight: its salt and first user message, its history's estimated tokens;
    None for a request without earlier turns."""
    first = next((text for role, text in history if role == "user"), None)
    if first is None:
        return None
    digest = xxhash.xxh3_128_hexdigest(f"{salt}\0{first}".encode())
    return CONVERSATION + digest, sum(len(text) for _, text in history) // CHARS_PER_TOKEN + 1


@dataclass(frozen=True)
class Routed:
    chunks: tuple[tuple[str, int], ...]  # (chunk id, tokens): the router's key
    body: bytes  # the body to forward: retrieved chunks named, so the replica does not retrieve again


class RouteKeys:
    def __init__(self, store: str | Path, config: KVRagConfig, api_key: str | None = None):
        self.chunks = RequestChunks.open(store, config)
        self.api_key = api_key

    def route(self, path: str, authorization: str | None, body: bytes) -> Routed:
        """The request's chunks and the body to forward; ApiError 401 (before anything else) for a /v1 request
        without one of the keys. A body that does not parse routes by load alone: the replica answers it with the
        error."""
        if self.api_key and path.startswith("/v1/"):
            check_key(self.api_key, authorization)
        kind = GENERATE.get(path)
        if kind is None:
            return Routed((), body)
        try:
            data = json.loads(body)
            request = kind.model_validate(data)
            options = request.options(default_max_tokens=1)
            salt = tenant_salt(self.api_key, authorization, request.cache_salt)
            found = self.chunks.find(request.question(), options.get("history", ()), salt=salt,
                                     **{name: options[name] for name in FIND if name in options})
        except (ValueError, BadField, KvragError):  # pydantic's ValidationError is a ValueError
            return Routed((), body)
        if found.retrieved:
            data.update({"chunk_ids": [c for c, _ in found.chunks]} if found.chunks else {"rag": False})
            body = json.dumps(data).encode()
        conversation = conversation_key(options.get("history", ()), salt)
        return Routed(found.routed + ((conversation,) if conversation else ()), body)

    def close(self) -> None:
        self.chunks.close()
