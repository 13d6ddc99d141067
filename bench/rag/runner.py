"""Run every method on every item in one process: setup, warm-up, then methods interleaved per item.

    setup     every item's chunks get their KV into the store first, so no timed run pays for computing a chunk
    warm-up   each method once on a short prompt (the first item's first two chunks, a few tokens),
              not recorded: first calls allocate, compile and fault pages in
    runs      per item, the methods in a seeded random order, so drift on a busy machine (other jobs,
              thermal limits) spreads over all methods instead of favouring the one that runs first
    fidelity  per item, each method's first-token logits and answer against full prefill's
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvrag.bench.rag.items import BenchItem
from kvrag.bench.rag.methods import Method
from kvrag.bench.rag.metrics import best_em, best_f1, f1_score, kl_divergence, top1_agrees
from kvrag.blend.config import ATTENTION_WEIGHT, DEFAULT_RATIO, DEFAULT_SELECTION, BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.engine.llm_engine import EngineConfig, LLMEngine
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.sequence import Request
from kvrag.errors import KvragError
from kvrag.model.sampling import SamplingConfig
from kvrag.store.keys import codec_id

Progress = Callable[[str, str, int, int], None]  # (phase, label, done, total)
WARMUP_CHUNKS = 2
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class RunConfig:
    max_tokens: int = 32  # greedy answer length (issue 5: identical 32-token answers)
    seed: int = 0  # the interleaving order
    warmup: bool = True
    codec: str = "fp16"  # which stored KV the loaded methods read
    check_layer: int | None = None  # the rule's own (BlendConfig.check_at)
    deviation: str = "v"
    gradual: bool = True
    # read each item's stored KV once before its runs, so every loaded method finds it in the page cache
    # (as a host-memory hit would); otherwise the first loaded method of an item pays the cold disk read
    warm_store: bool = True
    attention_weight: float = ATTENTION_WEIGHT
    chunk_start_rows: int = 0  # see BlendConfig
    deviation_mass: float = 0.0
    selection: str = DEFAULT_SELECTION  # see BlendConfig
    # what `auto` runs for this model, as `kvrag ask` and `serve` run it: its check's rule and the ratio it starts from
    # (engine/model_check.py's stored verdict; None: the run's selection and r*)
    auto_rule: str | None = None
    auto_floor: float = DEFAULT_RATIO

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise KvragError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        codec_id(self.codec)  # a one-line error for an unknown codec
        self.blend_config(None)  # validates the rest

    def blend_config(self, method: Method | None) -> BlendConfig:
        blended = method is not None and method.mode == "blend" and not method.auto
        ratio = method.ratio if blended else 0.15  # auto: resolved later
        return BlendConfig(ratio, self.check_layer, self.deviation, self.gradual, self.attention_weight,
                           chunk_start_rows=self.chunk_start_rows, deviation_mass=self.deviation_mass,
                           selection=(method.selection if method is not None else None)
                           or (self.auto_rule if method is not None and method.auto else None) or self.selection)


@dataclass
class MethodRun:
    """One method on one item: what it cost and what it answered."""

    item: int  # index into BenchRun.items
    method: str
    position: int  # 0-based place in this item's interleaved order
    ratio: float | None  # the recompute share used (auto: as resolved); None outside blend
    ttft_s: float
    prefill_s: float
    compute_s: float
    load_s: float  # loader busy time (overlaps compute)
    load_wait_s: float  # time compute stood waiting for the loader
    missing_chunks_s: float  # chunks computed on the fly (0 after setup)
    decode_s: float
    total_s: float  # the whole request: prefill, decode, write-back
    decode_tokens_per_s: float
    prompt_tokens: int
    chunk_tokens: int
    recomputed_chunk_tokens: int
    bytes_loaded: int
    answer: str
    token_ids: list[int]
    f1: float | None = None  # against the gold answers (None without gold)
    em: float | None = None
    # fidelity to full prefill on the same item (None when full prefill was not run)
    top1_agree: bool | None = None
    kl: float | None = None
    identical: bool | None = None
    f1_vs_full: float | None = None
    ttft_ratio_to_full: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Setup:
    precompute_s: float = 0.0
    chunks: int = 0  # distinct chunks over the items
    chunks_computed: int = 0  # of which were not in the store yet
    missing_after: int = 0  # chunks still not in the store after setup (0 unless writing failed)
    warmup_s: float = 0.0
    item_store_reads_s: list[float] = field(default_factory=list)  # per item: reading its stored KV (warm_store)


@dataclass
class BenchRun:
    methods: list[Method]
    items: list[BenchItem]
    runs: list[MethodRun] = field(default_factory=list)
    setup: Setup = field(default_factory=Setup)
    wall_s: float = 0.0
    from_records: int = 0  # items taken from a resumed sweep's records, not run in this process

    def by_method(self, name: str) -> list[MethodRun]:
        return [r for r in self.runs if r.method == name]


def prepare(engine: Prefiller, items: list[BenchItem], methods: list[Method], config: RunConfig,
            on_progress: Progress | None = None) -> Setup:
    """Store every item's chunk KV (one pass, nothing timed), as `kvrag precompute` would: the dense model's."""
    setup = Setup(chunks=len({cid for item in items for cid, _ in item.chunks}))
    start = time.perf_counter()
    for n, item in enumerate(items):
        if on_progress:
            on_progress("setup", f"chunk KV of item {n + 1}/{len(items)}", n, len(items))
        setup.chunks_computed += engine.store_chunks(item.chunks)
    setup.precompute_s = time.perf_counter() - start
    if engine.source.table is not None:
        setup.missing_after = len(engine.source.table.missing(sorted({cid for item in items for cid, _ in item.chunks})))
    if on_progress:
        on_progress("setup", "chunk KV stored", len(items), len(items))
    return setup


def run_one(llm: LLMEngine, item: BenchItem, method: Method, config: RunConfig, chunks=None,
            max_tokens: int | None = None):
    """(answer, first-token logits [V] as float32 on the CPU, seconds for the whole request), through the
    resident engine as `kvrag ask` and the API run a question, alone in it."""
    sampling = SamplingConfig(max_tokens=max_tokens or config.max_tokens)
    request = Request(item.question, tuple((c, tuple(ids)) for c, ids in chunks or item.chunks), method.mode,
                      config.blend_config(method), RatioPolicy(None if method.auto else method.ratio), sampling, keep_first_logits=True)
    start = time.perf_counter()
    seq = llm.add(request)
    while not seq.is_finished:
        llm.step()
    total = time.perf_counter() - start
    if seq.finish_reason == "error":
        raise KvragError(seq.error or "the request failed")
    return seq.answer(llm.prefiller.runtime.tokenizer), seq.first_logits.detach().float().cpu().clone(), total


def run_bench(engine: Prefiller, items: list[BenchItem], methods: list[Method], config: RunConfig,
              on_progress: Progress | None = None) -> BenchRun:
    if not items:
        raise KvragError("no items to run")
    start = time.perf_counter()
    bench = BenchRun(methods, items)
    bench.setup = prepare(engine, items, methods, config, on_progress)
    llm = LLMEngine(engine, EngineConfig(codec=config.codec, ratio=config.auto_floor))
    if config.warmup:
        t0 = time.perf_counter()
        short = items[0].chunks[:WARMUP_CHUNKS]
        for n, method in enumerate(methods):
            if on_progress:
                on_progress("warmup", method.name, n, len(methods))
            run_one(llm, items[0], method, config, short, min(WARMUP_TOKENS, config.max_tokens))
        if on_progress:
            on_progress("warmup", "done", len(methods), len(methods))
        bench.setup.warmup_s = time.perf_counter() - t0
    rng = random.Random(config.seed)
    total = len(items) * len(methods)
    for i, item in enumerate(items):
        order = list(methods)
        rng.shuffle(order)
        if config.warm_store and engine.source.table is not None:
            bench.setup.item_store_reads_s.append(read_stored_kv(engine, item))
        logits: dict[str, torch.Tensor] = {}
        runs: dict[str, MethodRun] = {}
        for pos, method in enumerate(order):
            if on_progress:
                on_progress("run", f"{method.name} · item {i + 1}/{len(items)}", len(bench.runs), total)
            answer, logits[method.name], total_s = run_one(llm, item, method, config)
            runs[method.name] = _record(i, method, pos, answer, total_s, item.answers)
            bench.runs.append(runs[method.name])
        _fidelity(runs, logits)
    if on_progress:
        on_progress("run", "done", total, total)
    bench.wall_s = time.perf_counter() - start
    return bench


def read_stored_kv(engine: Prefiller, item: BenchItem) -> float:
    """Read every layer of the item's stored chunks (unchecked, undecoded: only to page them in); seconds."""
    start = time.perf_counter()
    for chunk_id, _ in item.chunks:
        for layer in range(engine.model.cfg.n_layers):
            try:
                engine.source.table.get_layer_raw(chunk_id, layer)
            except KvragError:  # missing or damaged: the timed run deals with it
                break
    return time.perf_counter() - start


