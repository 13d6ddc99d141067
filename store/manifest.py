"""The manifest in the `meta` database: schema version, and per model what its stored KV depends on.

    b"schema_version"        → ASCII integer (a store without it is schema 1)
    b"manifest/" + model_fp  → JSON {model_fp, preamble_text, preamble_hash, chunking, codecs}

A chunk's KV depends on the model (the fingerprint covers config, weights and tokenizer) and on the
preamble it was prefilled after; `chunking` holds the chunking settings of the indexer's `index_config`
(`IndexConfig.CHUNKING`: tokenizer, passage format, chunk size, overlap) when KV was first computed.
Opening with another preamble or chunking is refused, never silently mixed. Several models and codecs
share one store: each has its own manifest entry and key range.

Schema changes go through numbered migrations: MIGRATIONS[i] takes a store from schema i+1 to i+2,
all of them and the version bump in one write transaction (a crash leaves the old schema intact).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import lmdb

from kvrag.errors import KvragError
from kvrag.store.chunks import INDEX_CONFIG_KEY, IndexConfig
from kvrag.store.env import StoreEnv
from kvrag.store.keys import codec_id

SCHEMA_KEY = b"schema_version"
MANIFEST_PREFIX = b"manifest/"

Migration = Callable[[lmdb.Transaction, StoreEnv], None]
MIGRATIONS: tuple[Migration, ...] = ()  # e.g. (migrate_1_to_2,) once schema 2 exists
SCHEMA_VERSION = 1 + len(MIGRATIONS)


@dataclass(frozen=True)
class Manifest:
    model_fp: str
    preamble_text: str
    preamble_hash: str
    chunking: Mapping[str, Any] | None = None  # IndexConfig.CHUNKING fields; None: nothing indexed yet
    codecs: tuple[str, ...] = field(default=())

    def to_bytes(self) -> bytes:
        return json.dumps({"model_fp": self.model_fp, "preamble_text": self.preamble_text,
                           "preamble_hash": self.preamble_hash, "chunking": self.chunking,
                           "codecs": list(self.codecs)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            obj = json.loads(raw)
            return cls(obj["model_fp"], obj["preamble_text"], obj["preamble_hash"], obj.get("chunking"),
                       tuple(obj.get("codecs", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise KvragError(f"damaged manifest entry ({exc}); run `kvrag store gc --drop-model FP`") from None


def preamble_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def manifest_key(model_fp: str) -> bytes:
    return MANIFEST_PREFIX + model_fp.encode()


def ensure_schema(env: StoreEnv, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Bring the store to the current schema (1 + len(migrations)); refuse a newer one. Returns it."""
    current = 1 + len(migrations)
    meta = env.db("meta")
    found = env.read(lambda txn: _schema(txn, meta))
    if found == current and env.read(lambda txn: txn.get(SCHEMA_KEY, db=meta)) is not None:
        return current
    if found > current:
        raise KvragError(f"store at {env.path} has schema {found}, newer than this kvrag's {current}; upgrade kvrag")
    if env.readonly:
        if found < current:
            raise KvragError(f"store at {env.path} needs migrating from schema {found} to {current}; "
                             "open it once for writing (e.g. `kvrag store stats`)")
        return current

    def migrate(txn: lmdb.Transaction) -> int:
        start = _schema(txn, meta)  # re-read: another process may have migrated meanwhile
        if start > current:
            raise KvragError(f"store at {env.path} has schema {start}, newer than this kvrag's {current}")
        for version in range(start, current):
            migrations[version - 1](txn, env)  # version → version + 1
        txn.put(SCHEMA_KEY, str(current).encode(), db=meta)
        return current

    return env.write(migrate)


def read_manifest(env: StoreEnv, model_fp: str) -> Manifest | None:
    raw = env.read(lambda txn: txn.get(manifest_key(model_fp), db=env.db("meta")))
    return None if raw is None else Manifest.from_bytes(raw)


def read_manifests(env: StoreEnv) -> dict[str, Manifest]:
    with env.reader() as txn:
        cursor = txn.cursor(db=env.db("meta"))
        found = {}
        if cursor.set_range(MANIFEST_PREFIX):
            for key, raw in cursor:
                if not key.startswith(MANIFEST_PREFIX):
                    break
                found[key[len(MANIFEST_PREFIX):].decode()] = Manifest.from_bytes(raw)
    return found


def current_chunking(env: StoreEnv) -> dict[str, Any] | None:
    """The chunking settings of the store's index_config (None: not indexed yet)."""
    return env.read(lambda txn: _chunking(txn, env))


