"""Precompute: every indexed chunk's KV, prefilled right after the preamble, kept in the store.

A chunk is computed at positions P..P+n-1 (P = preamble length) attending to the preamble, exactly
as it will stand first in a real prompt; only its own tokens' K (before rotary) and V are kept. A model whose
layers slide stores each chunk a second time, computed after the preamble and a lead-in of corpus text
(precompute/lead_in.py).
Work is claimed a few chunks at a time, so several processes (or `--shard i/N`) share a store, and
each chunk is written whole in one transaction, so an interrupted run resumes where it stopped
(Ctrl-C raises PrecomputeInterrupted, which counts the chunks the run stored).

With a KeepConfig that reduces (`--keep R`), each chunk's keys are scored during that same forward and only the
kept tokens' K and V are stored, with their positions, under the store variant the settings name (keyed apart
from the full chunks: one store holds both); the preamble stays in the full chunks' range (precompute/keyformer.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvrag.errors import KvragError
from kvrag.model.prefill import LayerKV, extend
from kvrag.model.runtime import Runtime
from kvrag.precompute import keyformer, lead_in
from kvrag.precompute.keyformer import KeepConfig
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.keys import lead_in_chunk_id, preamble_chunk_id
from kvrag.store.manifest import check_or_record, preamble_hash
from kvrag.store.open import RemoteOptions, store_table
from kvrag.store.table import KVTable, Shard

CLAIM_BATCH = 4  # chunks claimed per transaction: small, so a crash strands little work
WRITES_IN_FLIGHT = 2  # chunks encoded/written behind the forward passes; bounds the memory held


@dataclass
class PrecomputeSummary:
    model_fp: str
    codec: str
    indexed_chunks: int
    already_stored: int
    computed: int
    skipped_by_others: int  # claimed or finished by a concurrent process
    tokens: int
    compute_s: float  # the forward passes alone
    store_s: float  # what storing cost the forward loop: the numpy copy and any wait for the writer
    wall_s: float
    writer_busy_s: float = 0.0  # encoding, compressing and committing, in the writer thread
    variant: str = ""  # the store variant written ("": full chunks)
    kept_tokens: int = 0  # tokens stored (averaged over layers), of `tokens` computed
    forms: int = 1  # forms stored of each chunk: 2 for a sliding-window model (after the preamble, after the lead-in)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def store_overhead(self) -> float:
        """Time storing held up the forward passes, as a share of their time (the target is under 10 %)."""
        return self.store_s / self.compute_s if self.compute_s else 0.0

    def count(self, tokens: int, stored: bool, kept_tokens: int = 0) -> None:
        """One chunk done: stored by this run, or stored meanwhile by another process (its claim had expired) or by
        a Ray worker before it died."""
        if stored:
            self.computed += 1
            self.tokens += tokens
            self.kept_tokens += kept_tokens
        else:
            self.skipped_by_others += 1

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "store_overhead": self.store_overhead}


class PrecomputeInterrupted(KeyboardInterrupt):
    """Ctrl-C during precompute, raised once the writes already started have finished: `stored` chunks
    were stored by this run, and their claims and the rest are free for the next run."""

    def __init__(self, stored: int):
        super().__init__(f"interrupted; {stored} chunks stored")
        self.stored = stored


def layers_to_numpy(kv: LayerKV, codec: str = "int8") -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) as numpy arrays [T, Hkv, hd] for the store's codec: float16 for the fp16
    codec (one cast in torch instead of two), float32 otherwise (bf16 and int8 round from it)."""
    dtype = torch.float16 if codec == "fp16" else torch.float32
    return [(k.to(dtype).cpu().numpy(), v.to(dtype).cpu().numpy()) for k, v in zip(kv.k, kv.v, strict=True)]


def preamble_kv(runtime: Runtime, kv_table: KVTable) -> LayerKV:
    """The preamble's KV, computed (it is short) and stored once for `ask`."""
    ids = runtime.prompts.preamble_ids
    kv = chunk_kv(runtime, None, ids)
    kv_table.put_chunk(preamble_chunk_id(preamble_hash(runtime.prompts.template.preamble)), ids,
                       layers_to_numpy(kv, kv_table.codec))
    return kv


def chunk_kv(runtime: Runtime, preamble: LayerKV | None, token_ids: list[int] | tuple[int, ...]) -> LayerKV:
    """One chunk's KV as it stands right after `preamble` (the preamble, or it and a lead-in; None: the preamble's
    own)."""
    _, kv = extend(runtime.model, preamble, runtime.ids_tensor(list(token_ids)))
    return kv


def keep_lead_in(table: KVTable, preamble_text: str) -> Callable[[lead_in.LeadIn, LayerKV], None]:
    """Stores a lead-in's KV, once computed, under its reserved id in the full chunks' `table`."""
    def keep(lead: lead_in.LeadIn, kv: LayerKV) -> None:
        table.put_chunk(lead_in_chunk_id(preamble_hash(preamble_text)), lead.ids, layers_to_numpy(kv, table.codec))
    return keep


