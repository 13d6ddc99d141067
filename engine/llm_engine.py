"""The resident engine: many requests at once over one model, one store and one paged KV pool.

Each `step()` cancels what callers gave up on, prefills at most one waiting request (blended, full, prefix or
reuse, through a Prefiller (engine/prefiller.py), whose memory tiers all requests share), then runs one batched
decode step of every running sequence. Single-threaded: callers on other threads go through engine/loop.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import torch

from kvrag.blend.config import DEFAULT_RATIO
from kvrag.blend.ratio import SUFFIX_GUESS
from kvrag.config import DEFAULT_SELECTION, MODES
from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.conversations import Conversations
from kvrag.engine.kept_passages import PassageKeeper
from kvrag.engine.kv_budget import parse_rule
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.next_token import next_token
from kvrag.engine.plans import Planner
from kvrag.engine.prefill_info import chunk_tiers, exact_rows, reused_tokens, wants_exact
from kvrag.engine.prefiller import FullPrefill, Prefilled, Prefiller
from kvrag.engine.prefix_spill import PrefixSpill
from kvrag.engine.prompt_reuse import PromptSpans
from kvrag.engine.scheduler import Scheduler, SchedulerConfig
from kvrag.engine.sequence import DONE, Request, Sequence
from kvrag.engine.write_back import WriteBack
from kvrag.errors import KvragError
from kvrag.kvcache.allocator import OutOfBlocks
from kvrag.model.cache import DecodeCache


class PromptTooLong(KvragError):
    """A request longer than the model's context or the KV pool: it can never run here (the message names both)."""


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 1 << 30  # the running sequences' KV pool
    block_size: int = 16
    scheduler: SchedulerConfig = SchedulerConfig()
    codec: str = "fp16"  # which stored KV blend/reuse/prefix read
    native: bool = True  # the native batched decode step where it serves
    # a full prefill longer than this runs this many tokens a step, the running sequences decoding between the
    # pieces (0: the whole prompt in one step)
    prefill_chunk: int = 512
    chat_cache_bytes: int = 1 << 30  # the most of the pool cached prompt blocks may hold (kvcache/prefix_cache.py); 0: none
    force_full: bool = False  # every request prefilled in full (a model that failed engine/model_check.py)
    # the selection rule a blend asking for the default one runs, and the ratio `auto` starts from: what the model's
    # check chose (engine/model_check.py)
    selection: str = DEFAULT_SELECTION
    ratio: float = DEFAULT_RATIO
    prompt_spans: bool = True  # blend the stored passages found in plain prompts (engine/prompt_reuse.py)
    kept_passages_bytes: int = 1 << 30  # clients' passages stored at a second sighting (engine/kept_passages.py); 0: none
    prefix_store_bytes: int = 0  # the prefix cache's blocks spilled to the store, at most (engine/prefix_spill.py)
    # the decode step captured per batch bucket and replayed (engine/decode_graphs.py): CUDA graphs on a GPU's
    # Triton path; off until measured there
    cuda_graphs: bool = False