def check_or_record(env: StoreEnv, model_fp: str, preamble_text: str, codec: str, *,
                    tokenizer_fp: str | None = None, record: bool = True) -> Manifest:
    """Check that this model/preamble/chunking fits the store, and record it (and the codec) if new.

    Raises KvragError saying what differs and what to do: the index was tokenized by another
    tokenizer than `tokenizer_fp` (a store of another model), the model's KV was computed after
    another preamble, or the store was re-indexed with other chunking since. With `record=False`
    (a reader such as `ask`) nothing is written, and a model with no KV in the store is refused.
    """
    codec_id(codec)
    ensure_schema(env)
    wanted = preamble_hash(preamble_text)

    def check(txn: lmdb.Transaction, write: bool) -> Manifest:
        chunking = _chunking(txn, env)
        indexed_by = (chunking or {}).get("tokenizer_fingerprint")
        if tokenizer_fp is not None and indexed_by not in (None, tokenizer_fp):
            raise KvragError(
                f"store at {env.path} was indexed with another tokenizer ({indexed_by[:12]}, this model's is "
                f"{tokenizer_fp[:12]}), so its chunks mean nothing to model {model_fp}; use another --store "
                "or index it again with this model")
        raw = txn.get(manifest_key(model_fp), db=env.db("meta"))
        old = None if raw is None else Manifest.from_bytes(raw)
        if old is None:
            if not record:
                raise KvragError(_no_kv_message(env, txn, model_fp))
            new = Manifest(model_fp, preamble_text, wanted, chunking, (codec,))
        else:
            _refuse_mismatch(env, old, wanted, chunking)
            new = replace(old, chunking=old.chunking if old.chunking is not None else chunking,
                          codecs=tuple(sorted(set(old.codecs) | {codec})))
        if new != old and write:
            txn.put(manifest_key(model_fp), new.to_bytes(), db=env.db("meta"))
        return new

    found = env.read(lambda txn: check(txn, write=False))  # the usual case: nothing new, no write lock
    if record and found != read_manifest(env, model_fp):
        found = env.write(lambda txn: check(txn, write=True))  # re-checked: another process may have written
    return found


def set_chunking(txn: lmdb.Transaction, env: StoreEnv, model_fp: str, chunking: Mapping[str, Any] | None) -> None:
    """Adopt the current index_config for a model (gc does so once stale chunks' KV is gone)."""
    raw = txn.get(manifest_key(model_fp), db=env.db("meta"))
    if raw is not None:
        txn.put(manifest_key(model_fp), replace(Manifest.from_bytes(raw), chunking=chunking).to_bytes(),
                db=env.db("meta"))


def drop_manifest(txn: lmdb.Transaction, env: StoreEnv, model_fp: str) -> None:
    txn.delete(manifest_key(model_fp), db=env.db("meta"))


def _refuse_mismatch(env: StoreEnv, old: Manifest, wanted_hash: str, chunking: Mapping[str, Any] | None) -> None:
    fp = old.model_fp
    if old.preamble_hash != wanted_hash:
        raise KvragError(
            f"store at {env.path} holds KV of model {fp} computed after another preamble "
            f"(stored {old.preamble_hash[:12]}, now {wanted_hash[:12]}); use another --store, or drop that KV "
            f"with `kvrag store gc --drop-model {fp}` and precompute again")
    was, now = old.chunking or {}, chunking or {}  # a key new since is not a mismatch
    diff = [f"{k}: {was[k]!r} → {now[k]!r}" for k in sorted(was.keys() & now.keys()) if was[k] != now[k]]
    if diff:
        raise KvragError(
            f"store at {env.path} was re-indexed with other chunking since model {fp}'s KV was computed "
            f"({'; '.join(diff)}); run `kvrag store gc` to drop KV of chunks no longer indexed, then precompute")


def _no_kv_message(env: StoreEnv, txn: lmdb.Transaction, model_fp: str) -> str:
    cursor = txn.cursor(db=env.db("meta"))
    others = []
    if cursor.set_range(MANIFEST_PREFIX):
        others = [k[len(MANIFEST_PREFIX):].decode() for k in cursor.iternext(values=False)
                  if k.startswith(MANIFEST_PREFIX)]
    held = f"it holds KV of model(s) {', '.join(others)}" if others else "it holds no KV yet"
    return f"store at {env.path} has no KV for model {model_fp} ({held}); run `kvrag precompute` first"


def _schema(txn: lmdb.Transaction, meta) -> int:
    raw = txn.get(SCHEMA_KEY, db=meta)
    return 1 if raw is None else int(raw)


def _chunking(txn: lmdb.Transaction, env: StoreEnv) -> dict[str, Any] | None:
    raw = txn.get(INDEX_CONFIG_KEY, db=env.db("meta"))
    if raw is None:
        return None
    try:
        config = IndexConfig.from_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise KvragError(f"store at {env.path}: damaged index_config ({exc}); run `kvrag index` again") from None
    return {name: getattr(config, name) for name in IndexConfig.CHUNKING}
