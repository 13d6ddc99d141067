"""The local mirror of a remote store (`--store s3://bucket/prefix`; docs/design.md, "Object storage").

A mirror is an ordinary local store directory. Its corpus (the chunks and docs databases, the index config and the
vector index) is a copy of the snapshot last published to the object store; its `kv` database is the size-bounded
read-through cache in front of the remote KV (store/open.py's `store_table` builds the CachedKVTable).

    <prefix>/corpus/<generation>.tar   snapshot.json, dbs/{chunks,docs,meta} dumped, index/ (the live files)
    <prefix>/corpus/current.json       {"generation": ...}, put last: a reader never sees a half-published corpus

Where: $KVRAG_MIRROR_DIR, else <home>/remote/<bucket>/<prefix made safe>; its `remote.json` names the store's URL.
`kvrag index` indexes into the mirror, then publishes. Opening (sync) downloads the current snapshot when the
mirror holds another generation and swaps the corpus in, leaving the kv cache alone (KV is content-addressed).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import struct
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb

from kvrag.errors import KvragError
from kvrag.home import kvrag_home
from kvrag.store.chunks import INDEX_CONFIG_KEY
from kvrag.store.env import StoreEnv, is_store
from kvrag.store.open import MARKER, RemoteOptions, is_remote, remote_url, require_obstore

if TYPE_CHECKING:  # obstore is optional (the s3 extra): a local store must open without it
    from kvrag.store.remote.object_store import ObjectStore, S3Location

CURRENT = "corpus/current.json"
GENERATION_KEY = b"remote/generation"  # in the mirror's meta: the snapshot its corpus came from
CORPUS_DBS = ("chunks", "docs")  # replaced whole by a snapshot; meta only in CORPUS_META_KEYS
CORPUS_META_KEYS = (INDEX_CONFIG_KEY,)
SNAPSHOT_FORMAT = 1
_RECORD = struct.Struct("<II")  # key length, value length; then the key and the value
_INDEX_FILE = re.compile(r"^index/[A-Za-z0-9_.-]+$")


def mirror_dir(location: S3Location, configured: str | None = None) -> Path:
    """`configured` ($KVRAG_MIRROR_DIR), else <home>/remote/<bucket>/<prefix with anything but [A-Za-z0-9._-] as _>."""
    if configured:
        return Path(configured).expanduser()
    return kvrag_home() / "remote" / location.bucket / (re.sub(r"[^A-Za-z0-9._-]+", "_", location.prefix) or "_")


@dataclass
class Snapshot:
    """A published corpus: the corpus databases' records and the vector index's live files."""

    dbs: dict[str, list[tuple[bytes, bytes]]]  # db name -> (key, value), in key order
    index_files: dict[str, bytes] = field(default_factory=dict)  # file name in index/ -> bytes

    @classmethod
    def read(cls, env: StoreEnv, store_dir: Path) -> Snapshot:
        from kvrag.corpus.vector_index import live_generation  # faiss: imported by the remote path alone

        with env.reader() as txn:
            dbs = {name: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=env.db(name))] for name in CORPUS_DBS}
            dbs["meta"] = [(k, v) for k in CORPUS_META_KEYS if (v := txn.get(k, db=env.db("meta"))) is not None]
        folder, generation = store_dir / "index", live_generation(store_dir)
        files = [] if generation is None else [folder / "current.json", *sorted(folder.glob(f"{generation}.*"))]
        return cls(dbs, {p.name: p.read_bytes() for p in files})

    def pack(self) -> bytes:
        """An uncompressed tar, the same bytes for the same corpus (no times, owners or modes)."""
        header = {"format": SNAPSHOT_FORMAT, "chunks": len(self.dbs["chunks"])}
        members = {"snapshot.json": json.dumps(header).encode(),
                   **{f"dbs/{name}": _dump(records) for name, records in self.dbs.items()},
                   **{f"index/{name}": data for name, data in self.index_files.items()}}
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        return out.getvalue()

    @classmethod
    def unpack(cls, data: bytes, where: str) -> Snapshot:
        """The snapshot in a tar from `where`; KvragError (one line) for anything it should not hold."""
        members: dict[str, bytes] = {}
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                for info in tar:
                    allowed = info.name in ("snapshot.json", "dbs/meta", *(f"dbs/{n}" for n in CORPUS_DBS))
                    if not info.isfile() or not (allowed or _INDEX_FILE.match(info.name)):
                        raise KvragError(f"{where}: unexpected member {info.name!r}")
                    members[info.name] = tar.extractfile(info).read()
            header = json.loads(members["snapshot.json"])
            if header.get("format") != SNAPSHOT_FORMAT:
                raise KvragError(f"{where}: snapshot format {header.get('format')}, this kvrag reads "
                                 f"{SNAPSHOT_FORMAT}; upgrade kvrag")
            dbs = {name: list(_load(members[f"dbs/{name}"])) for name in (*CORPUS_DBS, "meta")}
        except (tarfile.TarError, KeyError, ValueError, struct.error) as exc:
            raise KvragError(f"{where}: damaged snapshot ({type(exc).__name__}: {exc})") from None
        files = {name[len("index/"):]: body for name, body in members.items() if name.startswith("index/")}
        return cls(dbs, files)


class Mirror:
    """One remote store's object store and local mirror directory."""

    def __init__(self, objects: ObjectStore, path: Path):
        self.objects, self.path, self.url = objects, path, objects.url

    @classmethod
    def open(cls, url: str, remote: RemoteOptions) -> Mirror:
        """The mirror of `url` (reached and placed as `remote` says), made (an empty store and its remote.json) if it
        is not there yet."""
        require_obstore()
        from kvrag.store.remote.object_store import ObjectStore

        objects = ObjectStore.from_url(url, remote.aws)
        path = mirror_dir(objects.location, remote.mirror_dir)
        mirrored = remote_url(path)
        if mirrored is None:
            if is_store(path):
                raise KvragError(f"{path} is a local store, not a mirror of {objects.url}; set KVRAG_MIRROR_DIR "
                                 "to another directory")
            StoreEnv.open(path, create=True).close()  # first: a store refuses to be made in a non-empty directory
            (path / f"{MARKER}.tmp").write_text(json.dumps({"url": objects.url}))
            os.replace(path / f"{MARKER}.tmp", path / MARKER)  # whole or not at all
        elif mirrored != objects.url:
            raise KvragError(f"{path} mirrors {mirrored}, not {objects.url}; set KVRAG_MIRROR_DIR to another "
                             "directory")
        return cls(objects, path)

    def current(self) -> str | None:
        """The generation current.json names; None when nothing was published."""
        raw = self.objects.get(CURRENT)
        try:
            return None if raw is None else str(json.loads(raw)["generation"])
        except (ValueError, KeyError, TypeError):
            raise KvragError(f"{self.url}/{CURRENT} is damaged; run kvrag index --store {self.url} again") from None

    def sync(self, need_corpus: bool = True) -> Path:
        """Bring the mirror's corpus to the published generation; returns the mirror directory."""
        current = self.current()
        if current is None:
            if need_corpus:
                raise KvragError(f"{self.url} holds no corpus: run kvrag index --store {self.url} first")
            return self.path
        with self._locked(), StoreEnv.open(self.path) as env:
            # read under the lock: another process may have just pulled it
            if env.read(lambda txn: txn.get(GENERATION_KEY, db=env.db("meta"))) != current.encode():
                self._pull(env, current)
        return self.path

    def publish(self) -> str:
        """Upload the mirror's corpus as a new snapshot, then point current.json at it; returns the tar's URL."""
        with StoreEnv.open(self.path) as env:
            data = Snapshot.read(env, self.path).pack()
            generation = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + hashlib.blake2b(
                data, digest_size=6).hexdigest()
            self.objects.put(f"corpus/{generation}.tar", data, create=True)
            self.objects.put(CURRENT, json.dumps({"generation": generation}).encode())
            env.write(lambda txn: txn.put(GENERATION_KEY, generation.encode(), db=env.db("meta")))
        return f"{self.url}/corpus/{generation}.tar"

    def _pull(self, env: StoreEnv, generation: str) -> None:
        """Download a snapshot, then swap it in: the index (a new local generation, made live by one rename),
        then the databases and the generation in one transaction. A crash between leaves the old generation
        recorded, so the next open pulls again."""
        from kvrag.corpus.vector_index import VectorIndex  # faiss: imported by the remote path alone

        key = f"corpus/{generation}.tar"
        data = self.objects.get(key)
        if data is None:
            raise KvragError(f"{self.url}/{CURRENT} names {key}, which is not there; run kvrag index --store "
                             f"{self.url} again")
        snapshot = Snapshot.unpack(data, f"{self.url}/{key}")
        with tempfile.TemporaryDirectory(dir=self.path, prefix=".incoming-") as tmp:
            (Path(tmp) / "index").mkdir()
            for name, body in snapshot.index_files.items():
                (Path(tmp) / "index" / name).write_bytes(body)
            index = VectorIndex.load(Path(tmp))
            if index is not None:
                index.save(self.path)
        env.write(lambda txn: _replace_corpus(txn, env, snapshot, generation))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One pull at a time per mirror (processes on one machine wait for each other)."""
        with open(self.path / "sync.lock", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_corpus(txn: lmdb.Transaction, env: StoreEnv, snapshot: Snapshot, generation: str) -> None:
    for name in CORPUS_DBS:
        txn.drop(env.db(name), delete=False)  # empties it
        txn.cursor(db=env.db(name)).putmulti(snapshot.dbs[name])
    for key in CORPUS_META_KEYS:
        txn.delete(key, db=env.db("meta"))
    txn.cursor(db=env.db("meta")).putmulti([(k, v) for k, v in snapshot.dbs["meta"] if k in CORPUS_META_KEYS])
    txn.put(GENERATION_KEY, generation.encode(), db=env.db("meta"))


def _dump(records: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(_RECORD.pack(len(k), len(v)) + k + v for k, v in records)


def _load(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    at = 0
    while at < len(data):
        klen, vlen = _RECORD.unpack_from(data, at)
        at += _RECORD.size
        if at + klen + vlen > len(data):
            raise ValueError("a record runs past the end")
        yield data[at:at + klen], data[at + klen:at + klen + vlen]
        at += klen + vlen


def local_store(store: str | Path, remote: RemoteOptions, *, need_corpus: bool = True) -> Path:
    """A --store value as a local store directory: the directory itself, or for s3://bucket/prefix its mirror
    (reached as `remote` says), brought up to the corpus published there (`need_corpus`: a store with none is a
    KvragError)."""
    if not is_remote(store):
        return Path(store).expanduser()
    require_obstore()
    return Mirror.open(str(store), remote).sync(need_corpus)
