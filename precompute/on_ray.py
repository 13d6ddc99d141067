"""`kvrag precompute --ray`: the chunks without KV prefilled, encoded and (on object storage) stored by Ray actors.

The driver (this process) lists the missing chunks, claims them a batch at a time (KVTable.claim, as precompute()
does) and hands each batch to one of N actors. Each actor loads the model once, prefills its chunks and encodes
each itself (encode_chunk: the codec and zstd, the work that made a lone writer the bottleneck). Then:

    a store on object storage (a mirror)  the actor PUTs each chunk with a client of its own, create-only
                                          (RemoteKVTable.put_encoded), and reports what it stored; the driver
                                          frees the batch's claims and keeps nothing in the mirror's cache tier
    a local LMDB store                    an actor on the driver's node commits each chunk itself (LMDB takes
                                          writers from several processes in turn); one on another node, which
                                          cannot see the driver's disk, returns the record and value bytes and the
                                          driver commits them (KVTable.put_encoded)

Either way a chunk is stored whole (one transaction, or one PUT) and only where it is not yet (a stored chunk is
skipped, never stored twice), so a driver killed midway and run again loses nothing but the batches in flight. A
worker that dies is restarted (its model loaded again) and its batch run again (Ray's max_restarts /
max_task_retries); the rerun skips what the dead worker had already stored. The preamble is stored
the same way, by the first actor. The driver's busy time (all it does but wait on Ray) is writer_busy_s.

The values are those precompute() stores: the same forward pass, one process per worker (needs `kvrag[ray]`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvrag.errors import KvragError
from kvrag.model.device import keep_freed_memory
from kvrag.model.files import resolve_model
from kvrag.model.prefill import LayerKV
from kvrag.model.prompt import PromptBuilder
from kvrag.model.runtime import Runtime
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.lead_in import ChunkPrefix, LeadIn, lead_in_length, passes
from kvrag.precompute.plain import (
    PrecomputeInterrupted,
    PrecomputeSummary,
    RunPlan,
    chunk_kv,
    chunk_layers,
    layers_to_numpy,
    merged,
    plan_run,
)
from kvrag.store.env import StoreEnv
from kvrag.store.keys import lead_in_chunk_id, preamble_chunk_id
from kvrag.store.kv import LocalKVTable
from kvrag.store.manifest import preamble_hash
from kvrag.store.open import RemoteOptions, open_table, remote_url
from kvrag.store.table import KVTable, Shard, encode_chunk

RAY_BATCH = 4  # chunks per Ray task: few, so a killed worker redoes little and results stay small
IN_FLIGHT_PER_WORKER = 2  # batches queued per actor: one computing, one ready to start; bounds the driver's memory
MAX_RESTARTS = 3  # times a dead worker is restarted (and its batch retried) before the run fails


def import_ray():
    """The ray module, or one clear KvragError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KvragError("--ray needs Ray: pip install 'kvrag[ray]'") from None
    return ray


@dataclass(frozen=True)
class Destination:
    """What a worker needs to encode chunks and, for a store on object storage (url set), to PUT them itself: the
    driver's AWS variables travel with it, so every worker builds the client the driver would."""

    codec: str
    compress: bool
    model_fp: str
    url: str | None = None  # None: a local store
    aws: Mapping[str, str] = field(default_factory=dict)
    store_path: str | None = None  # a local store: workers on the driver's node commit to it themselves,
    node_id: str | None = None  # the driver's node; a worker elsewhere hands its bytes back for the driver to commit


@dataclass
class Prefilled:
    """One chunk as a worker reports it: what to count and, for a local store, what the driver commits."""

    chunk_id: str
    tokens: int
    kept_tokens: int  # stored per layer, averaged
    compute_s: float  # the forward pass
    store_s: float  # encoding, and the PUT on object storage
    encoded: tuple[bytes, list[bytes]] | None = None  # record and values for the driver (a local store)
    stored: bool = False  # the worker PUT it (False: an object was there already); with `encoded`, unused


