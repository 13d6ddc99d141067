"""A shared KV store on S3-compatible object storage (`--store s3://bucket/prefix`; docs/design.md, "Object storage").

    object_store.py  ObjectStore: one bucket and prefix over obstore, configured from the AWS variables
    layout.py        one chunk = one object: header, KVRecord, every layer's value; its checks
    remote_kv.py     RemoteKVTable: KVTable's surface over those objects, plus get_layers / get_chunk
    cached_kv.py     CachedKVTable: the local LMDB KVTable as a size-bounded read-through tier in front of it

obstore is an optional dependency (the `s3` extra): importing this package needs it, `kvrag.store` does not.
"""

from __future__ import annotations

from kvrag.store.kv import KVTable
from kvrag.store.remote.cached_kv import CachedKVTable
from kvrag.store.remote.object_store import ObjectStore
from kvrag.store.remote.remote_kv import DamagedObject, RemoteKVTable


def is_remote(store: str) -> bool:
    """Whether a --store value names object storage rather than a local directory."""
    return str(store).startswith("s3://")


def open_table(url: str, model_fp: str, codec: str = "fp16", compress: bool = True, variant: str = "", *,
               cache: KVTable | None = None, cache_bytes: int = 0) -> RemoteKVTable | CachedKVTable:
    """The table `ask` and `precompute` read and write for --store s3://...: the remote one, behind the local
    `cache` table (same model, codec and variant) when one is given, bounded to `cache_bytes`."""
    remote = RemoteKVTable(ObjectStore.from_url(url), model_fp, codec, compress, variant)
    remote.objects.check()  # wrong bucket or credentials: one clear line now, not at the first read
    return remote if cache is None else CachedKVTable(remote, cache, cache_bytes)


__all__ = ["CachedKVTable", "DamagedObject", "ObjectStore", "RemoteKVTable", "is_remote", "open_table"]
