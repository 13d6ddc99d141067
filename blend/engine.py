"""The question-time engine: chunk KV from memory or the store, a blended (or baseline) prefill,
then decoding. One engine serves many questions in a process; the preamble's KV is computed once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrag import KvragError
from kvrag.blend.decode import DecodeCache, prefill, stop_ids
from kvrag.blend.fusion import BlendConfig, fused_prefill
from kvrag.blend.loader import ChunkRef, CorruptChunk, LayerLoader
from kvrag.blend.precompute import chunk_kv, layers_to_numpy
from kvrag.blend.prefill import LayerKV, extend
from kvrag.blend.runtime import Runtime
from kvrag.store.env import StoreEnv
from kvrag.store.kv import KVTable
from kvrag.store.manifest import check_or_record

MODES = ("blend", "full", "prefix", "reuse")


@dataclass
class Prefilled:
    """A prompt ready to decode, with what it cost."""

    logits: torch.Tensor  # [V] at the last prompt position
    cache: DecodeCache
    prompt_tokens: int
    chunk_tokens: int
    recomputed_chunk_tokens: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds: prefill, load, load_wait, compute, ...
    bytes_loaded: int = 0
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)


class Engine:
    def __init__(self, runtime: Runtime, env: StoreEnv | None, codec: str = "fp16", load_delay_s: float = 0.0):
        self.runtime = runtime
        self.model = runtime.model
        self.env = env
        self.table = None
        if env is not None:
            check_or_record(env, runtime.fingerprint, runtime.prompts.template.preamble, codec,
                            tokenizer_fp=runtime.local.tokenizer_fingerprint)
            self.table = KVTable(env, runtime.fingerprint, codec)
        self.load_delay_s = load_delay_s
        with torch.inference_mode():
            _, self.preamble = extend(self.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
        self._write_back: dict[str, tuple[Sequence[int], LayerKV]] = {}
        self._repair: set[str] = set()  # chunks whose stored values were damaged
        self.stop_ids = stop_ids(runtime.tokenizer)  # once: get_vocab() is slow, keep it out of TTFT

    # ---- chunks -------------------------------------------------------------------------------

    def chunk_refs(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> tuple[list[ChunkRef], float]:
        """Refs for (chunk_id, token_ids); chunks missing from the store are computed now (and
        written back later). Returns the refs and the seconds spent computing missing chunks."""
        missing = set(self.table.missing([c for c, _ in chunks])) if self.table is not None else {c for c, _ in chunks}
        start = time.perf_counter()
        refs = []
        for chunk_id, ids in chunks:
            if chunk_id in missing or chunk_id in self._write_back:
                kv = self._compute_chunk(chunk_id, ids)
                refs.append(ChunkRef(chunk_id, ids, kv))
            else:
                refs.append(ChunkRef(chunk_id, ids))
        return refs, time.perf_counter() - start

    def _compute_chunk(self, chunk_id: str, ids: Sequence[int]) -> LayerKV:
        if chunk_id in self._write_back:
            return self._write_back[chunk_id][1]
        kv = chunk_kv(self.runtime, self.preamble, ids)
        self._write_back[chunk_id] = (ids, kv)
        return kv

    def flush_write_back(self) -> int:
        """Store the chunks computed on the fly, replacing damaged ones (called between questions,
        never while a loader reads: LMDB cannot grow its map under an open read transaction)."""
        written = 0
        if self.table is not None:
            for chunk_id, (ids, kv) in self._write_back.items():
                if chunk_id in self._repair:
                    self.table.delete_chunk(chunk_id)
                written += bool(self.table.put_chunk(chunk_id, ids, layers_to_numpy(kv, self.table.codec)))
        self._write_back.clear()
        self._repair.clear()
        return written

    # ---- prefill ------------------------------------------------------------------------------

    def prefill(self, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str = "blend",
                config: BlendConfig | None = None, extra: int = 64) -> Prefilled:
        """Prefill preamble + chunks + suffix(question) by `mode`; retries once per corrupt chunk."""
        if mode not in MODES:
            raise KvragError(f"--mode must be one of {', '.join(MODES)}, got {mode}")
        config = config or BlendConfig()
        suffix = self.runtime.prompts.build([], question).suffix
        for _ in range(len(chunks) + 1):
            try:
                with torch.inference_mode():
                    return self._prefill_once(chunks, suffix, mode, config, extra)
            except CorruptChunk as exc:
                # never use a damaged value: compute that chunk now and repair the store afterwards
                ids = dict(chunks)[exc.chunk_id]
                with torch.inference_mode():
                    self._compute_chunk(exc.chunk_id, ids)
                self._repair.add(exc.chunk_id)
        raise KvragError("could not prefill: the store keeps returning damaged values")

    def _prefill_once(self, chunks, suffix: list[int], mode: str, config: BlendConfig, extra: int) -> Prefilled:
        start = time.perf_counter()
        chunk_ids = [i for _, ids in chunks for i in ids]
        n_chunk = len(chunk_ids)
        rt = self.runtime
        if mode == "full":
            ids = rt.prompts.preamble_ids + chunk_ids + suffix
            logits, cache = prefill(self.model, rt.ids_tensor(ids), extra)
            elapsed = time.perf_counter() - start
            return Prefilled(logits, cache, len(ids), n_chunk, n_chunk, {"prefill": elapsed, "compute": elapsed})

        refs, missing_s = self.chunk_refs(chunks)
        if mode == "blend" and config.ratio == 0:
            mode = "reuse"  # ratio 0 is full KV reuse, by definition
        if mode == "prefix":
            refs, loaded_rows, blend_cfg = refs[:1], len(chunks[0][1]) if chunks else 0, None
        elif mode == "reuse":
            loaded_rows, blend_cfg = n_chunk, None
        else:
            loaded_rows, blend_cfg = n_chunk, config
        first_loaded_layer = min(config.selection_schedule()) if blend_cfg is not None else 0
        layers = range(min(first_loaded_layer, self.model.cfg.n_layers), self.model.cfg.n_layers)
        loader = None
        if loaded_rows:
            loader = LayerLoader(self.table, refs, layers, self.model.dtype, self.model.device,
                                 delay_s=self.load_delay_s).start()
        try:
            fused = fused_prefill(self.model, self.preamble, rt.ids_tensor(chunk_ids + suffix), n_chunk,
                                  loader, loaded_rows, blend_cfg, extra)
        finally:
            if loader is not None:
                loader.close()
        elapsed = time.perf_counter() - start
        spans = fused.spans + (loader.spans if loader else [])
        load_s = sum(e - s for kind, _, s, e in spans if kind == "load")
        timings = {"prefill": elapsed, "compute": fused.compute_s, "load": load_s, "load_wait": fused.wait_s,
                   "missing_chunks": missing_s}
        return Prefilled(fused.logits, fused.cache, len(rt.prompts.preamble_ids) + n_chunk + len(suffix), n_chunk,
                         int(fused.selected.numel()), timings, loader.bytes_read if loader else 0, spans)
