"""Where a running `kvrag serve` says which store it serves, so that `kvrag ask` on that store asks it (as Ollama's
CLI asks its server) instead of loading the model again: a question then costs its answer, not a cold start.

    $KVRAG_HOME/servers/<hash of the store's path>.json   {"pid", "url", "store", "settings", "api_key"}

Written once the model is loaded and the socket listens, removed when the server stops; one left by a server that
was killed names a process that is gone and is removed by the first reader. Standard library only: `kvrag ask`
reads it before deciding whether to import torch at all.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvrag.home import kvrag_home

# the settings that decide what an answer is (KVRagConfig's names): a server answers for `ask` only where they match
SERVED_SETTINGS = ("model", "dtype", "device", "kernels", "native", "weights", "codec", "keep", "keep_rule",
                   "model_check", "lead_in", "retrieval")


@dataclass(frozen=True)
class Announcement:
    pid: int
    url: str  # where its /v1 lies, e.g. http://127.0.0.1:8000
    store: str
    settings: dict  # SERVED_SETTINGS' values, as the server resolved them
    api_key: bool  # whether /v1 wants a key


def announcement_path(store: Path) -> Path:
    key = hashlib.blake2b(str(store.resolve()).encode(), digest_size=8).hexdigest()
    return kvrag_home() / "servers" / f"{key}.json"


def announce(store: Path, url: str, config, api_key: bool) -> Path:
    """Say that this process serves `store` at `url`, with `config`'s settings (a KVRagConfig), written whole: a
    reader never sees half of it."""
    path = announcement_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"pid": os.getpid(), "url": _local(url), "store": str(store.resolve()),
            "settings": {k: getattr(config, k) for k in SERVED_SETTINGS}, "api_key": api_key}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body), encoding="utf-8")
    tmp.replace(path)
    return path


def withdraw(path: Path) -> None:
    """Remove this process's announcement (not one a later server on the same store has written since)."""
    found = _read(path)
    if found is not None and found.pid == os.getpid():
        path.unlink(missing_ok=True)


def find(store: Path) -> Announcement | None:
    """The server announced for `store`, if its process still runs (a stale announcement is removed)."""
    path = announcement_path(store)
    found = _read(path)
    if found is None or found.store != str(store.resolve()):
        return None
    if not _alive(found.pid):
        path.unlink(missing_ok=True)
        return None
    return found


def _read(path: Path) -> Announcement | None:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return Announcement(int(body["pid"]), str(body["url"]), str(body["store"]), dict(body["settings"]),
                            bool(body["api_key"]))
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one of ours: as if none
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def _local(url: str) -> str:
    """A server listening on every interface is asked on the loopback one."""
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