class LLMEngine:
    def __init__(self, prefiller: Prefiller, config: EngineConfig = EngineConfig()):
        self.prefiller, self.config = prefiller, config
        self.model = prefiller.runtime.model
        self.max_positions = self.model.cfg.max_positions
        self.kv = SequenceKV(self.model, config.kv_budget_bytes, config.block_size, config.chat_cache_bytes)
        self.kv.share_prefix(_rotated_prefix(prefiller), len(prefiller.preamble))
        self.decoder = BatchDecoder(self.model, self.kv, self.max_positions, config.native, config.cuda_graphs,
                                    config.scheduler.max_running)
        self.scheduler = Scheduler(self.kv, config.scheduler, self._order_priority)
        source = prefiller.source  # plain prompts' stored passages: full chunks only (not Keyformer's reduced ones)
        spans = PromptSpans(source.env, source.evicted_elsewhere) if config.prompt_spans and source.keep is None else None
        self.planner = Planner(prefiller.runtime, self.kv.prefix, self.kv.block_size, spans)
        self.conversations = Conversations(prefiller.runtime, self.kv, self.planner)
        self.keeper = None  # clients' new passages, stored at their second sighting (engine/kept_passages.py)
        if spans is not None and source.table is not None and source.stores:  # (none kept from int8/int4 KV)
            cfg, local = self.model.cfg, prefiller.runtime.local
            per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2  # fp16 K and V
            self.keeper = PassageKeeper(spans, prefiller.runtime.tokenizer, local.tokenizer_fingerprint,
                                        config.kept_passages_bytes // per_token, self.planner.paragraphs)
        self.writes = WriteBack(prefiller.source, self.keeper)  # stores off this thread
        self.kv.spill = PrefixSpill.open(self.kv, prefiller.runtime, source, config.prefix_store_bytes, self.writes.call)
        self.planner.spill = self.kv.spill  # kept turns' ids too, so that a later life renders their history alike
        self.prefilling: tuple[Sequence, FullPrefill] | None = None  # a chunked full prefill under way
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------------------------

    def add(self, request: Request) -> Sequence:
        """Queue a request; KvragError (nothing queued) when it cannot run here at all."""
        seq = self.new_sequence(request)
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, request: Request) -> Sequence:
        """A sequence for the request, checked against the model's context and the pool (any thread may call
        this; only the engine's thread may `add` it). KvragError when it cannot run here at all."""
        if request.mode not in MODES:
            raise KvragError(f"mode must be one of {', '.join(MODES)}, got {request.mode!r}")
        if self.config.force_full and request.mode != "full":
            request = replace(request, mode="full")
        if request.blend.selection is None:  # the default: the model's checked rule (a named one runs as named)
            request = replace(request, blend=replace(request.blend, selection=self.config.selection))
        parse_rule(request.kv_rule)  # said at submission, not at its prefill
        plan = self.planner.plan(request.question, request.history, request.chunks, request.rag,
                                 request.last_role, room=self.max_positions - request.sampling.max_tokens,
                                 salt=request.salt, find_spans=request.mode in ("blend", "reuse"),
                                 exact=wants_exact(request), found=request.prompt)
        head = len(plan.head)
        if 0 < request.kv_tokens <= head + self.kv.block_size:
            raise KvragError(f"a KV budget of {request.kv_tokens} tokens leaves nothing past the "
                             f"{head}-token preamble; give more than {head + self.kv.block_size}")
        prompt = plan.tokens
        if prompt + request.sampling.max_tokens > self.max_positions:
            raise PromptTooLong(f"prompt of {prompt} tokens + {request.sampling.max_tokens} to generate exceeds the "
                             f"model's context of {self.max_positions}")
        # reduced chunks' dropped tokens have no row in the pool (a full prefill keeps every row, prefix caching
        # computes all but its first chunk whole)
        rows = prompt - (self.prefiller.source.dropped_rows(plan.chunks) if request.mode in ("blend", "reuse") else 0)
        held = len(self.kv.shared) + self.decoder.reserved_blocks  # blocks no sequence of its own can have
        if self.kv.blocks_needed(rows + request.sampling.max_tokens) + held > self.kv.pool.num_blocks:
            raise PromptTooLong(f"prompt of {prompt} tokens + {request.sampling.max_tokens} to generate needs more KV "
                             f"than the pool's {self.kv.pool.capacity_bytes} bytes hold")
        seq = Sequence(next(self._ids), request, prompt, rows)
        seq.plan, seq.head_rows = plan, head
        return seq

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.prefilling)

    def sequences(self) -> list[Sequence]:
        """Every sequence not finished: waiting, in a chunked prefill, running."""
        return [*self.scheduler.waiting, *([self.prefilling[0]] if self.prefilling else []), *self.scheduler.running]

    # ---- occupancy (read from any thread: plain counts, a step may change them the next moment) --------

    @property
    def free_blocks(self) -> int:
        """Free blocks, cached ones no sequence holds included (the pool takes those back as it needs them)."""
        return self.kv.num_free

    @property
    def sequence_blocks(self) -> int:
        """Pool blocks held by sequences (the preamble's shared blocks and the prefix cache's aside): 0 once every
        sequence is done."""
        return self.kv.pool.num_blocks - self.kv.num_free - len(self.kv.shared)

    # ---- steps --------------------------------------------------------------------------------

    def step(self) -> None:
        """Cancel, prefill one waiting request (or the next piece of a long full prefill) if there is room, decode
        every running sequence one token."""
        for seq in [s for s in self.sequences() if s.cancelled]:
            self._finish(seq, "cancelled")
        if self.prefilling is not None:
            self._next_piece()
        else:
            seq = self.scheduler.next_prefill()
            if seq is not None:
                self._prefill(seq)
        ready = self.scheduler.reserve_decode()
        if ready:
            self._decode(ready)

    def _prefill(self, seq: Sequence) -> None:
        req = seq.request
        if seq.prefill_started is None:
            seq.prefill_started = time.perf_counter()
        try:
            if seq.plan.framed and (not req.rag or not seq.plan.chunks):  # what the cache gained since its plan
                seq.plan = self.planner.replan(seq.plan, req.mode in ("blend", "reuse"))
            config = req.blend
            chunks = [(chunk_id, list(ids)) for chunk_id, ids in seq.plan.chunks]
            if req.mode == "blend":
                n_chunk = sum(len(ids) for _, ids in chunks)
                config = req.ratio.resolve(config, self.model.cfg.n_layers, n_chunk, SUFFIX_GUESS, self.config.ratio)
                if config is None:  # auto: a full prefill costs fewer rows here; the answer's mode says it took one
                    seq.request = req = replace(req, mode="full")
            framing = None
            if seq.plan.framed:  # a full prefill computes what is not cached in its one pass
                framing, seq.hit = self.conversations.framing(seq.plan, wants_exact(req),
                                                              extend_head=req.mode != "full")
                seq.head_reused = len(seq.hit) * self.kv.block_size
            seq.exact_rows = exact_rows(seq, chunks, config, framing, len(self.prefiller.preamble))
            seq.head_exact = framing.exact_rows if framing is not None else 0
            piece = self.config.prefill_chunk
            if req.mode == "full" and 0 < piece < seq.prompt_tokens:
                self.prefilling = (seq, self.prefiller.full_prefill(chunks, req.question, extra=0,
                                                                    observe=_observe(req), framing=framing))
                self._next_piece()
                return
            pre = self.prefiller.prefill(chunks, req.question, req.mode, config, extra=0, observe=_observe(req),
                                         framing=framing, store=req.store_chunks)
        except Exception as exc:  # noqa: BLE001 - off the queue and not yet running: the loop's _fail_all misses it
            return self._failed(seq, exc)
        self._prefilled(seq, pre, config)

    def _next_piece(self) -> None:
        seq, job = self.prefilling
        try:
            pre = job.advance(self.config.prefill_chunk)
        except Exception as exc:  # noqa: BLE001 - one request's fault ends that request alone
            return self._failed(seq, exc)
        if pre is not None:
            self.prefilling = None
            self._prefilled(seq, pre, seq.request.blend)

    def _failed(self, seq: Sequence, exc: Exception) -> None:
        """End a sequence whose prefill or admission raised with the error, its pool blocks and cache references
        given back: between the prefill and the running queue it is in no queue the loop's _fail_all sees."""
        log = logging.getLogger("kvrag.engine")
        if seq.is_finished:  # answered at its first token, then caching it failed: the answer stands
            log.exception("caching a finished prompt failed; its blocks are given back")
            self._release_hit(seq)
            self.scheduler.finish(seq)
            return
        if isinstance(exc, KvragError):
            seq.error = str(exc)
        else:
            log.exception("a prefill failed; its request ends with the error")
            seq.error = f"{type(exc).__name__}: {exc}"
        self._finish(seq, "error")

    def _prefilled(self, seq: Sequence, pre: Prefilled, config) -> None:
        """The first token (unless a re-prefill after preemption), then the prompt's KV into the pool; whatever
        raises on the way ends this request with the error (_failed), never the engine."""
        try:
            self._start(seq, pre, config)
        except Exception as exc:  # noqa: BLE001 - the grammar, the keeper, the tiers, the pool: one request's fault
            self._failed(seq, exc)

    def _start(self, seq: Sequence, pre: Prefilled, config) -> None:
        req = seq.request
        seq.prompt_rows = pre.prompt_tokens  # what the pool holds (the estimate counted unstored chunks whole)
        if not seq.preemptions:  # the first token first; prefilled again, it re-feeds what it had (seq.replay)
            seq.prefill_info = {"timings": pre.timings, "chunk_tokens": pre.chunk_tokens,
                                "recomputed_chunk_tokens": pre.recomputed_chunk_tokens,
                                "bytes_loaded": pre.bytes_loaded, "chunk_tiers": chunk_tiers(seq, pre),
                                "ratio": config.ratio if req.mode == "blend" else None,
                                "reused_tokens": reused_tokens(seq, pre, len(self.prefiller.preamble)),
                                # of them, rows an earlier blend made (a kept turn's or cached blocks): not exact
                                "blended_cached_tokens": max(0, seq.head_reused - seq.head_exact)}
            if req.keep_first_logits:
                seq.first_logits = pre.logits
            hit, seq.hit = seq.hit, []  # kept past a finish at the first token, for the cache below
            try:
                self._emit(seq, self._choose(seq, pre.logits))
            finally:
                seq.hit = hit  # given back by whoever ends the sequence, a fault's _failed included
        self._admit(seq)
        self.prefiller.source.fill_cache()  # the memory tiers, between prefills, after the token
        self.writes.store_computed()  # chunks computed on the fly, repaired ones: on the write-back's thread
        if seq.is_finished:  # a stop token or a one-token answer: nothing to decode, its prompt cached all the same
            self._cache_finished(seq, pre)
            return
        if req.kv_tokens and pre.attention is not None:  # a decode-time budget: the prompt is cut to it first
            self._release_hit(seq)  # its rows may move: the cached blocks are copied like the rest
            rows = pre.attention.budget_rows(pre.cache.length, req.kv_tokens, seq.head_rows)
            pre.cache.keep_rows(rows)
            pre.attention.keep(rows)
            seq.attention = pre.attention
        while True:  # the pool had room when the prefill began; a chunked one's neighbours may have grown since
            try:
                seq.table = self.kv.admit(pre.cache, pre.cache.length, seq.hit)
                seq.hit = []  # the table holds those references now
                break
            except OutOfBlocks:
                if not self.scheduler.running:
                    raise
                self.scheduler.preempt(self.scheduler.running[-1])
        seq.length, seq.offset = pre.cache.length, pre.offset
        if seq.plan.framed and not pre.offset and pre.cache.length == seq.prompt_tokens:
            self.kv.cache_blocks(seq.plan.ids(), seq.table.blocks, req.salt, seq.exact_rows)
        self.scheduler.start(seq)

    def _decode(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.attention is not None:  # Keyformer's temperature, rising over the generation
                s.attention.advance(len(s.output), s.request.sampling.max_tokens)
        logits = self.decoder.step([s.feed_token for s in seqs], [s.table for s in seqs], [s.offset for s in seqs],
                                   [s.attention for s in seqs])
        for seq, row in zip(seqs, logits, strict=True):
            seq.length += 1
            if seq.attention is not None and seq.length >= seq.request.kv_tokens + self.kv.block_size:
                self._evict(seq)
            if seq.replay:
                seq.replay -= 1
                continue
            self._emit(seq, self._choose(seq, row))

    def _evict(self, seq: Sequence) -> None:
        """Cut a budgeted sequence's KV back to its budget: the lowest-scoring rows go and their blocks are freed
        (a block at a time: the rows move, and moving them each step would cost more than the step)."""
        rows = seq.attention.budget_rows(seq.length, seq.request.kv_tokens, seq.head_rows)
        self.kv.keep_rows(seq.table, rows)
        seq.attention.keep(rows)
        seq.offset += seq.length - int(rows.shape[-1])
        seq.length = int(rows.shape[-1])

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> int:
        return next_token(seq, logits, self.prefiller.stop_ids)

    def _emit(self, seq: Sequence, token: int) -> None:
        """A sampled token: the end (a stop token), or one more, which may be the last allowed."""
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        if token in self.prefiller.stop_ids:
            self._finish(seq, "stop")
            return
        seq.output.append(token)
        if seq.chosen is not None:
            seq.logprobs.append(seq.chosen)
        seq.push(token)
        if seq.constraint is not None and seq.constraint.done():  # the document is closed: only a stop token is left
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.request.sampling.max_tokens:
            self._finish(seq, "length")

    def fail(self, seq: Sequence) -> None:
        """End a sequence with an error (seq.error says which), wherever it stands."""
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.prefilling is not None and self.prefilling[0] is seq:
            self.prefilling = None  # its cache goes with the job
        self._release_hit(seq)
        if seq.request.keep_turn and reason in ("stop", "length") and seq.table is not None:
            self.conversations.keep_turn(seq)
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        try:
            seq.push(DONE)
        finally:
            seq.done.set()  # whatever the listener does, a reader waiting on the end gets it

    def _admit(self, seq: Sequence) -> None:
        """A plain prompt's kept passages gain value for having been read; those seen for the second time go to the
        write-back worker, which computes their KV as precompute would and stores them."""
        plan, salt = seq.plan, seq.request.salt
        if self.keeper is None or seq.request.rag or seq.request.mode not in ("blend", "reuse"):
            return
        if plan.pieces:
            self.keeper.used([p.chunk_id for p in plan.pieces])
        for passage in self.keeper.passages(plan.pieces, plan.chunks, plan.head, plan.tail, seq.head_reused):
            chunk_id = self.keeper.sighted(passage, salt)
            if chunk_id is not None and not self.writes.keep(chunk_id, passage, salt):
                self.keeper.not_queued(chunk_id)

    def close(self) -> None:
        """Finish the queued writes (the engine's thread stopped first; the store still open)."""
        self.writes.close()

    def _cache_finished(self, seq: Sequence, pre: Prefilled) -> None:
        """A prompt answered at its first token: its blocks into the pool and the prefix cache where there is room
        without preempting anyone, then its table freed (the cache keeps its own references)."""
        if not seq.plan.framed or pre.offset or pre.cache.length != seq.prompt_tokens:
            return self._release_hit(seq)
        try:
            table = self.kv.admit(pre.cache, pre.cache.length, seq.hit)
        except OutOfBlocks:
            return self._release_hit(seq)
        seq.hit = []
        try:
            self.kv.cache_blocks(seq.plan.ids(), table.blocks, seq.request.salt, seq.exact_rows)
        finally:
            self.kv.free(table)

    def _release_hit(self, seq: Sequence) -> None:
        """Give back the prefix cache's blocks a sequence matched but no table of its took."""
        if seq.hit:
            self.kv.release(seq.hit)
            seq.hit = []

    def _order_priority(self, seq: Sequence) -> float:
        """RAGCache's order (ChunkSource.order_priority) for prompts that read the tiers; 0 for the others."""
        if seq.request.mode not in ("blend", "reuse"):
            return 0.0
        return self.prefiller.source.order_priority(seq.request.chunks)


def _observe(req: Request) -> str | None:
    """The rule a prefill scores its rows by, for a request with a decode-time budget."""
    return req.kv_rule if req.kv_tokens > 0 else None


def _rotated_prefix(prefiller: Prefiller) -> DecodeCache:
    """The preamble's KV as a prefill leaves it in a decode cache: keys rotated to positions 0..P-1."""
    model, pre = prefiller.runtime.model, prefiller.preamble
    with torch.inference_mode():
        layers = [(model.rotate_keys(k, pre.positions, layer=i), v.to(model.dtype))
                  for i, (k, v) in enumerate(zip(pre.k, pre.v, strict=True))]
    return DecodeCache.from_prompt(model, layers, 0)