class PrefillWorker:
    """A Ray actor (one CPU): loads the model once, then prefills batches of chunks right after the preamble, encodes
    them and, on object storage, stores them.

    on_batch(chunk_ids), if given, runs in the worker before each batch (tests kill the worker there).
    """

    def __init__(self, model_path: str, dtype: str | None, keep: KeepConfig, dest: Destination,
                 on_batch: Callable[[list[str]], None] | None = None, lead: LeadIn | None = None,
                 variant: str | None = None):
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        torch.set_num_threads(max(1, int(cpus)))  # the cores Ray gave this actor, not the machine's
        keep_freed_memory()
        self.runtime = Runtime.load(model_path, dtype, "cpu")
        self.keep, self.dest, self.on_batch = keep, dest, on_batch
        self.variant = keep.variant if variant is None else variant  # the table the chunks go to (RunPlan's)
        self._tables: dict[str, KVTable] = {}  # variant -> its table, opened at first use
        self._env: StoreEnv | None = None
        on_driver_node = dest.store_path is not None and ray.get_runtime_context().get_node_id() == dest.node_id
        self.writes = dest.url is not None or on_driver_node  # else the driver commits what this returns
        with torch.inference_mode():
            self.preamble = chunk_kv(self.runtime, None, self.runtime.prompts.preamble_ids)
        self.lead_kv: LayerKV | None = None  # the lead-in's own KV, once computed (for store_lead_in)
        self.prefix = ChunkPrefix(self.runtime.model, self.runtime.ids_tensor, self.preamble, lead,
                                  lambda _, kv: setattr(self, "lead_kv", kv))

    def store_preamble(self, chunk_id: str) -> Prefilled:
        """The preamble as a chunk of the full variant (put where it is missing, as precompute() does)."""
        ids = tuple(self.runtime.prompts.preamble_ids)
        if self._present(chunk_id, ""):
            return Prefilled(chunk_id, len(ids), len(ids), 0.0, 0.0)
        return self._store(chunk_id, ids, layers_to_numpy(self.preamble, self.dest.codec), None, "", 0.0)

    def store_lead_in(self, chunk_id: str) -> Prefilled:
        """The lead-in as a chunk of the full variant, beside the preamble (precompute/lead_in.py)."""
        with torch.inference_mode():
            self.prefix.prefix_for(())  # computes it, handing its own KV to lead_kv
        ids = self.prefix.lead_in.ids
        return self._store(chunk_id, ids, layers_to_numpy(self.lead_kv, self.dest.codec), None, "", 0.0)

    def prefill(self, batch: list[tuple[str, tuple[int, ...]]]) -> list[Prefilled]:
        if self.on_batch:
            self.on_batch([chunk_id for chunk_id, _ in batch])
        out = []
        with torch.inference_mode():
            for chunk_id, token_ids in batch:
                if self._present(chunk_id, self.variant):  # a retried batch: PUT before this worker died
                    out.append(Prefilled(chunk_id, len(token_ids), 0, 0.0, 0.0))
                    continue
                t0 = time.perf_counter()
                layers, kept = chunk_layers(self.runtime, self.prefix.prefix_for(token_ids), chunk_id, token_ids, self.keep,
                                            self.dest.codec)
                out.append(self._store(chunk_id, token_ids, layers, kept, self.variant,
                                       time.perf_counter() - t0))
        return out

    def _store(self, chunk_id: str, token_ids, layers, positions, variant: str, compute_s: float) -> Prefilled:
        """Encode the chunk; store it (a PUT, or a commit on the driver's node), or hand the bytes back."""
        t0 = time.perf_counter()
        encoded = encode_chunk(token_ids, layers, positions, self.dest.codec, self.dest.compress)
        stored = self.writes and self._table(variant).put_encoded(chunk_id, *encoded)
        kept = round(np.mean([len(k) for k, _ in layers]))
        return Prefilled(chunk_id, len(token_ids), kept, compute_s, time.perf_counter() - t0,
                         None if self.writes else encoded, stored)

    def _present(self, chunk_id: str, variant: str) -> bool:
        """Where this worker stores, whether the chunk is there (on object storage, reading its index also marks a
        damaged one, which the PUT then replaces); where the driver commits, it checks then."""
        return self.writes and self._table(variant).has(chunk_id)

    def _table(self, variant: str) -> KVTable:
        if variant not in self._tables:
            if self.dest.url is not None:
                self._tables[variant] = open_table(self.dest.url, self.dest.model_fp, self.dest.codec,
                                                   self.dest.compress, variant, aws=self.dest.aws)
            else:  # LMDB takes writers from several processes in turn: one transaction a chunk, as the driver's
                self._env = self._env or StoreEnv.open(self.dest.store_path)
                self._tables[variant] = LocalKVTable(self._env, self.dest.model_fp, self.dest.codec,
                                                     self.dest.compress, variant)
        return self._tables[variant]


