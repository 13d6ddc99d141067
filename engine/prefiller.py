"""The prefiller: one prompt's prefill by mode (Mode) over chunk KV from a ChunkSource (engine/chunk_source.py).

One Prefiller serves many questions in a process, and the resident engine (engine/llm_engine.py) many requests; the
preamble's KV is computed once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvrag.blend.config import CHECK_LAYER, BlendConfig
from kvrag.blend.fusion import fused_prefill
from kvrag.blend.preview import preview
from kvrag.blend.selection import PREVIEW_RULES
from kvrag.config import MODES
from kvrag.engine.chunk_source import ChunkSource
from kvrag.engine.kv_budget import AttentionScore, parse_rule
from kvrag.engine.prompt_reuse import Piece
from kvrag.errors import KvragError
from kvrag.load.layer_work import ChunkRef, CorruptChunk, DecoderPause
from kvrag.load.loader import open_loader
from kvrag.load.staging import StagingArea, spare_cores
from kvrag.model.cache import DecodeCache
from kvrag.model.prefill import ChunkedPrefill, LayerKV, extend
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import stop_ids
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.lead_in import LeadIn
from kvrag.store.env import StoreEnv
from kvrag.store.open import RemoteOptions
from kvrag.store.tiers.knowledge_tree import STORE

# how a prompt is prefilled: blended (CacheBlend), in full, the first chunk reused as a prefix (prefix caching), or
# every chunk's KV reused as loaded (ratio 0)


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


@dataclass(frozen=True)
class Framing:
    """A prompt's tokens around its chunks where they are not the single-turn preamble and suffix (a conversation,
    engine/conversations.py): the head's ids and KV, and the tail's ids. A blend's head KV covers every head id; a
    full prefill's may hold only the leading rows it found cached, and computes the rest in its one pass."""

    head_ids: list[int]
    head: LayerKV
    tail: list[int]
    # a plain prompt's pieces (engine/prompt_reuse.py), one per chunk: stored rows, or prompt text computed at
    # every layer; None: every chunk is a whole stored chunk
    pieces: tuple[Piece, ...] | None = None
    # the head's leading rows computed as a full prefill would (no blended row among or before them)
    exact_rows: int = 0


class FullPrefill:
    """A full prefill run a piece at a time (model/prefill.ChunkedPrefill), so an engine can decode between the
    pieces."""

    def __init__(self, runtime: Runtime, chunks: Sequence[tuple[str, Sequence[int]]], suffix: list[int], extra: int,
                 start: float, tap: AttentionScore | None = None, framing: Framing | None = None):
        chunk_ids = [i for _, ids in chunks for i in ids]
        self.chunk_tokens = len(chunk_ids)
        head_ids = runtime.prompts.preamble_ids if framing is None else framing.head_ids
        # a framing's head KV (exact rows, a prefix of its ids) is where the one pass starts
        self.job = ChunkedPrefill(runtime.model, runtime.ids_tensor(head_ids + chunk_ids + suffix), extra, tap,
                                  None if framing is None else framing.head)
        self.start, self.compute_s = start, 0.0

    def advance(self, tokens: int) -> Prefilled | None:
        """Run the next `tokens` positions; the Prefilled once the whole prompt has run, else None."""
        t0 = time.perf_counter()
        done = self.job.advance(tokens)
        self.compute_s += time.perf_counter() - t0
        if not done:
            return None
        timings = {"prefill": time.perf_counter() - self.start, "compute": self.compute_s}
        return Prefilled(self.job.logits, self.job.cache, self.job.cache.length, self.chunk_tokens, self.chunk_tokens, timings,
                         attention=self.job.tap)


