"""What the driver of `precompute --ray` costs now that the workers encode (and, on object storage, PUT) their own
chunks: per worker count, the run's throughput and the driver's busy seconds per token (`kvrag bench cluster`).

Each run precomputes the same chunks into a scratch store of its own: the indexed store's first `chunks` chunk
records (sorted by id, so every run takes the same ones) without any KV, so every run computes them all. With
`remote`, the scratch store is made a mirror of a fresh prefix under remote.url (each run's KV objects are left
there, a few MB a chunk: point it at a scratch bucket or prefix). The driver's busy time is all it does in the run
but wait on Ray (claiming, reading chunk records, committing, bookkeeping: PrecomputeSummary.writer_busy_s); a
driver that needs more than a worker's seconds per token is what caps the cluster.
"""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.bench.precompute import scratch_store
from kvrag.precompute.on_ray import precompute_ray
from kvrag.store.chunks import ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.open import MARKER, RemoteOptions


@dataclass(frozen=True)
class ScratchRemote:
    """Where runs on object storage write: each under <url>/<a prefix of its own>, with the AWS variables `aws`."""

    url: str  # s3://bucket/prefix
    aws: Mapping[str, str] = field(default_factory=dict)


def precompute_rates(store_dir: Path, model: str | None, workers: Sequence[int] = (1, 2),
                     remote: ScratchRemote | None = None, *, chunks: int | None = None, dtype: str | None = None,
                     codec: str = "fp16", address: str | None = None) -> list[dict]:
    """One precompute_ray run per worker count over a scratch copy of the store's first `chunks` chunks (None:
    all): workers, tokens, wall_s, tokens_per_s, driver_busy_s, driver_busy_per_token_us and the workers' summed
    compute and storing seconds. address: as precompute_ray's (None: a local cluster of `workers` CPUs per run)."""
    with StoreEnv.open(store_dir, readonly=True) as source_env:
        source = ChunkTable(source_env)
        ids = sorted(source.ids())
        records = source.get_many(ids if chunks is None else ids[:chunks])
        with tempfile.TemporaryDirectory(prefix="kvrag-bench-cluster-") as tmp:
            return [_one_run(Path(tmp) / f"w{n}", source, records, model, n, remote, dtype, codec, address)
                    for n in workers]


def _one_run(path: Path, source: ChunkTable, records, model: str | None, workers: int, remote: ScratchRemote | None,
             dtype: str | None, codec: str, address: str | None) -> dict:
    options = None
    with scratch_store(path, source, records) as env:
        if remote is not None:  # a mirror of a fresh prefix: nothing there, every chunk PUT by a worker
            url = f"{remote.url.rstrip('/')}/bench-cluster-{secrets.token_hex(4)}-w{workers}"
            (path / MARKER).write_text(json.dumps({"url": url}))
            options = RemoteOptions(aws=dict(remote.aws))
        summary = precompute_ray(env, model, dtype, codec, address=address, workers=workers, remote=options)
    tokens = summary.tokens
    return {"workers": workers, "chunks": summary.computed, "tokens": tokens, "wall_s": summary.wall_s,
            "tokens_per_s": summary.tokens_per_s, "driver_busy_s": summary.writer_busy_s,
            "driver_busy_per_token_us": 1e6 * summary.writer_busy_s / tokens if tokens else 0.0,
            "worker_compute_s": summary.compute_s, "worker_store_s": summary.store_s,
            "remote": remote is not None}