def _record(i: int, method: Method, pos: int, answer, total_s: float, golds: list[str]) -> MethodRun:
    t = answer.timings
    return MethodRun(
        item=i, method=method.name, position=pos, ratio=answer.ratio,
        ttft_s=t["ttft"], prefill_s=t.get("prefill", 0.0), compute_s=t.get("compute", 0.0),
        load_s=t.get("load", 0.0), load_wait_s=t.get("load_wait", 0.0),
        missing_chunks_s=t.get("compute_missing", 0.0), decode_s=t.get("decode", 0.0), total_s=total_s,
        decode_tokens_per_s=t.get("decode_tokens_per_s", 0.0), prompt_tokens=answer.prompt_tokens,
        chunk_tokens=answer.chunk_tokens, recomputed_chunk_tokens=answer.recomputed_chunk_tokens,
        bytes_loaded=answer.bytes_loaded, answer=answer.text, token_ids=list(answer.token_ids),
        f1=best_f1(answer.text, golds), em=best_em(answer.text, golds),
    )


def _fidelity(runs: dict[str, MethodRun], logits: dict[str, torch.Tensor]) -> None:
    """Each method against full prefill on the same item (full against itself is the identity)."""
    full = runs.get("full")
    if full is None:
        return
    for name, run in runs.items():
        run.top1_agree = top1_agrees(logits["full"], logits[name])
        run.kl = kl_divergence(logits["full"], logits[name])
        run.identical = run.token_ids == full.token_ids
        run.f1_vs_full = f1_score(run.answer, full.answer)
        run.ttft_ratio_to_full = run.ttft_s / full.ttft_s if full.ttft_s > 0 else None
