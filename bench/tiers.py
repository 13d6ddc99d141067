"""Hit-rate ablation (RAGCache Figure 17 style): every policy x host-cache size, with and without
cache-aware reordering, replayed over a Zipf workload of MuSiQue passages.

    kvrag bench tiers                 # table on stdout, progress on stderr
    kvrag bench tiers --json          # the same as JSON
    kvrag bench tiers --measure-load  # also: memory hit vs store hit, per chunk token

The TTFT model is a cost profile T(cached, new) of the default model's prefill (`blend.prefill.extend`),
measured once per machine and kept in $KVRAG_HOME/profiles/ (about a minute). To stay quick on a busy
CPU it times the first `--profile-layers` layers and scales by n_layers / profile_layers (every layer has
the same shapes). Chunk, preamble and question lengths come from the model's own tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvrag.bench.cost_profile import load_or_measure, measure
from kvrag.bench.replay import (
    Corpus,
    SimResult,
    WorkloadSpec,
    chunk_id,
    simulate,
    top_share,
    zipf_requests,
)
from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.config import POLICIES, format_bytes, parse_bytes
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import MAX_PATH_STATS

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_s.json"
SIZES = "128MiB,256MiB,512MiB,1GiB,2GiB,4GiB"
CACHED_GRID = (0, 600, 1200, 1800, 2400, 3000)
NEW_GRID = (64, 600, 1200, 1800, 2400, 3200)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class AblationConfig:
    data: Path = DATA  # MuSiQue-style JSON
    requests: int = 4000
    warmup: int = 1000  # first requests not counted
    k: int = 5  # chunks per question
    zipf: float = 1.0  # popularity exponent
    order: str = "rank"  # rank or drawn
    seed: int = 0
    drift: int = 0  # re-rank popularity every N requests (0: stationary)
    forget_evicted: bool = False  # statistics die with their node instead of being remembered per path
    sizes: str = SIZES
    policies: str = ",".join(POLICIES)
    reorder_window: int = 32
    queue_depth: int = 64  # questions waiting (saturated closed loop)
    profile_layers: int = 2
    refresh_profile: bool = False
    profile: Path | None = None  # profile JSON (measured and saved there if absent; default: in $KVRAG_HOME)
    measure_load: bool = False  # time a memory hit against a store hit


def run(opts: AblationConfig) -> dict:
    """Every policy x size, FIFO and reordered, over one Zipf workload; the report `render` prints."""
    from kvrag.model.files import resolve_model
    from kvrag.model.prompt import PromptBuilder

    if not opts.data.exists():
        raise KvragError(f"{opts.data} is not there (--data)")
    local = resolve_model(None)
    builder = PromptBuilder(local.load_tokenizer())
    corpus = Corpus.load(opts.data)
    ids = [chunk_id(text) for text in corpus.passages]
    lengths = [len(builder.passage_ids("", text)) for text in corpus.passages]
    suffixes = [len(builder.build([], q).suffix) for q in corpus.questions]
    cfg = local.config
    layout = BlockLayout.for_codec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, "fp16")
    profile = cost_profile(local, opts.profile_layers, opts.refresh_profile, opts.profile)

    spec = WorkloadSpec(opts.requests, opts.k, opts.zipf, opts.order, opts.seed, opts.drift)
    requests = zipf_requests(ids, lengths, suffixes, spec)
    sizes = [parse_bytes(s, "--sizes") for s in opts.sizes.split(",")]
    policies = [s.strip().lower() for s in opts.policies.split(",")]
    common = dict(preamble_tokens=len(builder.preamble_ids), warmup=opts.warmup, queue_depth=opts.queue_depth,
                  remember_paths=0 if opts.forget_evicted else MAX_PATH_STATS)
    results: list[SimResult] = []
    for size in sizes:
        for policy in policies:
            for reorder in (False, True):
                r = simulate(requests, layout, profile, policy, size, reorder=reorder,
                             window=opts.reorder_window, **common)
                results.append(r)
                log(f"{format_bytes(size):>7} {policy:5} reorder={reorder!s:5} hit {r.prefix_hit_rate:6.1%} "
                    f"TTFT {r.mean_ttft_s:6.3f}s  ({r.wall_s:.1f}s)")
    report = {
        "workload": {**dataclasses.asdict(spec), "warmup": opts.warmup, "distinct_chunks": len(ids),
                     "mean_chunk_tokens": statistics.mean(lengths), "preamble_tokens": len(builder.preamble_ids),
                     "mean_suffix_tokens": statistics.mean(suffixes),
                     "top3pct_share": top_share(requests, 0.03),
                     "chunks_requested": len({c for r in requests for c in r.chunk_ids}),
                     "bytes_per_token": layout.bytes_per_token,
                     "all_chunks_bytes": sum(layout.blocks_for(n) for n in lengths) * layout.bytes_per_block,
                     "queue_depth": opts.queue_depth, "reorder_window": opts.reorder_window,
                     "statistics": "in-cache" if opts.forget_evicted else "remembered per path"},
        "profile": {"meta": profile.meta, "T(0,600)": profile.time(0, 600), "T(3000,600)": profile.time(3000, 600),
                    "T(0,3000)": profile.time(0, 3000), "T(600,2400)": profile.time(600, 2400)},
        "results": [r.to_dict() for r in results],
        "pgdsf_shortfalls": shortfalls(results),
    }
    if opts.measure_load:
        report["load"] = measure_load(local, builder, corpus, layout)
    return report


def profile_key(local, layers: int) -> dict[str, str]:
    """What a kept profile must match to be reused: the model's shapes, the device, dtype, threads, torch."""
    import torch

    from kvrag.model.device import resolve_device, resolve_dtype

    dev = resolve_device(None)
    # timing depends on the model's shapes, not on its weights or tokenizer
    shape = hashlib.blake2b(repr(local.config).encode(), digest_size=8).hexdigest()
    return {"model_config": shape, "device": str(dev), "dtype": str(resolve_dtype(None, dev)),
            "threads": str(os.environ.get("KVRAG_THREADS") or os.cpu_count()), "torch": torch.__version__,
            "layers_timed": str(layers), "repeats": "3", "grid": f"{CACHED_GRID}x{NEW_GRID}"}