def precompute_ray(store: StoreEnv, model: str | None = None, dtype: str | None = None, codec: str = "fp16",
                   keep: KeepConfig | None = None, address: str | None = None, workers: int = 2,
                   batch: int = RAY_BATCH, on_progress: Callable[[int, int, int], None] | None = None,
                   on_start: Callable[[int], None] | None = None, limit: int | None = None,
                   shard: Shard | None = None, compress: bool = True,
                   on_batch: Callable[[list[str]], None] | None = None,
                   remote: RemoteOptions | None = None, lead_in: int | None = None) -> PrecomputeSummary:
    """precompute() with the forward passes, the encoding and (on object storage) the writes on `workers` Ray
    actors: the same chunks stored, the same summary, writer_busy_s being the driver's busy time.

    address: None or "local" starts a local cluster of `workers` CPUs (shut down at the end); "auto" or
    "ray://host:10001" connects to a running one, whose nodes must see the model directory at the same path.
    In a process already connected to Ray, that connection is used and left open. on_batch: see PrefillWorker.
    lead_in: tokens of a sliding-window model's lead-in (precompute/lead_in.py; None: the model's rule), whose chunks
    are a second pass.
    """
    start = time.perf_counter()
    ray = import_ray()
    if workers < 1 or batch < 1:
        raise KvragError(f"--ray-workers and the batch must be at least 1, got {workers} and {batch}")
    local = resolve_model(model)  # once here: a first-use conversion is not raced by the workers
    prompts = PromptBuilder(local.load_tokenizer())
    keep = keep or KeepConfig()
    tokens = lead_in_length(local.config) if lead_in is None else lead_in
    plans = [plan_run(store, local, prompts.template.preamble, codec, compress, keep, shard, limit, remote, t)
             for t in passes(tokens, keep.reduced)]
    url = remote_url(store.path)
    dest = Destination(codec, compress, local.fingerprint, url, dict((remote or RemoteOptions()).aws) if url else {})
    preamble = preamble_hash(prompts.template.preamble)
    n_todo = sum(len(run.todo) for run in plans)
    if on_start:
        on_start(n_todo)
    if n_todo or any(_reserved(run, preamble) for run in plans):
        with _connected(ray, address, workers):
            if url is None:  # workers on this node commit to the store themselves
                dest = replace(dest, store_path=str(store.path), node_id=ray.get_runtime_context().get_node_id())
            for i, run in enumerate(plans):
                before = sum(len(p.todo) for p in plans[:i])  # chunks of the passes before: the bar goes on
                step = None if on_progress is None else \
                    (lambda c, t, _, b=before: on_progress(b + c, t, n_todo))  # noqa: E731
                _ray_pass(ray, run, dest, local, dtype, keep, workers, batch, step, on_batch, preamble)
    summary = merged([run.summary for run in plans])
    summary.wall_s = time.perf_counter() - start
    return summary


def _reserved(run: RunPlan, preamble: str) -> list[tuple[str, str]]:
    """The reserved chunks a pass stores first, missing from the store: (chunk id, the worker's method)."""
    wanted = [(preamble_chunk_id(preamble), "store_preamble")]
    if run.lead is not None:
        wanted.append((lead_in_chunk_id(preamble), "store_lead_in"))
    return [(chunk_id, method) for chunk_id, method in wanted if not run.full.has(chunk_id)]


def _ray_pass(ray, run: RunPlan, dest: Destination, local, dtype: str | None, keep: KeepConfig, workers: int,
              batch: int, on_progress, on_batch, preamble: str) -> None:
    """One table's chunks on `workers` actors (the preamble's or the lead-in's form), the reserved chunks (the
    preamble, the lead-in) stored first by the first actor."""
    if not run.todo and not _reserved(run, preamble):
        return
    actor = ray.remote(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)(PrefillWorker)
    actors = [actor.remote(str(local.path), dtype, keep, dest, on_batch, run.lead, run.table.variant)
              for _ in range(workers)]
    try:
        busy_from, waited_s = time.perf_counter(), 0.0
        for chunk_id, method in _reserved(run, preamble):
            waited_s += _store_reserved(ray, getattr(actors[0], method), run.full, chunk_id)
        waited_s += _run_batches(ray, actors, run, batch, on_progress)
        run.summary.writer_busy_s = time.perf_counter() - busy_from - waited_s
    except KeyboardInterrupt as exc:  # every chunk committed so far is whole: the count is final
        raise PrecomputeInterrupted(run.summary.computed) from exc
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


