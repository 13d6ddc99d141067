"""What the cluster's front does with a request before any replica sees it: checks its API key as `kvrag serve` does
(server/auth.py), so an unauthenticated request is refused before it costs a retrieval, then finds its chunks
(request_chunks.py) with the server's own reading of its options (protocol.py) and under its tenant's salt, so one
tenant's kept passages never steer another's routing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvrag.api import KVRagConfig, KvragError
from kvrag.request_chunks import RequestChunks
from kvrag.server.auth import check_key, tenant_salt
from kvrag.server.protocol import BadField, ChatRequest, CompletionRequest

GENERATE = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}
FIND = ("k", "relative_cutoff", "min_score", "chunk_ids", "passages", "rag", "last_role")  # what chooses the chunks


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
        return Routed(found.routed, body)

    def close(self) -> None:
        self.chunks.close()