def cost_profile(local, layers: int, refresh: bool, path: Path | None = None) -> CostProfile:
    key = profile_key(local, layers)

    def run_measure() -> CostProfile:
        log(f"profiling prefill T(cached, new) on a {len(CACHED_GRID)}x{len(NEW_GRID)} grid "
            f"({layers} of {local.config.n_layers} layers timed, scaled)...")
        t0 = time.perf_counter()
        timer = prefill_timer(layers)
        timer(600, 64)  # warm-up
        prof = measure(timer, CACHED_GRID, NEW_GRID, repeats=3,
                       on_cell=lambda a, b, t: log(f"  T({a:4}, {b:4}) = {t:6.3f}s"))
        log(f"profile done in {time.perf_counter() - t0:.0f}s")
        return prof

    return load_or_measure(key, run_measure, path=path, refresh=refresh)


def prefill_timer(layers: int):
    """time_prefill(cached, new): seconds of `extend` for `new` tokens after `cached` (scaled to all layers)."""
    import torch

    from kvrag.cli.common import load_runtime
    from kvrag.model.prefill import LayerKV, extend

    runtime = load_runtime()
    full = runtime.model
    model = copy.copy(full)  # the same weights, only the first `layers` layers
    model.cfg = dataclasses.replace(full.cfg, n_layers=layers)
    model.layers = full.layers[:layers]
    scale = full.cfg.n_layers / layers
    c = full.cfg

    def time_prefill(cached: int, new: int) -> float:
        g = torch.Generator().manual_seed(cached * 7919 + new)
        prefix = None
        if cached:
            kv = [torch.randn(cached, c.n_kv_heads, c.head_dim, generator=g).to(model.dtype) for _ in range(2 * layers)]
            prefix = LayerKV(kv[:layers], kv[layers:], torch.arange(cached))
        ids = torch.randint(0, c.vocab_size, (new,), generator=g)
        with torch.inference_mode():
            t0 = time.perf_counter()
            extend(model, prefix, ids)
            return (time.perf_counter() - t0) * scale

    return time_prefill


def shortfalls(results: list[SimResult]) -> list[dict]:
    """Cells where PGDSF's hit rate is below, or its mean TTFT above, another policy's."""
    out = []
    cells: dict[tuple[int, bool], dict[str, SimResult]] = {}
    for r in results:
        cells.setdefault((r.host_bytes, r.reorder), {})[r.policy] = r
    for (size, reorder), by_policy in cells.items():
        mine = by_policy.get("pgdsf")
        if mine is None:
            continue
        for name, other in by_policy.items():
            if name == "pgdsf":
                continue
            if other.prefix_hit_rate > mine.prefix_hit_rate or other.mean_ttft_s < mine.mean_ttft_s:
                out.append({"size": format_bytes(size), "reorder": reorder, "better": name,
                            "hit": [mine.prefix_hit_rate, other.prefix_hit_rate],
                            "ttft": [mine.mean_ttft_s, other.mean_ttft_s]})
    return out


