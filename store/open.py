"""Which KV table a store gets: the chooser every open of a store's KV goes through (the engine, precompute).

A local store directory gives its LocalKVTable; a mirror of a remote store (a directory holding MARKER, corpus/
mirror.py) gives the RemoteKVTable on object storage behind that LocalKVTable as its cache (a CachedKVTable), bounded
in bytes; `open_table` opens a store URL directly (`precompute --ray` workers). obstore is an optional dependency
(the `s3` extra): only the remote path imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.table import KVTable
from kvrag.store.tiers.config import parse_bytes

DEFAULT_CACHE = "10GiB"  # the mirror's local kv cache, at most (KVRAG_REMOTE_CACHE, config.py)
MARKER = "remote.json"  # in a mirror directory: {"url": "s3://bucket/prefix"}
INSTALL_HINT = "--store s3://... needs obstore: pip install 'kvrag[s3]'"


def is_remote(store: str | Path) -> bool:
    """Whether a --store value names object storage rather than a local directory."""
    return str(store).startswith("s3://")


def remote_url(store_dir: str | Path) -> str | None:
    """The URL of the remote store a directory mirrors; None for an ordinary local store."""
    try:
        return json.loads((Path(store_dir) / MARKER).read_text())["url"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvragError(f"{Path(store_dir) / MARKER} is damaged ({exc}); delete the mirror directory") from None


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach a store on object storage, resolved at the edge (config.py): the AWS variables that configure
    the client, the mirror's directory (None: under kvrag's home) and the bound on its local kv cache."""

    aws: Mapping[str, str] = field(default_factory=dict)
    mirror_dir: str | None = None
    cache_bytes: int = parse_bytes(DEFAULT_CACHE)

    @classmethod
    def of(cls, aws: Mapping[str, str], mirror_dir: str | None, cache: str) -> RemoteOptions:
        return cls(dict(aws), mirror_dir, parse_bytes(cache, "KVRAG_REMOTE_CACHE"))


def store_table(env: StoreEnv, model_fp: str, codec: str = "fp16", compress: bool = True, variant: str = "",
                remote: RemoteOptions | None = None) -> KVTable:
    """The KV table of a store: its LocalKVTable; for a mirror, the remote table (reached with `remote`) with that
    LocalKVTable as its cache, bounded to remote.cache_bytes."""
    table = LocalKVTable(env, model_fp, codec, compress, variant)
    url = remote_url(env.path)
    if url is None:
        return table
    remote = remote or RemoteOptions()
    return open_table(url, model_fp, codec, compress, variant, cache=table, cache_bytes=remote.cache_bytes,
                      aws=remote.aws)


def open_table(url: str, model_fp: str, codec: str = "fp16", compress: bool = True, variant: str = "", *,
               cache: LocalKVTable | None = None, cache_bytes: int = 0,
               aws: Mapping[str, str] | None = None) -> KVTable:
    """The table of a store on object storage: the remote one, behind the local `cache` table (same model, codec
    and variant) when one is given, bounded to `cache_bytes`; the client configured from the `aws` variables."""
    require_obstore()
    # imported here: they import obstore, which a local store never needs (and a cold `ask` must not load)
    from kvrag.store.remote.cached_kv import CachedKVTable
    from kvrag.store.remote.object_store import ObjectStore
    from kvrag.store.remote.remote_kv import RemoteKVTable

    remote = RemoteKVTable(ObjectStore.from_url(url, aws or {}), model_fp, codec, compress, variant)
    remote.objects.check()  # wrong bucket or credentials: one clear line now, not at the first read
    return remote if cache is None else CachedKVTable(remote, cache, cache_bytes)


def require_obstore() -> None:
    try:
        import obstore  # noqa: F401
    except ImportError:
        raise KvragError(INSTALL_HINT) from None