@dataclass
class RunPlan:
    """What a precompute run stores: the chunk table, the full and the (maybe reduced) KV tables, the chunks still
    to compute (after shard and limit), and the summary counting what was there already."""

    chunks: ChunkTable
    full: KVTable
    table: KVTable
    todo: list[str]
    summary: PrecomputeSummary
    lead: lead_in.LeadIn | None = None  # what the chunks follow after the preamble, for a sliding-window model


def plan_run(store: StoreEnv, local, preamble_text: str, codec: str, compress: bool, keep: KeepConfig,
             shard: Shard | None, limit: int | None, remote: RemoteOptions | None = None,
             lead_in_tokens: int = 0) -> RunPlan:
    """The indexed chunks without KV for this model, codec and `keep` variant (the store's manifest checked or
    recorded first); shared by precompute and precompute_ray. `local`: the model's LocalModel; `remote`: how a
    mirror's object store is reached; `lead_in_tokens`: the model's lead-in (precompute/lead_in.py; reduced chunks
    have none)."""
    chunks = ChunkTable(store)
    ids = sorted(chunks.ids())
    if not ids:
        raise KvragError(f"the store at {store.path} has no indexed chunks; run `kvrag index` first")
    check_or_record(store, local.fingerprint, preamble_text, codec, tokenizer_fp=local.tokenizer_fingerprint)
    full = store_table(store, local.fingerprint, codec, compress, remote=remote)  # a mirror's: the object store
    lead = None if keep.reduced else lead_in.find(full, preamble_hash(preamble_text), lead_in_tokens, chunks)
    variant = keep.variant if keep.reduced else (lead.variant if lead is not None else "")
    table = store_table(store, local.fingerprint, codec, compress, variant, remote) if variant else full
    todo = table.missing(ids, shard)
    already = len(ids) - len(todo) if shard is None else sum(1 for c in ids if shard.owns(c)) - len(todo)
    summary = PrecomputeSummary(local.fingerprint, codec, len(ids), already, 0, 0, 0, 0.0, 0.0, 0.0, variant=variant)
    return RunPlan(chunks, full, table, todo if limit is None else todo[:limit], summary, lead)


def precompute(store: StoreEnv, runtime: Runtime, codec: str = "fp16", limit: int | None = None,
               shard: Shard | None = None,
               on_progress: Callable[[int, int, int], None] | None = None,
               on_start: Callable[[int], None] | None = None, compress: bool = True,
               keep: KeepConfig | None = None, remote: RemoteOptions | None = None) -> PrecomputeSummary:
    """Compute and store the KV of every indexed chunk that has none for this model, codec and `keep` variant.

    `compress=False` stores values uncompressed (larger, but decoded with no CPU work: see store/codec.py).
    `keep` (reduced): store each chunk's kept tokens only (see the module doc).
    on_start(n_todo); on_progress(chunks_done, tokens_done, n_todo) after each stored chunk.
    """
    start = time.perf_counter()
    keep = keep or KeepConfig()
    plans = [plan_run(store, runtime.local, runtime.prompts.template.preamble, codec, compress, keep, shard, limit,
                      remote, tokens) for tokens in lead_in.passes(lead_in.tokens_for(runtime), keep.reduced)]
    n_todo = sum(len(run.todo) for run in plans)
    if on_start:
        on_start(n_todo)
    with torch.inference_mode():
        preamble = preamble_kv(runtime, plans[0].full)  # once: every pass's chunks follow it
    done: list[PrecomputeSummary] = []
    for run in plans:
        before = (sum(s.computed for s in done), sum(s.tokens for s in done))
        step = None if on_progress is None else \
            (lambda c, t, _, b=before: on_progress(b[0] + c, b[1] + t, n_todo))  # noqa: E731
        done.append(_run_pass(runtime, run, keep, preamble, step))
    summary = merged(done)
    summary.wall_s = time.perf_counter() - start
    return summary


def _run_pass(runtime: Runtime, run: RunPlan, keep: KeepConfig, preamble: LayerKV, on_progress) -> PrecomputeSummary:
    """One table's chunks: those after the preamble, or those after the lead-in."""
    writer = ChunkWriter(run.table)
    try:
        with torch.inference_mode(), writer:
            prefix = lead_in.ChunkPrefix(runtime.model, runtime.ids_tensor, preamble, run.lead,
                                         keep_lead_in(run.full, runtime.prompts.template.preamble))
            _compute_all(runtime, run, writer, on_progress, prefix, keep)
    except KeyboardInterrupt as exc:  # the writer has finished what it started: count is final
        raise PrecomputeInterrupted(writer.stored) from exc
    run.summary.writer_busy_s = writer.busy_s
    return run.summary


