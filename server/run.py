"""Running the app under uvicorn: in the foreground (`kvrag serve`), or on a thread of this process (tests and
benchmarks: `with BackgroundServer(rag, settings) as server: ... server.url ...`).

The socket is bound here before anything loads, so a port in use is one clear error at once, and port 0 takes a
free one (the URL says which); it listens once the model is loaded (`listen`), so no client waits on a server that
cannot answer yet. On SIGTERM or Ctrl-C uvicorn stops accepting at once; running requests get `grace_s` to finish, then the
rest are cancelled in the engine, so each ends as a response (an error event, a 503) rather than a dropped
connection; the caller then closes the KVRag.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import uvicorn

from kvrag.api import KVRag
from kvrag.errors import KvragError
from kvrag.server.app import ServerSettings, create_app

BACKLOG = 2048  # connections the kernel queues before they are accepted (uvicorn's default)


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket, not yet listening; KvragError with the reason when the address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvragError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def listen(sock: socket.socket) -> str:
    """Start accepting connections (they queue until uvicorn serves them); returns the URL."""
    sock.listen(BACKLOG)
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


BACKSTOP_S = 5.0  # after the grace period and the cancellations, uvicorn's own cut of what still hangs on


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown cancels the engine's requests once the grace period is over."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        cancel = asyncio.get_running_loop().call_later(self.grace_s, self.config.app.state.server.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            cancel.cancel()


def uvicorn_server(rag: KVRag, settings: ServerSettings, grace_s: float, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(create_app(rag, settings), lifespan="off", log_level=log_level,
                            timeout_graceful_shutdown=grace_s + BACKSTOP_S, access_log=log_level == "info")
    return _Server(config, grace_s)


def serve(rag: KVRag, settings: ServerSettings, sock: socket.socket, grace_s: float = 10.0,
          log_level: str = "info") -> None:
    """Serve on `sock` until SIGTERM or Ctrl-C, then shut down gracefully and return (the caller closes rag)."""
    server = uvicorn_server(rag, settings, grace_s, log_level)
    # uvicorn raises the signal it caught again once it has shut down, under the handler it found: a no-op for
    # SIGTERM, so a graceful stop ends the process with status 0 (Ctrl-C keeps Python's KeyboardInterrupt: 130)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


class BackgroundServer:
    """The app on a uvicorn thread of this process, on `host` and a free port unless told."""

    def __init__(self, rag: KVRag, settings: ServerSettings, host: str = "127.0.0.1", port: int = 0,
                 grace_s: float = 5.0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.url = listen(self.sock)
        self.server = uvicorn_server(rag, settings, grace_s, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="kvrag-server", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut down as on SIGTERM (graceful, then cancel) and wait for the thread."""
        self.server.should_exit = True
        self._thread.join()
        self.sock.close()
