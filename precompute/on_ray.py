"""`kvrag precompute --ray`: the chunks without KV prefilled by Ray actors, stored by one writer.

The driver (this process) lists the missing chunks, claims them a batch at a time (KVTable.claim, as precompute()
does) and hands each batch to one of N actors; each actor loads the model once and returns every chunk's per-layer
(K, V) as numpy arrays ready for the codec, with the kept positions under `--keep`. The driver alone writes: each
chunk whole in one transaction (KVTable.put_chunk, which skips a chunk already there), so a driver killed midway and
run again stores nothing twice and loses nothing but the batches in flight. A worker that dies is restarted (its
model loaded again) and the batch it held is run again (Ray's max_restarts / max_task_retries).

The values are those precompute() stores: the same forward pass, one process per worker (needs `kvrag[ray]`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvrag.blend.keyformer import KeepConfig
from kvrag.errors import KvragError
from kvrag.model.device import keep_freed_memory
from kvrag.model.files import LocalModel, resolve_model
from kvrag.model.prompt import PromptBuilder
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import (
    PrecomputeInterrupted,
    PrecomputeSummary,
    chunk_kv,
    chunk_layers,
    layers_to_numpy,
    plan_run,
)
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.kv import KVTable, Shard
from kvrag.store.manifest import preamble_hash
from kvrag.store.remote import RemoteOptions

RAY_BATCH = 4  # chunks per Ray task: few, so a killed worker redoes little and results stay small
IN_FLIGHT_PER_WORKER = 2  # batches queued per actor: one computing, one ready to start; bounds the driver's memory
MAX_RESTARTS = 3  # times a dead worker is restarted (and its batch retried) before the run fails
INSTALL_HINT = "--ray needs Ray: pip install 'kvrag[ray]'"


def import_ray():
    """The ray module, or one clear KvragError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KvragError(INSTALL_HINT) from None
    return ray


@dataclass
class Prefilled:
    """One chunk as a worker returns it: what KVTable.put_chunk takes, and the forward pass's time."""

    chunk_id: str
    token_ids: tuple[int, ...]
    layers: list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V) [T_kept, Hkv, hd] in the codec's numpy dtype
    positions: np.ndarray | list[np.ndarray] | None  # kept token positions (None: every token)
    compute_s: float


class PrefillWorker:
    """A Ray actor (one CPU): loads the model once, then prefills batches of chunks right after the preamble.

    on_batch(chunk_ids), if given, runs in the worker before each batch (tests kill the worker there).
    """

    def __init__(self, model_path: str, dtype: str | None, codec: str, keep: KeepConfig,
                 on_batch: Callable[[list[str]], None] | None = None):
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        torch.set_num_threads(max(1, int(cpus)))  # the cores Ray gave this actor, not the machine's
        keep_freed_memory()
        self.runtime = Runtime.load(model_path, dtype, "cpu")
        self.codec, self.keep, self.on_batch = codec, keep, on_batch
        with torch.inference_mode():
            self.preamble = chunk_kv(self.runtime, None, self.runtime.prompts.preamble_ids)

    def preamble_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return layers_to_numpy(self.preamble, self.codec)

    def prefill(self, batch: list[tuple[str, tuple[int, ...]]]) -> list[Prefilled]:
        if self.on_batch:
            self.on_batch([chunk_id for chunk_id, _ in batch])
        out = []
        with torch.inference_mode():
            for chunk_id, token_ids in batch:
                t0 = time.perf_counter()
                layers, kept = chunk_layers(self.runtime, self.preamble, chunk_id, token_ids, self.keep, self.codec)
                out.append(Prefilled(chunk_id, token_ids, layers, kept, time.perf_counter() - t0))
        return out


