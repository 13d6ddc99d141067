"""The question-time engine: chunk KV from memory or the store, a blended (or baseline) prefill,
then decoding. One engine serves many questions in a process; the preamble's KV is computed once.

With memory tiers (`cache`, a TieredKVCache), a blend or reuse prompt first walks the knowledge tree:
the chunks on its matched path are reused exactly (they join the preamble as an exact prefix, never
recomputed); below the first miss, each chunk's stored KV comes from memory when a tier holds it, else
from the store. After the answer, the chunks below the match are cached as they stood in this prompt,
and the chunks read from the store are kept in memory for the next question.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvrag import KvragError
from kvrag.blend import keyformer
from kvrag.blend.controller import LoadComputeProfile, cached_profile
from kvrag.blend.decode import ChunkedPrefill, DecodeCache, stop_ids
from kvrag.blend.fusion import BlendConfig, fused_prefill
from kvrag.blend.keyformer import AttentionScore, KeepConfig
from kvrag.blend.loader import ChunkRef, CorruptChunk, LayerLoader
from kvrag.blend.precompute import chunk_kv, layers_to_numpy
from kvrag.blend.prefill import LayerKV, extend
from kvrag.blend.runtime import Runtime
from kvrag.store.codec import CorruptValue, stored_positions
from kvrag.store.env import StoreEnv
from kvrag.store.kv import MissingChunk
from kvrag.store.manifest import check_or_record
from kvrag.store.remote import store_table
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import STORE

MODES = ("blend", "full", "prefix", "reuse")


@dataclass
class Prefilled:
    """A prompt ready to decode, with what it cost."""

    logits: torch.Tensor  # [V] at the last prompt position
    cache: DecodeCache
    prompt_tokens: int  # rows in the cache: the prompt's tokens, less a reduced chunk's dropped ones
    chunk_tokens: int  # chunk rows (kept tokens, for reduced chunks)
    recomputed_chunk_tokens: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds: prefill, load, load_wait, compute, ...
    bytes_loaded: int = 0
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)
    chunk_tiers: list[str] = field(default_factory=list)  # per chunk: "tree" (exact), "gpu"/"host", "store"
    attention: AttentionScore | None = None  # the question's Keyformer scores of the rows, when asked to observe

    @property
    def offset(self) -> int:
        """Prompt positions without a row in the cache (reduced chunks' dropped tokens): a new token's position is
        its row plus this."""
        return self.cache.offset


class FullPrefill:
    """A full prefill run a piece at a time (decode.ChunkedPrefill), so an engine can decode between the pieces."""

    def __init__(self, runtime: Runtime, chunks: Sequence[tuple[str, Sequence[int]]], suffix: list[int], extra: int,
                 start: float, tap: AttentionScore | None = None):
        chunk_ids = [i for _, ids in chunks for i in ids]
        self.chunk_tokens = len(chunk_ids)
        self.job = ChunkedPrefill(runtime.model, runtime.ids_tensor(runtime.prompts.preamble_ids + chunk_ids + suffix),
                                  extra, tap)
        self.start, self.compute_s = start, 0.0

    @property
    def remaining(self) -> int:
        return self.job.ids.shape[0] - self.job.cache.length

    def advance(self, tokens: int) -> Prefilled | None:
        """Run the next `tokens` positions; the Prefilled once the whole prompt has run, else None."""
        t0 = time.perf_counter()
        done = self.job.advance(tokens)
        self.compute_s += time.perf_counter() - t0
        if not done:
            return None
        timings = {"prefill": time.perf_counter() - self.start, "compute": self.compute_s}
        n = self.job.cache.length
        return Prefilled(self.job.logits, self.job.cache, n, self.chunk_tokens, self.chunk_tokens, timings,
                         attention=self.job.tap)


class Engine:
    def __init__(self, runtime: Runtime, env: StoreEnv | None, codec: str = "fp16", load_delay_s: float = 0.0,
                 cache=None, compress: bool = True, keep: KeepConfig | None = None):
        self.runtime = runtime
        # reduced chunks (Keyformer, `precompute --keep`): blend, reuse and prefix read that variant of the store
        self.keep = keep if keep is not None and keep.reduced else None
        if self.keep is not None and self.keep.per_layer:
            raise KvragError("questions read reduced chunks with one token set per chunk; a --keep-per-layer store "
                             "is for measurement only")
        self.cache = cache  # TieredKVCache or None: no memory tiers
        self._pending_cache: list = []  # (lease, rest chunks, per-layer rest KV, chunks not in memory, prefill s)
        self.model = runtime.model
        self.env = env
        self.table = None
        if env is not None:
            check_or_record(env, runtime.fingerprint, runtime.prompts.template.preamble, codec,
                            tokenizer_fp=runtime.local.tokenizer_fingerprint)
            # compress: how write-backs are stored
            self.table = store_table(env, runtime.fingerprint, codec, compress, self.keep.variant if self.keep else "")
        self.load_delay_s = load_delay_s
        with torch.inference_mode():
            _, self.preamble = extend(self.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
        # chunks computed on the fly, to store: (token ids, KV of the rows it holds, the kept tokens or None)
        self._write_back: dict[str, tuple[Sequence[int], LayerKV, np.ndarray | None]] = {}
        self._repair: set[str] = set()  # chunks whose stored values were damaged
        self.stop_ids = stop_ids(runtime.tokenizer)  # once: get_vocab() is slow, keep it out of TTFT
        self._profiles: dict[str, LoadComputeProfile] = {}  # by codec: what `--ratio auto` predicts costs from

    def profile(self, codec: str) -> LoadComputeProfile:
        """This machine's load/compute profile for the codec: from the store's meta (measured there once), kept
        here, so every prompt of an engine predicts from the same one (and none pays for measuring it again)."""
        if codec not in self._profiles:
            self._profiles[codec] = cached_profile(self.env, self.model, self.runtime.fingerprint, codec)
        return self._profiles[codec]

    # ---- chunks -------------------------------------------------------------------------------

    def chunk_refs(self, chunks: Sequence[tuple[str, Sequence[int]]],
                   in_memory: Sequence[LayerKV | None] = ()) -> tuple[list[ChunkRef], float]:
        """Refs for (chunk_id, token_ids); chunks missing from the store are computed now (and
        written back later). `in_memory[i]`: chunk i's stored KV already in a memory tier.
        Returns the refs and the seconds spent computing missing chunks."""
        missing = set(self.table.missing([c for c, _ in chunks])) if self.table is not None else {c for c, _ in chunks}
        start = time.perf_counter()
        refs = []
        for i, (chunk_id, ids) in enumerate(chunks):
            if i < len(in_memory) and in_memory[i] is not None:
                refs.append(ChunkRef(chunk_id, ids, in_memory[i]))
            elif chunk_id in missing or chunk_id in self._write_back:
                kv, kept = self._compute_chunk(chunk_id, ids)
                refs.append(ChunkRef(chunk_id, ids, kv, kept))
            else:
                refs.append(ChunkRef(chunk_id, ids, kept=self._stored_kept(chunk_id, ids)))
        return refs, time.perf_counter() - start

    def _compute_chunk(self, chunk_id: str, ids: Sequence[int]) -> tuple[LayerKV, np.ndarray | None]:
        """A chunk's KV computed now (reduced, when the engine reads reduced chunks) and the tokens it keeps."""
        if chunk_id in self._write_back:
            return self._write_back[chunk_id][1:]
        if self.keep is None:
            kv, kept = chunk_kv(self.runtime, self.preamble, ids), None
        else:
            full, kept = keyformer.reduce_chunk(self.model, self.preamble, self.runtime.ids_tensor(list(ids)),
                                                self.keep, chunk_id)
            kv = keyformer.narrow(full, kept)
        self._write_back[chunk_id] = (ids, kv, kept)
        return kv, kept

    def _stored_kept(self, chunk_id: str, ids: Sequence[int]) -> np.ndarray | None:
        """The tokens a stored reduced chunk keeps (from its first layer, read without decoding K and V); None
        for full chunks. A prompt's rows are laid out from them before any layer loads."""
        if self.keep is None:
            return None
        try:
            head, body = self.table.get_layer_raw(chunk_id, 0, expect_token_ids=ids).body()
        except (MissingChunk, CorruptValue) as exc:
            raise CorruptChunk(chunk_id, str(exc)) from None
        kept = stored_positions(head, body)
        if kept is not None and kept.ndim != 1:
            raise CorruptChunk(chunk_id, "keeps a token set per KV head, which questions cannot read")
        return kept

    def flush_write_back(self) -> int:
        """Store the chunks computed on the fly, replacing damaged ones (called between questions,
        never while a loader reads: LMDB cannot grow its map under an open read transaction)."""
        written = 0
        if self.table is not None:
            for chunk_id, (ids, kv, kept) in self._write_back.items():
                if chunk_id in self._repair:
                    self.table.delete_chunk(chunk_id)
                written += bool(self.table.put_chunk(chunk_id, ids, layers_to_numpy(kv, self.table.codec), kept))
        self._write_back.clear()
        self._repair.clear()
        self._fill_cache()
        return written

    # ---- memory tiers -------------------------------------------------------------------------

    def _exact_prefix(self, lease) -> LayerKV:
        """The preamble, followed by the chunks on the lease's matched path (their KV as it stood)."""
        if lease is None or not lease.matched:
            return self.preamble
        from kvrag.store.tiers.cache import as_layers

        layers = as_layers(self.cache.gather(lease.prefix, self.model.device))
        n_pre = len(self.preamble)
        n = layers[0][0].shape[0]
        return LayerKV([torch.cat([self.preamble.k[i].to(self.model.dtype), k.to(self.model.dtype)])
                        for i, (k, _) in enumerate(layers)],
                       [torch.cat([self.preamble.v[i].to(self.model.dtype), v.to(self.model.dtype)])
                        for i, (_, v) in enumerate(layers)],
                       torch.arange(n_pre + n, device=self.model.device))

    def _memory_kv(self, lease) -> list[LayerKV | None]:
        """Per chunk below the match: its stored KV from a memory tier, or None (read the store)."""
        from kvrag.store.tiers.cache import as_layers

        out: list[LayerKV | None] = []
        for i in range(lease.matched, len(lease.chunk_ids)):
            node = lease.memory_node(i)
            if node is None:
                out.append(None)
                continue
            layers = as_layers(self.cache.gather([node], self.model.device))
            out.append(LayerKV([k for k, _ in layers], [v for _, v in layers],
                               torch.arange(layers[0][0].shape[0])))  # positions unused: rotated on use
        return out

    def _fill_cache(self) -> None:
        """After an answer: cache the prompts' chunks as blended, keep the stored KV of the chunks that
        were not in memory (read from the store, or computed and now written back) for the next question,
        and unpin."""
        dtype = getattr(torch, self.cache.layout.dtype) if self._pending_cache else None
        for lease, rest, rest_kv, not_in_memory, prefill_s in self._pending_cache:
            try:
                per_chunk, start = [], 0
                for _, ids in rest:
                    n = len(ids)
                    per_chunk.append([(k[start:start + n].to("cpu", dtype), v[start:start + n].to("cpu", dtype))
                                      for k, v in rest_kv])
                    start += n
                self.cache.insert(lease, per_chunk, cost_s=prefill_s)
                self.cache.cost = CostProfile.linear(prefill_s / max(lease.new_tokens, 1))  # for put_stored
                for chunk_id, ids in not_in_memory:
                    stored = self._stored_layers(chunk_id, ids)
                    if stored is not None:
                        self.cache.put_stored(chunk_id, stored)
            finally:
                self.cache.release(lease)
        self._pending_cache.clear()

    def _stored_layers(self, chunk_id: str, ids: Sequence[int]):
        """Every layer of a chunk's stored KV as torch tensors in the cache's dtype, None if unreadable."""
        if self.table is None:
            return None
        try:
            layers = [self.table.get_layer(chunk_id, layer, expect_token_ids=ids)
                      for layer in range(self.model.cfg.n_layers)]
        except KvragError:
            return None  # damaged or gone: the next question reads (and repairs) it through the loader
        dtype = getattr(torch, self.cache.layout.dtype)
        return [(torch.from_numpy(d.k).to(dtype), torch.from_numpy(d.v).to(dtype)) for d in layers]

    # ---- prefill ------------------------------------------------------------------------------

    def prefill(self, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str = "blend",
                config: BlendConfig | None = None, extra: int = 64, observe: str | None = None) -> Prefilled:
        """Prefill preamble + chunks + suffix(question) by `mode`; retries once per corrupt chunk. observe (a rule:
        keyformer, h2o, window): score the rows by the question's attention (Prefilled.attention), for a
        decode-time budget."""
        if mode not in MODES:
            raise KvragError(f"--mode must be one of {', '.join(MODES)}, got {mode}")
        config = config or BlendConfig()
        suffix = self.runtime.prompts.build([], question).suffix
        for _ in range(len(chunks) + 1):
            try:
                with torch.inference_mode():
                    tap = self._observer(chunks, observe) if observe else None
                    return self._prefill_once(chunks, suffix, mode, config, extra, tap)
            except CorruptChunk as exc:
                # never use a damaged value: compute that chunk now and repair the store afterwards
                ids = dict(chunks)[exc.chunk_id]
                with torch.inference_mode():
                    self._compute_chunk(exc.chunk_id, ids)
                self._repair.add(exc.chunk_id)
        raise KvragError("could not prefill: the store keeps returning damaged values")

    def full_prefill(self, chunks: Sequence[tuple[str, Sequence[int]]], question: str, extra: int = 64,
                     observe: str | None = None) -> FullPrefill:
        """A full prefill of preamble + chunks + suffix(question) to run a piece at a time (`FullPrefill.advance`)."""
        suffix = self.runtime.prompts.build([], question).suffix
        tap = self._observer(chunks, observe) if observe else None
        return FullPrefill(self.runtime, chunks, suffix, extra, time.perf_counter(), tap)

    def _observer(self, chunks, rule: str) -> AttentionScore:
        """Scores of a prompt's rows by its question's (the suffix's) attention."""
        return AttentionScore(len(self.preamble) + sum(len(ids) for _, ids in chunks), self.model.device, rule=rule)

    def _prefill_once(self, chunks, suffix: list[int], mode: str, config: BlendConfig, extra: int,
                      tap: AttentionScore | None = None) -> Prefilled:
        start = time.perf_counter()
        if mode == "full":
            job = FullPrefill(self.runtime, chunks, suffix, extra, start, tap)
            return job.advance(job.remaining)

        lease = None
        if self.cache is not None and mode in ("blend", "reuse") and self.keep is None:  # tiers hold full chunks
            lease = self.cache.acquire([c for c, _ in chunks], [len(ids) for _, ids in chunks], len(suffix))
        try:
            return self._blend_after_prefix(chunks, suffix, mode, config, extra, lease, start, tap)
        except BaseException:
            if lease is not None:
                self.cache.release(lease)
            raise

    def _blend_after_prefix(self, chunks, suffix: list[int], mode: str, config: BlendConfig, extra: int, lease,
                            start: float, tap: AttentionScore | None = None) -> Prefilled:
        rt = self.runtime
        matched = lease.matched if lease is not None else 0
        exact = self._exact_prefix(lease)
        rest = list(chunks[matched:])
        memory = self._memory_kv(lease) if lease is not None else [None] * len(rest)
        refs, missing_s = self.chunk_refs(rest, memory)
        if mode == "blend" and config.ratio == 0:
            mode = "reuse"  # ratio 0 is full KV reuse, by definition
        if mode == "prefix":
            refs = refs[:1]
        layout = RowLayout.of(rest, refs, len(exact), suffix)
        n_chunk = layout.n_chunk
        loaded_rows, blend_cfg = (refs[0].n_rows if refs else 0, None) if mode == "prefix" else (
            n_chunk, config if mode == "blend" else None)
        exact_rows = self._exact_first_rows(refs, matched, blend_cfg)
        first_loaded_layer = min(config.selection_schedule()) if blend_cfg is not None and not exact_rows else 0
        layers = range(min(first_loaded_layer, self.model.cfg.n_layers), self.model.cfg.n_layers)
        loader = None
        if loaded_rows:
            # keys rotated to their places as they load (with Triton, by the fused load kernel), unless the memory
            # tiers keep this prompt's keys (before rotary) afterwards
            positions = None
            if lease is None:  # the loader's rows are the first loaded_rows chunk rows, right after the exact prefix
                positions = layout.positions[:loaded_rows]
            loader = LayerLoader(self.table, refs, layers, self.model.dtype, self.model.device,
                                 delay_s=self.load_delay_s, positions=positions, inv_freq=self.model.inv_freq,
                                 fused=self.model.triton).start()
        try:
            fused = fused_prefill(self.model, exact, rt.ids_tensor(layout.ids + suffix), n_chunk,
                                  loader, loaded_rows, blend_cfg, extra, keep_rest=lease is not None,
                                  exact_rows=exact_rows, chunk_starts=layout.starts.to(self.model.device),
                                  rest_positions=layout.positions, tap=tap)
        finally:
            if loader is not None:
                loader.close()
        elapsed = time.perf_counter() - start
        spans = fused.spans + (loader.spans if loader else [])
        load_s = loader.busy_s if loader else 0.0
        timings = {"prefill": elapsed, "compute": fused.compute_s, "load": load_s, "load_wait": fused.wait_s,
                   "compute_missing": missing_s}
        tiers = ["tree"] * matched + [lease.tiers[matched + i] if memory[i] is not None else ref_tier(ref)
                                      for i, ref in enumerate(refs)]
        if lease is not None:  # cached after the answer (flush_write_back), out of the TTFT
            not_in_memory = [(ref.chunk_id, ref.token_ids) for ref, kv in zip(refs, memory, strict=True) if kv is None]
            self._pending_cache.append((lease, rest, fused.rest_kv, not_in_memory, elapsed))
        return Prefilled(fused.logits, fused.cache, fused.cache.length,
                         n_chunk + sum(len(ids) for _, ids in chunks[:matched]),
                         int(fused.selected.numel()), timings, loader.bytes_read if loader else 0, spans, tiers, tap)

    def _exact_first_rows(self, refs: list[ChunkRef], matched: int, config: BlendConfig | None) -> int:
        """How many leading chunk rows a blend reuses exactly (see fusion's module doc): the first chunk's, when it
        follows the preamble itself (nothing matched in the knowledge tree), its KV is the one computed right
        after the preamble (from the store, a memory tier's copy of it, or computed now) in a 16-bit codec
        (int8's rounding is the kind of error the selection should see), and the ratio leaves rows to rank
        (at 1 every chunk token is recomputed, as a full prefill)."""
        if config is None or not config.exact_first_chunk or matched or not refs or not 0 < config.ratio < 1:
            return 0
        return refs[0].n_rows if self.table is None or self.table.codec in ("fp16", "bf16") else 0


def ref_tier(ref: ChunkRef) -> str:
    """Where a chunk's KV came from when no memory tier had it: the store, or computed now."""
    return STORE if ref.in_memory is None else "computed"


@dataclass
class RowLayout:
    """The rows after the exact prefix: each chunk's tokens (the kept ones of a reduced chunk) at their positions
    in the whole prompt, the dropped tokens' places left as gaps, then the suffix's."""

    ids: list[int]  # [C] the chunk rows' token ids
    positions: torch.Tensor  # [C + S] absolute positions of the chunk rows, then of the suffix's
    starts: torch.Tensor  # [K] where each chunk's rows begin among the chunk rows

    @property
    def n_chunk(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, chunks: Sequence[tuple[str, Sequence[int]]], refs: Sequence[ChunkRef], start: int,
           suffix: Sequence[int]) -> RowLayout:
        """Chunks after `start` prefix positions; chunk i keeps refs[i].kept where it has a ref (prefix caching
        loads the first chunk alone: the others are computed, every token)."""
        ids, positions, starts, at = [], [], [], start
        for i, (_, chunk) in enumerate(chunks):
            kept = refs[i].kept if i < len(refs) else None
            rows = range(len(chunk)) if kept is None else kept.tolist()
            starts.append(len(ids))
            ids.extend(chunk[j] for j in rows)
            positions.extend(at + j for j in rows)
            at += len(chunk)
        positions.extend(range(at, at + len(suffix)))
        return cls(ids, torch.tensor(positions, dtype=torch.long), torch.tensor(starts, dtype=torch.long))