class Prefiller:
    """Prefills prompts of `runtime`'s model over `source`'s chunk KV (None: a source without a store or tiers,
    which computes every chunk)."""

    def __init__(self, runtime: Runtime, source: ChunkSource | None = None, preamble: LayerKV | None = None):
        self.runtime, self.model = runtime, runtime.model
        self.preamble = preamble if preamble is not None else preamble_kv(runtime)
        self.source = source if source is not None else ChunkSource(runtime, None, self.preamble)
        self.decoder_pause = DecoderPause()  # this prefiller's loaders' idle decoder, off for a while once starved
        # the staged loader's host slots (pinned on a GPU) and threads, for this prefiller's life
        device = self.model.device.type
        self.staging = StagingArea(pinned=device == "cuda", threads=spare_cores(device))
        self.stop_ids = stop_ids(runtime.tokenizer)  # once: get_vocab() is slow, keep it out of TTFT
        self.store_settings: tuple | None = None  # open()'s store, codec, compress, keep, remote, lead-in
        self._storing: Prefiller | None = None  # storing()'s dense twin, once made

    @classmethod
    def open(cls, runtime: Runtime, env: StoreEnv | None, codec: str = "fp16", cache=None, compress: bool = True,
             keep: KeepConfig | None = None, remote: RemoteOptions | None = None,
             lead_in: LeadIn | None = None) -> Prefiller:
        """A prefiller over the store `env` (None: none), through a chunk source of these settings."""
        preamble = preamble_kv(runtime)
        source = ChunkSource(runtime, env, preamble, codec, cache, compress, keep, remote, lead_in)
        prefiller = cls(runtime, source, preamble)
        prefiller.store_settings = (env, codec, compress, keep, remote, source.lead_in)
        return prefiller

    def storing(self) -> Prefiller:
        """What stores the chunk KV this prefiller reads: itself where its model is dense, else (once) the same model
        with dense weights over the same store and settings, as `kvrag precompute` stores a dense model's KV whatever
        form questions decode with (ChunkSource stores nothing an int8 or int4 model computes)."""
        if self.source.stores or self.store_settings is None:
            return self
        if self._storing is None:
            env, codec, compress, keep, remote, lead_in = self.store_settings
            self._storing = Prefiller.open(self.runtime.with_weights("dense"), env, codec, None, compress, keep,
                                           remote, lead_in)
        return self._storing

    def store_chunks(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Store one prompt's chunks (in its order) as `kvrag precompute` would, through storing(): the first in the
        form a prompt reads it in. Returns how many were written (none without a store: the chunks computed here are
        then dropped)."""
        storer = self.storing()
        with torch.inference_mode():  # computes the missing ones and keeps them for the write-back below
            storer.source.chunk_refs(chunks, start=len(storer.preamble))
        return storer.flush_write_back()

    def release_storing(self) -> None:
        """Drop storing()'s dense twin (its memory) until it is needed again."""
        self._storing = None

    def flush_write_back(self) -> int:
        """Between questions: store the chunks computed on the fly and fill the memory tiers (ChunkSource)."""
        return self.source.flush_write_back()

    def prefill(self, chunks: Sequence[tuple[str, Sequence[int]]], question: str, mode: str = "blend",
                config: BlendConfig | None = None, extra: int = 64, observe: str | None = None,
                framing: Framing | None = None, store: bool = True) -> Prefilled:
        """Prefill preamble + chunks + suffix(question) by `mode` (with `framing`: its head + chunks + its tail);
        retries once per corrupt chunk. observe (a rule: keyformer, h2o, window): score the rows by the question's
        attention (Prefilled.attention), for a decode-time budget. `store` False: chunks the store lacks are computed
        for this prompt alone, never written back (a request's own passages)."""
        if mode not in MODES:
            raise KvragError(f"--mode must be one of {', '.join(MODES)}, got {mode}")
        config = config or BlendConfig()
        suffix = self.runtime.prompts.build([], question).suffix if framing is None else framing.tail
        for _ in range(len(chunks) + 1):
            try:
                with torch.inference_mode():
                    tap = self._observer(chunks, observe, framing) if observe else None
                    return self._prefill_once(chunks, suffix, mode, config, extra, tap, framing, store)
            except CorruptChunk as exc:
                # never use a damaged value: compute that chunk now and repair the store afterwards
                ids = dict(chunks)[exc.chunk_id]
                with torch.inference_mode():
                    self.source.repair(exc.chunk_id, ids)
        raise KvragError("could not prefill: the store keeps returning damaged values")

    def full_prefill(self, chunks: Sequence[tuple[str, Sequence[int]]], question: str, extra: int = 64,
                     observe: str | None = None, framing: Framing | None = None) -> FullPrefill:
        """A full prefill of preamble + chunks + suffix(question) (with `framing`: its head + chunks + its tail) to run
        a piece at a time (`FullPrefill.advance`)."""
        suffix = self.runtime.prompts.build([], question).suffix if framing is None else framing.tail
        tap = self._observer(chunks, observe, framing) if observe else None
        return FullPrefill(self.runtime, chunks, suffix, extra, time.perf_counter(), tap, framing)

    def _observer(self, chunks, spec: str, framing: Framing | None) -> AttentionScore:
        """Scores of a prompt's rows by the attention of its question (the suffix), or of every query the prefill
        computes past the head (a rule's `prompt`)."""
        rule = parse_rule(spec)
        head = len(self.preamble) if framing is None else len(framing.head_ids)
        start = head if rule.observe == "prompt" else head + sum(len(ids) for _, ids in chunks)
        cfg = self.model.cfg
        return AttentionScore(rule, cfg.n_layers, cfg.n_kv_heads, start, self.model.device)

    def _prefill_once(self, chunks, suffix: list[int], mode: str, config: BlendConfig, extra: int,
                      tap: AttentionScore | None = None, framing: Framing | None = None, store: bool = True) -> Prefilled:
        start = time.perf_counter()
        if mode == "full":
            job = FullPrefill(self.runtime, chunks, suffix, extra, start, tap, framing)
            return job.advance(job.job.ids.shape[0])  # the whole prompt in one piece
        if not chunks:  # nothing to load or blend (plain chat, or a follow-up over passages already in its context)
            mode = "reuse"
        # the memory tiers' knowledge tree is rooted at the preamble: a conversation's head reads the store alone;
        # its paths hold chunk rows as earlier blends left them, which a blend at ratio 1 (exact) must not read
        tiers = mode in ("blend", "reuse") and framing is None and not (mode == "blend" and config.ratio >= 1.0)
        lease = self.source.acquire(chunks, len(suffix)) if tiers else None
        try:
            return self._blend_after_prefix(chunks, suffix, mode, config, extra, lease, start, tap, framing, store)
        except BaseException:
            self.source.release(lease)
            raise

    def _blend_after_prefix(self, chunks, suffix: list[int], mode: str, config: BlendConfig, extra: int, lease,
                            start: float, tap: AttentionScore | None = None,
                            framing: Framing | None = None, store: bool = True) -> Prefilled:
        matched = lease.matched if lease is not None else 0
        source = self.source
        exact = source.exact_prefix(lease) if framing is None else framing.head
        rest = list(chunks[matched:])
        memory = source.memory_kv(lease) if lease is not None else [None] * len(rest)
        forced, piece_tiers = None, None
        if framing is not None and framing.pieces is not None:
            t0 = time.perf_counter()
            refs, piece_tiers = source.piece_refs(rest, framing.pieces, start=len(exact))
            missing_s = time.perf_counter() - t0
            forced = _prompt_rows(rest, framing.pieces).to(self.model.device)
            if mode == "reuse" or config.ratio == 0:  # the prompt's own text is computed all the same
                mode, config = "blend", replace(config, ratio=0.0, deviation_mass=0.0)
        else:
            refs, missing_s = source.chunk_refs(rest, memory, start=len(exact), store=store)
        if mode == "blend" and config.ratio == 0 and forced is None:
            mode = "reuse"  # ratio 0 is full KV reuse, by definition
        if mode == "prefix":
            refs = refs[:1]
        layout = RowLayout.of(rest, refs, len(exact), suffix)
        n_chunk = layout.n_chunk
        loaded_rows, blend_cfg = (refs[0].n_rows if refs else 0, None) if mode == "prefix" else (
            n_chunk, config if mode == "blend" else None)
        exact_rows = self._exact_first_rows(refs, matched, blend_cfg) if framing is None else 0
        previewed, blend_cfg = _previewed(blend_cfg, loaded_rows, forced)
        first_loaded_layer = min(blend_cfg.selection_schedule()) if blend_cfg is not None and not exact_rows \
            and not previewed else 0
        layers = range(min(first_loaded_layer, self.model.cfg.n_layers), self.model.cfg.n_layers)
        loader = self._loader(refs, layers, layout.positions[:loaded_rows], rotate=lease is None) \
            if loaded_rows else None
        try:
            rest_ids, chunk_kv, prior = self.runtime.ids_tensor(layout.ids + suffix), loader, None
            if previewed:
                prior, chunk_kv = preview(self.model, exact, rest_ids, n_chunk, loader, layout.positions,
                                          blend_cfg.preview_layers)
            fused = fused_prefill(self.model, exact, rest_ids, n_chunk,
                                  chunk_kv, loaded_rows, blend_cfg, extra, keep_rest=lease is not None,
                                  exact_rows=exact_rows, chunk_starts=layout.starts.to(self.model.device),
                                  rest_positions=layout.positions, tap=tap, forced=forced, prior=prior)
        finally:
            if loader is not None:
                loader.close()
        elapsed = time.perf_counter() - start
        spans = fused.spans + (loader.spans if loader else [])
        timings = {"prefill": elapsed, "compute": fused.compute_s, "load": loader.busy_s if loader else 0.0,
                   "load_wait": fused.wait_s, "compute_missing": missing_s}
        tiers = piece_tiers if piece_tiers is not None else \
            ["tree"] * matched + [_tier(ref, memory[i], lease.tiers[matched + i] if lease else None)
                                  for i, ref in enumerate(refs)]
        if lease is not None:  # cached after the answer (flush_write_back), out of the TTFT
            not_in_memory = [(ref.chunk_id, ref.token_ids) for ref, kv in zip(refs, memory, strict=True) if kv is None]
            source.keep_for_later(lease, rest, fused.rest_kv, not_in_memory, elapsed)
        return Prefilled(fused.logits, fused.cache, fused.cache.length,
                         n_chunk + sum(len(ids) for _, ids in chunks[:matched]),
                         int(fused.selected.numel()), timings, loader.bytes_read if loader else 0, spans, tiers, tap)

    def _loader(self, refs: list[ChunkRef], layers: range, positions: torch.Tensor, rotate: bool):
        """A started loader of `layers` of the chunks `refs`, whose rows sit at `positions` [R]: keys rotated to their
        places as they load (with Triton, by the fused load kernel) when `rotate` (not when the memory tiers keep
        this prompt's keys before rotary afterwards) and the rotary is one the loader's inv_freq rotation covers (a
        scaled or partial one, yarn or Phi-3's, the blend applies itself)."""
        rotated = positions if rotate and self.model.cfg.plain_rotary else None
        return open_loader(self.source.table, refs, layers, self.model.dtype, self.model.device, area=self.staging,
                           positions=rotated, inv_freq=self.model.inv_freq, fused=self.model.triton, pause=self.decoder_pause, native=self.model.native).start()

    def _exact_first_rows(self, refs: list[ChunkRef], matched: int, config: BlendConfig | None) -> int:
        """How many leading chunk rows a blend reuses exactly (see fusion's module doc): the first chunk's, when it
        follows the preamble itself (nothing matched in the knowledge tree), its KV is the one computed right
        after the preamble (from the store, a memory tier's copy of it, or computed now) in a 16-bit codec
        (int8's rounding is the kind of error the selection should see), and the ratio leaves rows to rank
        (at 1 every chunk token is recomputed, as a full prefill). A chunk right after the preamble reads that form
        where a sliding-window model's chunks are stored after a lead-in too (ChunkSource.near)."""
        if config is None or not config.exact_first_chunk or matched or not refs or not 0 < config.ratio < 1:
            return 0
        table = self.source.table
        return refs[0].n_rows if table is None or table.codec in ("fp16", "bf16") else 0


def _tier(ref: ChunkRef, memory: LayerKV | None, memory_tier: str | None) -> str:
    """Where a chunk's KV came from: a memory tier, the store (through the loader, or read now), or computed now."""
    if ref.read:
        return STORE
    if memory is not None and ref.in_memory is memory:
        return memory_tier
    return STORE if ref.in_memory is None else "computed"


def _previewed(config: BlendConfig | None, loaded_rows: int, forced) -> tuple[bool, BlendConfig | None]:
    """Whether a blend previews (a rule that ranks by the preview's reading reads every layer first: blend/preview.py),
    and the settings it runs. Not over a prompt's own text (`forced`), whose rows have no KV before the blend computes
    them: there the rule ranks at the check layer, as `reading` does."""
    previewed = config is not None and config.rule in PREVIEW_RULES and loaded_rows > 0
    if previewed and forced is not None:
        return False, replace(config, check_layer=config.check_layer if config.check_layer is not None else CHECK_LAYER)
    return previewed, config


def _prompt_rows(chunks: Sequence[tuple[str, Sequence[int]]], pieces: Sequence[Piece]) -> torch.Tensor:
    """[C] bool: the chunk rows that are the prompt's own text (computed at every layer, never loaded)."""
    return torch.tensor([p.chunk_id is None for (_, ids), p in zip(chunks, pieces, strict=True) for _ in ids],
                        dtype=torch.bool)


def preamble_kv(runtime: Runtime) -> LayerKV:
    """The preamble's KV, computed once per prefiller: an exact prefix of every prompt."""
    with torch.inference_mode():
        return extend(runtime.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))[1]


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