def precompute_ray(store: StoreEnv, model: str | None = None, dtype: str | None = None, codec: str = "fp16",
                   keep: KeepConfig | None = None, address: str | None = None, workers: int = 2,
                   batch: int = RAY_BATCH, on_progress: Callable[[int, int, int], None] | None = None,
                   on_start: Callable[[int], None] | None = None, limit: int | None = None,
                   shard: Shard | None = None, compress: bool = True,
                   on_batch: Callable[[list[str]], None] | None = None,
                   remote: RemoteOptions | None = None) -> PrecomputeSummary:
    """precompute() with the forward passes on `workers` Ray actors: the same chunks stored, the same summary.

    address: None or "local" starts a local cluster of `workers` CPUs (shut down at the end); "auto" or
    "ray://host:10001" connects to a running one, whose nodes must see the model directory at the same path.
    In a process already connected to Ray, that connection is used and left open. on_batch: see PrefillWorker.
    """
    start = time.perf_counter()
    ray = import_ray()
    if workers < 1 or batch < 1:
        raise KvragError(f"--ray-workers and the batch must be at least 1, got {workers} and {batch}")
    local = resolve_model(model)  # once here: a first-use conversion is not raced by the workers
    prompts = PromptBuilder(local.load_tokenizer())
    keep = keep or KeepConfig()
    run = plan_run(store, local, prompts.template.preamble, codec, compress, keep, shard, limit, remote)
    chunks, full, table, todo, summary = run.chunks, run.full, run.table, run.todo, run.summary
    if todo or not full.has_preamble(preamble_hash(prompts.template.preamble)):
        with _connected(ray, address, workers):
            actors = _start_workers(ray, local, dtype, codec, keep, workers, on_batch)
            try:
                full.put_preamble(preamble_hash(prompts.template.preamble), prompts.preamble_ids,
                                  _get(ray, actors[0].preamble_layers.remote()))
                if on_start:
                    on_start(len(todo))
                _run_batches(ray, actors, chunks, table, todo, batch, summary, on_progress)
            except KeyboardInterrupt as exc:  # every chunk put so far is whole: the count is final
                raise PrecomputeInterrupted(summary.computed) from exc
            finally:
                for actor in actors:
                    ray.kill(actor, no_restart=True)
    elif on_start:
        on_start(0)
    summary.writer_busy_s = summary.store_s  # the driver is the writer: storing is all it does besides waiting
    summary.wall_s = time.perf_counter() - start
    return summary


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


def _start_workers(ray, local: LocalModel, dtype, codec: str, keep: KeepConfig, workers: int, on_batch) -> list:
    actor = ray.remote(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)(PrefillWorker)
    return [actor.remote(str(local.path), dtype, codec, keep, on_batch) for _ in range(workers)]


def _run_batches(ray, actors: list, chunks: ChunkTable, table: KVTable, todo: list[str], batch: int,
                 summary: PrecomputeSummary, on_progress) -> None:
    """Claim each batch, send it to the least busy actor (at most IN_FLIGHT_PER_WORKER each), and store the
    chunks of each batch that comes back; on any error, free the claims of what was not stored."""
    batches = [todo[i:i + batch] for i in range(0, len(todo), batch)]
    batches.reverse()  # popped from the end: in todo's order
    pending: dict = {}  # ObjectRef -> index of the actor computing it
    load = [0] * len(actors)
    unstored: set[str] = set()  # claimed by this run and not yet stored
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
                [ref], _ = ray.wait(list(pending), num_returns=1)
                load[pending.pop(ref)] -= 1
                for chunk in _get(ray, ref):
                    _store(table, chunk, summary)
                    unstored.discard(chunk.chunk_id)
                    if on_progress:
                        on_progress(summary.computed, summary.tokens, len(todo))
    except BaseException:
        table.release(unstored)  # Ctrl-C, a failed worker, a full disk: the next run takes these at once
        raise


def _store(table: KVTable, chunk: Prefilled, summary: PrecomputeSummary) -> None:
    t0 = time.perf_counter()
    stored = table.put_chunk(chunk.chunk_id, chunk.token_ids, chunk.layers, chunk.positions)
    summary.store_s += time.perf_counter() - t0
    summary.compute_s += chunk.compute_s
    if stored:
        summary.computed += 1
        summary.tokens += len(chunk.token_ids)
        summary.kept_tokens += round(np.mean([len(k) for k, _ in chunk.layers]))
    else:  # another process stored it since this run claimed it (its claim had expired)
        summary.skipped_by_others += 1


def _get(ray, ref):
    """ray.get, with a worker's failure as one KvragError line (its own error's message where Ray kept it)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        lines = [line for line in str(cause if cause is not None else exc).splitlines() if line.strip()]
        raise KvragError(f"a Ray worker failed: {lines[-1].strip() if lines else type(exc).__name__}") from exc
