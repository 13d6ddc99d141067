"""`kvrag serve` as a process: SIGTERM stops it cleanly (exit 0, the store verifies), and bad options are one line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from kvrag.tests.conftest import run_cli_in_process, run_kvrag


def start_server(store, model_dir, *args: str) -> tuple[subprocess.Popen, str]:
    """`kvrag serve` on a free port; returns the process and its base URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "kvrag", "serve", "--store", str(store), "--model", str(model_dir),
                             "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVRAG_THREADS": "1"})
    for line in proc.stderr:
        if found := re.search(r"on (http://\S+)/v1", line):
            return proc, found.group(1)
    proc.wait()
    raise AssertionError(f"the server did not start (status {proc.returncode})")


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.TransportError:  # accepted just as the listener closed, then dropped: ask again
        return False
    return False


@pytest.mark.slow
def test_sigterm_stops_accepting_ends_what_runs_and_exits_0(store_copy, tiny_llama_dir):
    proc, url = start_server(store_copy, tiny_llama_dir, "--grace", "2")
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:  # an answer far longer than the grace period
        body = {"model": model, "stream": True, "max_tokens": 3000,
                "messages": [{"role": "user", "content": "How deep is Lake Baikal?"}]}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()
        except httpx.HTTPError as exc:
            lines.append(repr(exc))  # cut off at the end of the grace period
        first.set()

    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60) and lines[0].startswith("data: {"), lines
        proc.send_signal(signal.SIGTERM)
        while not refused(url):  # new connections are refused at once ...
            assert proc.poll() is None
        assert proc.poll() is None and reader.is_alive()  # ... while the running answer has its grace period
        assert proc.wait(60) == 0
        reader.join(60)
        # it ended as a response: the finish, or (past the grace period) an error event, then [DONE]
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", lines[-3:]
        assert '"finish_reason": "' in events[-2] or "shutting down" in events[-2], events[-2]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert refused(url)
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    run_kvrag("store", "verify", "--store", str(store_copy))  # exit 0: nothing half-written


def test_bad_options_are_one_line(monkeypatch, capsys, store_copy, tmp_path):
    code, _, err = run_cli_in_process(monkeypatch, capsys, "serve_cmd", "serve", "--store", str(tmp_path / "none"),
                                      "--port", "0")
    assert code == 1 and err.count("\n") == 1 and "no kvrag store" in err
    code, _, err = run_cli_in_process(monkeypatch, capsys, "serve_cmd", "serve", "--store", str(store_copy),
                                      "--kv-budget", "lots")
    assert code == 1 and err.count("\n") == 1 and "--kv-budget" in err
    code, _, err = run_cli_in_process(monkeypatch, capsys, "serve_cmd", "serve", "--store", str(store_copy),
                                      "--kept-passages", "a lot")
    assert code == 1 and err.count("\n") == 1 and "--kept-passages" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _, err = run_cli_in_process(monkeypatch, capsys, "serve_cmd", "serve", "--store", str(store_copy),
                                          "--port", port)
    assert code == 1 and err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch):
    monkeypatch.delenv("KVRAG_API_KEY", raising=False)
