"""Who sent a request: its API key checked, and the salt that keeps what its prompts leave cached its own. The one
server (server/app.py) and the cluster's front (cluster/route_key.py) both ask here, so a tenant is one tenant on
either."""

from __future__ import annotations

import hashlib
import hmac

from kvrag.server.errors import ApiError


def check_key(api_key: str, authorization: str | None) -> None:
    """ApiError 401 unless `authorization` is `Bearer <key>` with one of api_key's comma-separated keys (each
    compared in constant time)."""
    expected = [key.strip().encode() for key in api_key.split(",") if key.strip()]
    scheme, _, given = (authorization or "").partition(" ")
    matches = [hmac.compare_digest(given.strip().encode(), key) for key in expected]
    if scheme.lower() != "bearer" or not any(matches):
        message = "incorrect API key provided" if authorization else "an API key is required: " \
                  "Authorization: Bearer <key>"
        raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def tenant_salt(api_key: str | None, authorization: str | None, cache_salt: str | None) -> str:
    """Whose caches a request uses: its API key's (when keys are configured; a digest, never the key) and, within
    it, its `cache_salt`'s. Corpus chunks are shared by all."""
    key = ""
    if api_key:
        given = (authorization or "").partition(" ")[2].strip()
        key = hashlib.sha256(given.encode()).hexdigest()[:32]
    return f"{key}:{cache_salt}" if cache_salt else key