def merged(passes: list[PrecomputeSummary]) -> PrecomputeSummary:
    """One summary of a run's passes (a sliding-window model's two forms of each chunk): their counts and times
    added up, the last pass's variant."""
    out = passes[0]
    for more in passes[1:]:
        for name in ("already_stored", "computed", "skipped_by_others", "tokens", "compute_s", "store_s",
                     "writer_busy_s", "kept_tokens"):
            setattr(out, name, getattr(out, name) + getattr(more, name))
        out.variant = more.variant
    out.forms = len(passes)
    return out


def _compute_all(runtime: Runtime, run: RunPlan, writer: ChunkWriter, on_progress, prefix: lead_in.ChunkPrefix,
                 keep: KeepConfig) -> None:
    """Each chunk of `run.todo` this process claims, computed after its prefix and queued to the writer."""
    chunks, table, todo, summary = run.chunks, run.table, run.todo, run.summary
    for i in range(0, len(todo), CLAIM_BATCH):
        batch = todo[i:i + CLAIM_BATCH]
        mine = table.claim(batch)
        summary.skipped_by_others += len(batch) - len(mine)
        try:
            for record in chunks.get_many(mine):
                t0 = time.perf_counter()
                layers, kept = chunk_layers(runtime, prefix.prefix_for(record.token_ids), record.chunk_id,
                                            record.token_ids, keep, table.codec)
                t1 = time.perf_counter()
                summary.kept_tokens += round(np.mean([len(k) for k, _ in layers]))
                done = writer.submit(record.chunk_id, record.token_ids, layers, kept)
                summary.compute_s += t1 - t0
                summary.store_s += time.perf_counter() - t1
                _count(summary, done, on_progress, len(todo))
        except BaseException:
            table.release(set(mine) | set(writer.abandon()))  # Ctrl-C: free what this run will not finish
            raise
    t1 = time.perf_counter()
    _count(summary, writer.drain(), on_progress, len(todo))
    summary.store_s += time.perf_counter() - t1


def chunk_layers(runtime: Runtime, preamble: LayerKV, chunk_id: str, token_ids, keep: KeepConfig,
                 codec: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray | list[np.ndarray] | None]:
    """One chunk's per-layer (K, V) for the store's codec, and the kept positions (None: every token)."""
    if not keep.reduced:
        return layers_to_numpy(chunk_kv(runtime, preamble, token_ids), codec), None
    kv, kept = keyformer.reduce_chunk(runtime.model, preamble, runtime.ids_tensor(list(token_ids)), keep, chunk_id)
    return keyformer.reduce_layers(layers_to_numpy(kv, codec), kept), kept


def _count(summary: PrecomputeSummary, done: list[tuple[int, bool]], on_progress, n_todo: int) -> None:
    for n_tokens, stored in done:
        summary.count(n_tokens, stored)
        if on_progress:
            on_progress(summary.computed, summary.tokens, n_todo)


class ChunkWriter:
    """Encodes, compresses and commits chunks in one thread while the next chunk's forward runs.

    zstd, xxhash and LMDB's commit release the GIL, so storing mostly hides behind the compute. At most
    WRITES_IN_FLIGHT chunks wait; each is still one transaction, so a crash leaves whole chunks only.
    """

    def __init__(self, table: KVTable):
        self.table = table
        self.busy_s = 0.0
        self.stored = 0  # chunks this writer committed (not those another process had stored first)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-writer")
        self._pending: deque[tuple[str, int, Future]] = deque()

    def submit(self, chunk_id: str, token_ids, layers, positions=None) -> list[tuple[int, bool]]:
        """Queue a chunk (with its kept positions, when reduced); returns (tokens, stored) of the chunks finished
        meanwhile, oldest first. Blocks while the queue is full; raises the writer's error (a full disk, a store
        error)."""
        future = self._pool.submit(self._put, chunk_id, token_ids, layers, positions)
        self._pending.append((chunk_id, len(token_ids), future))
        done = []
        while self._pending and (len(self._pending) > WRITES_IN_FLIGHT or self._pending[0][2].done()):
            _, n_tokens, future = self._pending.popleft()
            done.append((n_tokens, future.result()))
        return done

    def drain(self) -> list[tuple[int, bool]]:
        done = [(n_tokens, future.result()) for _, n_tokens, future in self._pending]
        self._pending.clear()
        return done

    def abandon(self) -> list[str]:
        """Drop the queued chunks that have not started; returns their ids, whose claims the caller frees."""
        dropped = [chunk_id for chunk_id, _, future in self._pending if future.cancel()]
        self._pending.clear()
        return dropped

    def _put(self, chunk_id: str, token_ids, layers, positions) -> bool:
        t0 = time.perf_counter()
        try:
            stored = self.table.put_chunk(chunk_id, token_ids, layers, positions)
            self.stored += int(stored)  # one writer thread: no race
            return stored
        finally:
            self.busy_s += time.perf_counter() - t0

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)  # a started write finishes: it is one transaction either way
