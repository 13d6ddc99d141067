"""One HTTP request through an ASGI app in this process, its response as it comes: the way a Ray Serve replica runs
kvrag's own app (server/app.py) on a request the router forwarded, so every endpoint, error and stream is the same
code `kvrag serve` runs.

    async for item in call(app, request):   # first Start(status, headers), then the body's pieces (bytes)

Closing the iterator early (the client went away) is a disconnect to the app, which cancels the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

DRAIN_S = 5.0  # after a disconnect, how long the app gets to wind the request down


@dataclass(frozen=True)
class HttpRequest:
    """What the router forwards: plain values, so it pickles across processes."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class Start:
    status: int
    headers: list[tuple[str, str]]


async def call(app, request: HttpRequest) -> AsyncIterator[Start | bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "root_path": "", "headers": list(request.headers),
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield Start(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body"):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, DRAIN_S)