def measure_load(local, builder, corpus: Corpus, layout: BlockLayout, n_chunks: int = 3, repeats: int = 5) -> dict:
    """Per chunk token: a store hit (KVTable read + fp16 decode, per layer) against a memory hit (gather)."""
    import torch

    from kvrag.cli.common import load_runtime
    from kvrag.model.prefill import extend
    from kvrag.precompute.plain import chunk_kv, layers_to_numpy
    from kvrag.store.env import StoreEnv
    from kvrag.store.kv import LocalKVTable
    from kvrag.store.tiers.cache import TieredKVCache

    runtime = load_runtime()
    texts = corpus.passages[:n_chunks]
    log(f"computing the real KV of {n_chunks} passages for the load measurement...")
    with torch.inference_mode():
        _, preamble = extend(runtime.model, None, runtime.ids_tensor(builder.preamble_ids))
        chunks = [(chunk_id(t), builder.passage_ids("", t)) for t in texts]
        kvs = [layers_to_numpy(chunk_kv(runtime, preamble, ids)) for _, ids in chunks]
    cache = TieredKVCache(layout, 256 << 20)
    with tempfile.TemporaryDirectory() as tmp, StoreEnv.open(Path(tmp) / "store", create=True) as env:
        table = LocalKVTable(env, local.fingerprint, "fp16")
        nodes = []
        for (cid, ids), kv in zip(chunks, kvs, strict=True):
            table.put_chunk(cid, ids, kv)
            with cache.acquire([cid], [len(ids)]) as lease:
                layers = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in kv]
                nodes += cache.insert(lease, [layers])
        tokens = sum(len(ids) for _, ids in chunks)

        def store_read() -> None:
            for cid, ids in chunks:
                for layer in range(layout.n_layers):
                    k, v = table.get_layer(cid, layer, expect_token_ids=ids)
                    torch.from_numpy(k), torch.from_numpy(v)  # fp16, as the loader takes them

        def memory_read() -> None:
            for node in nodes:
                cache.gather([node])

        def memory_read_layers() -> None:
            for node in nodes:
                for layer in range(layout.n_layers):
                    cache.gather_layer([node], layer)

        timings = {}
        for name, fn in (("store", store_read), ("memory", memory_read), ("memory_per_layer", memory_read_layers)):
            fn()  # warm: LMDB pages in the page cache, as in a long-lived process
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            timings[name] = statistics.median(times) / tokens
    return {"tokens": tokens, "chunks": n_chunks,
            "store_s_per_token": timings["store"], "memory_s_per_token": timings["memory"],
            "memory_per_layer_s_per_token": timings["memory_per_layer"],
            "saving_s_per_token": timings["store"] - timings["memory"]}


def render(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"workload: {w['n_requests']} questions ({w['warmup']} warm-up), k={w['k']}, Zipf s={w['zipf']} over "
        f"{w['distinct_chunks']} MuSiQue passages (order: {w['order']}, seed {w['seed']}, drift every "
        f"{w.get('drift_every') or 'never'}; statistics {w.get('statistics', '?')}); top 3% of passages "
        f"get {w['top3pct_share']:.0%} of requests; mean chunk {w['mean_chunk_tokens']:.0f} tokens, preamble "
        f"{w['preamble_tokens']}, suffix {w['mean_suffix_tokens']:.0f}; all passages = "
        f"{format_bytes(w['all_chunks_bytes'])} of KV",
        f"profile: T(0,600)={report['profile']['T(0,600)']:.3f}s  T(3000,600)={report['profile']['T(3000,600)']:.3f}s"
        f"  T(0,3000)={report['profile']['T(0,3000)']:.3f}s",
        f"TTFT = profile T(cached, new); wait+TTFT = with {w['queue_depth']} questions always queued; "
        f"reordered: window {w['reorder_window']}",
        "",
        f"{'host cache':>10} {'policy':6} | {'FIFO':^23} | {'reordered':^23}",
        f"{'':>10} {'':6} | {'hit':>6} {'TTFT s':>7} {'wait+':>8} | {'hit':>6} {'TTFT s':>7} {'wait+':>8}",
    ]
    by = {(r["host_bytes"], r["policy"], r["reorder"]): r for r in report["results"]}
    for size in dict.fromkeys(r["host_bytes"] for r in report["results"]):
        for policy in dict.fromkeys(r["policy"] for r in report["results"]):
            cells = [by[(size, policy, reorder)] for reorder in (False, True)]
            lines.append(f"{format_bytes(size):>10} {policy:6} | " + " | ".join(
                f"{c['prefix_hit_rate']:6.1%} {c['mean_ttft_s']:7.3f} {c['mean_latency_s']:8.1f}" for c in cells))
    if report["pgdsf_shortfalls"]:
        lines.append("\nPGDSF below another policy:")
        for s in report["pgdsf_shortfalls"]:
            lines.append(f"  {s['size']} reorder={s['reorder']}: {s['better']} hit {s['hit'][1]:.1%} vs "
                         f"{s['hit'][0]:.1%}, TTFT {s['ttft'][1]:.3f}s vs {s['ttft'][0]:.3f}s")
    if "load" in report:
        ld = report["load"]
        lines.append(f"\nload per chunk token: store hit {ld['store_s_per_token'] * 1e6:.2f} us, memory hit "
                     f"{ld['memory_s_per_token'] * 1e6:.2f} us (per layer {ld['memory_per_layer_s_per_token'] * 1e6:.2f}"
                     f" us): a memory hit saves {ld['saving_s_per_token'] * 1e6:.2f} us per token")
    return "\n".join(lines)