@contextmanager
def _connected(ray, address: str | None, workers: int) -> Iterator[None]:
    """Ray connected for the run, and what this started shut down after it."""
    if ray.is_initialized():
        yield
        return
    quiet = dict(logging_level=logging.ERROR, log_to_driver=False)  # the progress bar stays readable
    if address in (None, "local"):
        ray.init(address="local", num_cpus=workers, include_dashboard=False, **quiet)
    else:
        ray.init(address=address, **quiet)
    try:
        yield
    finally:
        ray.shutdown()


def _store_reserved(ray, method, full: KVTable, chunk_id: str) -> float:
    """Have the first actor store the preamble or the lead-in (`method`, the driver committing it for a local store);
    returns the seconds spent waiting for it (the actor loading the model)."""
    ref = method.remote(chunk_id)
    t0 = time.perf_counter()
    ray.wait([ref])
    waited_s = time.perf_counter() - t0
    _commit(full, _get(ray, ref))
    return waited_s


def _run_batches(ray, actors: list, run: RunPlan, batch: int, on_progress) -> float:
    """Claim each batch, send it to the least busy actor (at most IN_FLIGHT_PER_WORKER each), and record (for a
    local store, commit) the chunks of each batch that comes back; on any error, free the claims of what was not
    stored. Returns the seconds spent waiting in ray.wait (the rest is the driver's busy time)."""
    chunks, table, todo, summary = run.chunks, run.table, run.todo, run.summary
    batches = [todo[i:i + batch] for i in range(0, len(todo), batch)]
    batches.reverse()  # popped from the end: in todo's order
    pending: dict = {}  # ObjectRef -> index of the actor computing it
    load = [0] * len(actors)
    unstored: set[str] = set()  # claimed by this run and not yet stored
    waited_s = 0.0
    try:
        while batches or pending:
            while batches and len(pending) < IN_FLIGHT_PER_WORKER * len(actors):
                ids = batches.pop()
                mine = table.claim(ids)
                summary.skipped_by_others += len(ids) - len(mine)
                if mine:
                    unstored.update(mine)
                    worker = load.index(min(load))
                    load[worker] += 1
                    records = [(r.chunk_id, r.token_ids) for r in chunks.get_many(mine)]
                    pending[actors[worker].prefill.remote(records)] = worker
            if pending:
                t0 = time.perf_counter()
                [ref], _ = ray.wait(list(pending), num_returns=1)  # fetches the result too: get only decodes
                waited_s += time.perf_counter() - t0
                load[pending.pop(ref)] -= 1
                done = _get(ray, ref)
                for chunk in done:
                    summary.compute_s += chunk.compute_s
                    summary.store_s += chunk.store_s  # the workers' encoding and uploads: what held up their forwards
                    summary.count(chunk.tokens, _commit(table, chunk), chunk.kept_tokens)
                    unstored.discard(chunk.chunk_id)
                    if on_progress:
                        on_progress(summary.computed, summary.tokens, len(todo))
                put_by_workers = [chunk.chunk_id for chunk in done if chunk.encoded is None]
                if put_by_workers:  # their claims (a commit here drops its chunk's claim; a worker's PUT cannot)
                    table.release(put_by_workers)
    except BaseException:
        table.release(unstored)  # Ctrl-C, a failed worker, a full disk: the next run takes these at once
        raise
    return waited_s


def _commit(table: KVTable, chunk: Prefilled) -> bool:
    """Commit a chunk a worker encoded for a local store; for one it PUT itself, whether it did."""
    if chunk.encoded is None:
        return chunk.stored
    return table.put_encoded(chunk.chunk_id, *chunk.encoded)


def _get(ray, ref):
    """ray.get, with a worker's failure as one KvragError line (its own error's message where Ray kept it)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        lines = [line for line in str(cause if cause is not None else exc).splitlines() if line.strip()]
        raise KvragError(f"a Ray worker failed: {lines[-1].strip() if lines else type(exc).__name__}") from exc
