"""`kvrag ask` through a running `kvrag serve` on the same store (cli/announce.py), as Ollama's CLI asks its
server: the question costs its answer, not an interpreter's torch import and a model load.

The server answers only where it would answer as this process would: the same settings (model, dtype, weights,
codec, ...), the blend's own rule and knobs, and a key where it wants one (`ask --api-key`, KVRAG_API_KEY).
Otherwise, or where it does not answer at all, `ask` answers here as before. Standard library only, so that nothing
heavy is imported before the choice is made.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from kvrag.cli.announce import SERVED_SETTINGS, find
from kvrag.config import KVRagConfig
from kvrag.engine.answer import Answer
from kvrag.errors import KvragError


class ServerGone(Exception):
    """The announced server did not answer (gone, or not yet listening): answer here instead."""


def running_server(store: Path, options: dict, key: str | None) -> tuple[str, str | None] | None:
    """(URL, key) of the server announced for `store` where it answers as this process would with `options` (ask's
    KVRagConfig options), and `key` where it wants one; else None."""
    found = find(store)
    if found is None or found.settings.get("retrieval") == "client":  # a server that never retrieves
        return None
    mine = KVRagConfig.resolve(**options)
    if any(getattr(mine, name) != found.settings.get(name) for name in SERVED_SETTINGS if name != "retrieval"):
        return None
    if found.api_key and not key:
        return None
    return found.url, key


def ask_server(url: str, key: str | None, question: str, options: dict, write: Callable[[str], None]) -> Answer:
    """One question through the server's /v1/completions, its text given to `write` as it streams; the answer as
    the server recorded it. ServerGone where it cannot be reached; KvragError with its message where it refuses."""
    body = {"model": _model(url, key), "prompt": question, "stream": True, "answer_record": True, **options}
    record = None
    for event in _events(url + "/v1/completions", key, body):
        if "error" in event:
            raise KvragError(f"the server at {url}: {event['error'].get('message', event['error'])}")
        for choice in event.get("choices", []):
            if choice.get("text"):
                write(choice["text"])
        record = event.get("answer") or record
    if record is None:
        raise KvragError(f"the server at {url} ended the answer without its record")
    return Answer.from_json(record)


def _model(url: str, key: str | None) -> str:
    """The one model the server serves (its id: the name it was given, or the model's)."""
    with _open(urllib.request.Request(url + "/v1/models", headers=_headers(key))) as resp:
        return json.load(resp)["data"][0]["id"]


def _events(url: str, key: str | None, body: dict) -> Iterator[dict]:
    """The server-sent events of a streamed request, as dicts, up to [DONE]."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={**_headers(key), "Content-Type": "application/json"})
    with _open(request) as resp:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def _open(request: urllib.request.Request):
    """The response; ServerGone where nothing answers, KvragError with the API's message for a refusal."""
    try:
        return urllib.request.urlopen(request, timeout=None)
    except urllib.error.HTTPError as exc:  # a refusal in the API's format: said as the local path would say it
        if exc.code == 503:  # shutting down: as good as gone
            raise ServerGone(f"HTTP 503 from {request.full_url}") from None
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise KvragError(message) from None
    except (urllib.error.URLError, ConnectionError) as exc:
        raise ServerGone(str(getattr(exc, "reason", exc))) from None


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}
