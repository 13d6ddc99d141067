"""Store maintenance: stats, verify (and repair), gc. Pure functions returning dataclasses; no printing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import lmdb

from kvrag.store import chunk_log
from kvrag.store.codec import CorruptValue, decode
from kvrag.store.env import StoreEnv
from kvrag.store.keys import (
    CODEC_IDS,
    LEAD_IN_SUFFIX,
    LEAD_IN_VARIANT,
    TAG_CLAIM,
    ChunkKey,
    ClaimKey,
    KVKey,
    after_prefix,
    chunk_of,
    is_preamble_id,
    is_reduced,
    lead_in_chunk_id,
    lead_in_variant,
    model_prefix,
    parse_key,
    preamble_chunk_id,
)
from kvrag.store.kv import claim_alive, delete_prefix, scan_records
from kvrag.store.manifest import (
    current_chunking,
    drop_manifest,
    ensure_schema,
    read_manifests,
    set_chunking,
)
from kvrag.store.record import KVRecord
from kvrag.store.table import positions_problem

STALE_LEAD_IN = "computed after a lead-in the model no longer has (`kvrag store gc` drops it)"
DELETE_BATCH = 64  # chunks per write transaction in gc/repair: bounded transactions, steady progress


@dataclass(frozen=True)
class GroupStats:
    """The KV of one (model, codec, variant); the preamble is counted apart from the chunks."""

    model_fp: str
    codec: str
    chunks: int = 0
    tokens: int = 0  # chunk tokens (all positions, even where a Keyformer subset was kept)
    bytes: int = 0  # value bytes over all layers, K and V, headers included
    layer_bytes: tuple[int, ...] = ()
    preamble_tokens: int = 0  # 0: no preamble KV stored
    damaged_records: int = 0
    variant: str = ""  # "": full chunks; else a reduced (Keyformer) form, keyed apart (see store/keys.py)
    kept_tokens: int = 0  # tokens stored, averaged over layers (= tokens for full chunks)

    @property
    def bytes_per_token(self) -> float:
        """Per chunk token, kept or not: a reduced variant's figure compares directly with the full one's."""
        return self.bytes / self.tokens if self.tokens else 0.0

    @property
    def kept_share(self) -> float:
        return self.kept_tokens / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class StoreStats:
    path: str
    schema_version: int
    map_size: int  # current LMDB map size (grows by itself)
    used_bytes: int  # up to the highest page in use; freed pages below it are reused, the file never shrinks
    models: tuple[str, ...]  # every model with a manifest or stored KV
    groups: tuple[GroupStats, ...] = field(default=())


@dataclass(frozen=True)
class Problem:
    model_fp: str
    codec: str
    chunk_id: str
    layer: int | None  # None: the chunk as a whole (record, missing layers, stray keys)
    reason: str
    variant: str = ""


@dataclass(frozen=True)
class VerifyReport:
    chunks: int  # complete chunks checked
    values: int  # layer values decoded
    bytes: int
    problems: tuple[Problem, ...]
    repaired_chunks: int = 0  # chunks deleted by repair (the next precompute redoes them)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class GcReport:
    dropped_chunks: int
    dropped_bytes: int
    dropped_models: tuple[str, ...]
    kept_chunks: int
    dry_run: bool = False
    dropped_lead_ins: int = 0  # lead-ins condemned (holding a client's passage), their chunks among dropped_chunks


def stats(env: StoreEnv) -> StoreStats:
    """Chunks, tokens, bytes (per token, per layer) per (model, codec, variant); reads records only."""
    schema = ensure_schema(env)
    groups: dict[tuple[str, str, str], dict] = {}
    for key, raw in scan_records(env, b""):
        g = groups.setdefault((key.model_fp, key.codec, key.variant),
                              {"chunks": 0, "tokens": 0, "bytes": 0, "layers": [], "preamble": 0, "damaged": 0,
                               "kept": 0})
        try:
            rec = KVRecord.from_bytes(raw)
        except CorruptValue:
            g["damaged"] += 1
            continue
        if is_preamble_id(key.chunk_id):
            g["preamble"] = rec.n_tokens
            continue
        g["chunks"] += 1
        g["tokens"] += rec.n_tokens
        g["kept"] += round(sum(rec.kept) / rec.n_layers)
        g["bytes"] += rec.total_bytes
        layers = g["layers"]
        layers.extend([0] * (rec.n_layers - len(layers)))
        for i, size in enumerate(rec.value_sizes):
            layers[i] += size
    info, stat = env.env.info(), env.env.stat()
    manifests = read_manifests(env)
    return StoreStats(
        path=str(env.path),
        schema_version=schema,
        map_size=info["map_size"],
        used_bytes=(info["last_pgno"] + 1) * stat["psize"],
        models=tuple(sorted(set(manifests) | {fp for fp, _, _ in groups})),
        groups=tuple(GroupStats(fp, codec, g["chunks"], g["tokens"], g["bytes"], tuple(g["layers"]), g["preamble"],
                                g["damaged"], variant, g["kept"]) for (fp, codec, variant), g in sorted(groups.items())),
    )


def verify(env: StoreEnv, *, repair: bool = False) -> VerifyReport:
    """Decode every value, checking checksums, lengths and shapes against each chunk's record.

    With `repair`, every chunk with a problem is deleted whole, so the next precompute redoes it.
    """
    ensure_schema(env)
    manifests = read_manifests(env)
    lead_ins = current_lead_ins(env, manifests)
    problems: list[Problem] = []
    chunks = values = nbytes = 0
    bad_chunks: list[bytes] = []  # prefixes of chunks to delete whole
    stray: list[bytes] = []  # malformed keys, deleted alone
    for chunk, entries, malformed in _walk(env):
        if chunk is None:
            problems.extend(Problem("?", "?", "?", None, f"malformed key {k!r}") for k in malformed)
            stray.extend(malformed)
            continue
        found = _check_chunk(chunk, entries)
        if stale_variant(chunk, lead_ins, manifests):
            found.append(Problem(chunk.model_fp, chunk.codec, chunk.chunk_id, None, STALE_LEAD_IN, chunk.variant))
        if found:
            problems.extend(found)
            bad_chunks.append(chunk.prefix)
        elif entries["record"] is not None:
            chunks += 1
            values += len(entries["layers"])
            nbytes += sum(len(v) for v in entries["layers"].values())
    if repair:
        _delete_prefixes(env, bad_chunks + stray)
    return VerifyReport(chunks, values, nbytes, tuple(problems), len(bad_chunks) if repair else 0)


def gc(env: StoreEnv, indexed_ids: set[str] | None = None, *, keep_model: str | None = None,
       drop_model: str | None = None, dry_run: bool = False, drop_ids: frozenset[str] = frozenset(),
       drop_lead_in: Callable[[tuple[int, ...]], bool] | None = None) -> GcReport:
    """Drop KV of chunks not in `indexed_ids` (None: skip that test) or in `drop_ids`, of models other than
    `keep_model`, of `drop_model`, preambles no manifest refers to, and chunks computed after a lead-in that is no
    longer the model's (a stale variant), or after one `drop_lead_in` (its token ids) condemns, with that lead-in.
    Claims of dropped chunks go too.
    """
    ensure_schema(env)
    manifests = read_manifests(env)
    lead_ins = current_lead_ins(env, manifests)
    doomed_leads = {group for group, record in lead_ins.items()
                    if drop_lead_in is not None and drop_lead_in(tuple(int(t) for t in record.token_ids))}

    def doomed_model(fp: str) -> bool:
        return (keep_model is not None and fp != keep_model) or fp == drop_model

    drop, kept, nbytes = [], 0, 0
    for key, raw in scan_records(env, b""):
        group = (key.model_fp, key.codec)
        if doomed_model(key.model_fp):
            gone = True
        elif is_preamble_id(key.chunk_id):
            m = manifests.get(key.model_fp)
            gone = m is not None and key.chunk_id not in (preamble_chunk_id(m.preamble_hash), lead_in_chunk_id(m.preamble_hash))
            gone |= group in doomed_leads and key.chunk_id.endswith(LEAD_IN_SUFFIX)
        else:
            gone = key.chunk_id in drop_ids or (indexed_ids is not None and key.chunk_id not in indexed_ids)
            gone |= stale_variant(key, lead_ins, manifests, doomed_leads)
        if gone:
            drop.append(key.prefix)
            try:
                nbytes += KVRecord.from_bytes(raw).total_bytes
            except CorruptValue:
                pass
        else:
            kept += 1
    models = sorted(fp for fp in set(manifests) | _models_in_kv(env) if doomed_model(fp))
    claims = _dead_claims(env)
    if not dry_run:
        # model prefixes too: whatever else a dropped model left (claims, damaged chunks)
        _delete_prefixes(env, drop + claims + [model_prefix(fp) for fp in models])
        config = current_chunking(env) if indexed_ids is not None else None

        def fix_manifests(txn: lmdb.Transaction) -> None:
            for fp in models:
                drop_manifest(txn, env, fp)
            if indexed_ids is not None:  # what is left belongs to the current index
                for fp in set(manifests) - set(models):
                    set_chunking(txn, env, fp, config)
            chunk_log.trim(txn, env.db("meta"))  # the chunk table's log: its newest entries kept

        env.write(fix_manifests)
    return GcReport(len(drop), nbytes, tuple(models), kept, dry_run, len(doomed_leads))


def current_lead_ins(env: StoreEnv, manifests: dict) -> dict[tuple[str, str], KVRecord]:
    """The record of each (model, codec)'s current lead-in (precompute/lead_in.py: the one its manifest's preamble
    names), whose token ids name the variant its chunks are stored in: one get per model and codec, no scan."""
    keys = {(fp, codec): ChunkKey(fp, codec, lead_in_chunk_id(m.preamble_hash)).to_bytes()
            for fp, m in manifests.items() for codec in CODEC_IDS}
    raws = env.read(lambda txn: {group: txn.get(key, db=env.db("kv")) for group, key in keys.items()})
    found = {}
    for group, raw in raws.items():
        try:
            if raw is not None:
                found[group] = KVRecord.from_bytes(bytes(raw))
        except CorruptValue:
            pass  # verify reports it; its chunks are judged by no lead-in
    return found


def stale_variant(key: ChunkKey, lead_ins: dict[tuple[str, str], KVRecord], manifests: dict,
                  doomed=frozenset()) -> bool:
    """Whether a chunk was computed after a lead-in its model no longer has (a changed or dropped one): no reader
    reads it again. A model with no manifest is not judged."""
    if not key.variant.startswith(LEAD_IN_VARIANT) or key.model_fp not in manifests:
        return False
    group = (key.model_fp, key.codec)
    lead = lead_ins.get(group)
    return group in doomed or lead is None or lead_in_variant(lead.token_bytes) != key.variant


def _check_chunk(chunk: ChunkKey, entries: dict) -> list[Problem]:
    def problem(layer: int | None, reason: str) -> Problem:
        return Problem(chunk.model_fp, chunk.codec, chunk.chunk_id, layer, reason, chunk.variant)

    raw, layers = entries.get("record"), entries["layers"]
    if raw is None:
        return [problem(None, f"{len(layers)} layer value(s) without a chunk record")] if layers else []
    try:
        rec = KVRecord.from_bytes(raw)
    except CorruptValue as exc:
        return [problem(None, str(exc))]
    found = [problem(i, "layer beyond the record's layer count") for i in layers if i >= rec.n_layers]
    for i in range(rec.n_layers):
        value = layers.get(i)
        if value is None:
            found.append(problem(i, "layer value missing"))
            continue
        if len(value) != rec.value_sizes[i]:
            found.append(problem(i, f"{len(value)} bytes, record says {rec.value_sizes[i]}"))
            continue
        try:
            decoded = decode(value, expect_codec=chunk.codec, expect_shape=rec.layer_shape(i))
        except CorruptValue as exc:
            found.append(problem(i, str(exc)))
            continue
        reason = _positions_reason(chunk, decoded.positions, rec.n_tokens)
        if reason:
            found.append(problem(i, reason))
    return found


def _positions_reason(chunk: ChunkKey, positions, n_tokens: int) -> str | None:
    """A reduced variant's values must carry valid positions (a loader places rows by them); a full chunk's
    rows are its tokens in order, so positions there are only checked when present."""
    if positions is None:
        return "reduced chunk value without token positions" if is_reduced(chunk.variant) else None
    return positions_problem(positions, n_tokens)


def _walk(env: StoreEnv) -> Iterator[tuple[ChunkKey | None, dict, list[bytes]]]:
    """Every chunk's entries ({"record": raw, "layers": {i: raw}}), one read transaction per chunk.

    A first keys-only pass lists the chunks, so values are read one chunk at a time and no
    transaction stays open while the caller decodes. Malformed keys come as (None, {}, [keys]).
    """
    chunks: list[ChunkKey] = []
    stray: list[bytes] = []
    with env.reader() as txn:
        for raw in txn.cursor(db=env.db("kv")).iternext(values=False):
            key = _parsed(raw)
            if key is None:
                stray.append(bytes(raw))
                continue
            chunk = chunk_of(key)
            if not chunks or chunks[-1] != chunk:
                chunks.append(chunk)
    if stray:
        yield None, {}, stray
    for chunk in chunks:
        entries: dict = {"record": None, "layers": {}}
        with env.reader() as txn:
            cursor = txn.cursor(db=env.db("kv"))
            ok = cursor.set_range(chunk.prefix)
            while ok and cursor.key().startswith(chunk.prefix):
                key = _parsed(cursor.key())  # None: malformed, already reported by the keys-only pass
                if isinstance(key, KVKey):
                    entries["layers"][key.layer] = cursor.value()
                elif isinstance(key, ChunkKey):
                    entries["record"] = cursor.value()
                ok = cursor.next()
        yield chunk, entries, []


def _dead_claims(env: StoreEnv) -> list[bytes]:
    """Claim keys whose owner is gone or whose lease expired (a killed precompute leaves them)."""
    now = time.time()
    with env.reader() as txn:
        keys = [bytes(k) for k in txn.cursor(db=env.db("kv")).iternext(values=False) if k.endswith(TAG_CLAIM)]
        return [k for k in keys if isinstance(_parsed(k), ClaimKey)
                and not claim_alive(txn.get(k, db=env.db("kv")), "", now)]  # "": judged by no owner


def _parsed(raw: bytes):
    """The key, None for a malformed one."""
    try:
        return parse_key(raw)
    except ValueError:
        return None


def _models_in_kv(env: StoreEnv) -> set[str]:
    """Model fingerprints with any key in `kv`, jumping from one model's range to the next."""
    found: set[str] = set()
    with env.reader() as txn:
        cursor = txn.cursor(db=env.db("kv"))
        ok = cursor.first()
        while ok:
            key = _parsed(cursor.key())
            if key is None:
                ok = cursor.next()
                continue
            found.add(chunk_of(key).model_fp)
            nxt = after_prefix(model_prefix(chunk_of(key).model_fp))
            ok = nxt is not None and cursor.set_range(nxt)
    return found


def _delete_prefixes(env: StoreEnv, prefixes: list[bytes]) -> int:
    db, count = env.db("kv"), 0
    for start in range(0, len(prefixes), DELETE_BATCH):
        batch = prefixes[start : start + DELETE_BATCH]
        count += env.write(lambda txn, batch=batch: sum(delete_prefix(txn, db, p) for p in batch))
    return count
