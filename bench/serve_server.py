"""`kvrag serve` as a subprocess for the load test: one per configuration, on 127.0.0.1 and a free port.

The server's stderr (progress, uvicorn's log) goes to a file in the work dir, never to a pipe nobody drains;
its URL is read off the line it prints once it listens, then /health must answer. Stopped with SIGTERM, as an
operator would stop it: it finishes what runs within its grace period and exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrag.errors import KvragError

START_TIMEOUT_S = 300.0  # a first load may convert the model (20-35 s) on a busy machine
STOP_TIMEOUT_S = 60.0
_URL = re.compile(r" on (http://\S+)/v1")


class ServerProcess:
    """`with ServerProcess(store, args, log_path) as server: ... server.url ...`"""

    def __init__(self, store: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.store, self.args, self.log_path = store, args, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.exit_code: int | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "kvrag", "serve", "--store", str(self.store),
                                          "--host", "127.0.0.1", "--port", "0", *self.args],
                                         stdout=subprocess.DEVNULL, stderr=log, env=self.env)
        try:
            self.url = self._wait_for_url()
            self._wait_for_health()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGTERM, then wait (kill only past the timeout); the exit status, also kept in exit_code."""
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait()
        return self.exit_code

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if found := _URL.search(self.log_path.read_text(errors="replace")):
                return found.group(1)
            if self.proc.poll() is not None:
                raise KvragError(f"kvrag serve exited {self.proc.returncode} before listening: "
                                 f"{self._last_line()} (log: {self.log_path})")
            time.sleep(0.2)
        raise KvragError(f"kvrag serve did not listen within {START_TIMEOUT_S:.0f} s (log: {self.log_path})")

    def _wait_for_health(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise KvragError(f"kvrag serve at {self.url} did not answer /health (log: {self.log_path})")
            time.sleep(0.2)

    def _last_line(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no message)"

    def model_id(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
