"""kvrag's Python API (README, "Python API"): open a store and a model once, then ask, stream, or submit many
questions at once. Every request goes through one resident engine (engine/): one model, the store's stored KV, the
memory tiers and one paged KV pool shared by all of them. Methods may be called from any thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from kvrag.blend.config import DEFAULT_RATIO, BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.config import DEFAULT_SELECTION, KV_RULE, MIN_SCORE, KVRagConfig  # (corpus.retrieve: faiss here)
from kvrag.corpus.mirror import local_store
from kvrag.engine.answer import Answer
from kvrag.engine.llm_engine import EngineConfig, LLMEngine, PromptTooLong
from kvrag.engine.loop import EngineLoop
from kvrag.engine.model_check import blend_verdict
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.scheduler import QueueFull, SchedulerConfig
from kvrag.engine.sequence import DONE, Request
from kvrag.engine.sequence import Sequence as EngineSequence
from kvrag.engine.speculation import Speculator, Stage
from kvrag.errors import KvragError
from kvrag.model.detokenize import Detokenizer
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.request_chunks import Found, Passage, RequestChunks, Retrieval, from_hits
from kvrag.store.env import StoreEnv
from kvrag.store.open import RemoteOptions
from kvrag.store.tiers.config import parse_bytes

# What callers above the engine (the server, applications) use: the API, the two refusals a submission can meet
# (queue full, prompt too long for the model/pool), the error every bad input raises, and the `ratio` option.
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
__all__ = ["KV_RULE", "MIN_SCORE", "Generation", "KVRag", "KVRagConfig", "KvragError", "PromptTooLong", "QueueFull", "RatioPolicy"]


class KVRag:
    def __init__(self, store: str | Path, config: KVRagConfig | None = None, **options):
        """Open the store (made by `kvrag index`) and load the model once. `config`: every setting, resolved; else
        `options` (KVRagConfig's field names, config.py says what each does) over the environment over the defaults."""
        from kvrag.precompute.keyformer import KeepConfig

        self.config = config = config if config is not None else KVRagConfig.resolve(**options)
        keep_config = KeepConfig(config.keep, config.keep_rule)  # bad settings are said before anything loads
        remote = RemoteOptions.of(config.aws, config.mirror_dir, config.remote_cache)
        self.env = StoreEnv.open(local_store(store, remote), max_map_size=config.max_map_size)  # s3://: its mirror
        self.retrieval = Retrieval(self.env)
        self._grammars = None
        self._grammars_lock = threading.Lock()
        preload = threading.Thread(target=self.retrieval.preload, daemon=True) if config.preload_retriever else None
        try:
            if preload is not None:
                preload.start()  # torch releases the GIL in both loads: they overlap
            start = time.perf_counter()
            self.engine = self._engine(config, keep_config, remote)
            self._model_load_s = time.perf_counter() - start
        except BaseException:
            if preload is not None:
                preload.join()
            self.env.close()
            raise
        self.loop = EngineLoop(self.engine)
        spans = self.engine.planner.spans  # the store's passage index, built beside the first questions
        self.chunks = RequestChunks(self.env, config.retrieval, self.runtime.prompts,
                                    self.runtime.local.tokenizer_fingerprint, self.retrieval, spans,
                                    self.engine.planner.paragraphs)  # the engine's passage index and rule
        if spans is not None:
            threading.Thread(target=spans.fill, name="kvrag-passage-index", daemon=True).start()
        self.speculator = Speculator(self.loop) if config.speculate else None

    def _engine(self, config: KVRagConfig, keep, remote: RemoteOptions) -> LLMEngine:
        """The model, its prefiller over this store and the memory tiers, and the resident engine over them."""
        from kvrag.engine.memory import build_cache

        self.runtime = Runtime.from_config(config)
        cache = build_cache(self.runtime, config.codec, config.host_cache, config.gpu_cache, config.cache_policy)
        prefiller = Prefiller.open(self.runtime, self.env, config.codec, cache=cache, keep=keep, remote=remote)
        # the rule and ratio its blending check chose; no rule: a model blending gets wrong, answered in full
        report = blend_verdict(self.runtime, config.check_budget) if config.model_check else None
        self.verdict = report.verdict() if report is not None else {
            "passed": None, "mode": "blend", "rule": DEFAULT_SELECTION, "ratio": DEFAULT_RATIO, "judged_by": None,
            "deferred": False}
        rule, ratio = self.verdict["rule"], self.verdict["ratio"]
        scheduler = SchedulerConfig(config.max_running, config.reorder_window, config.max_waiting)
        sizes = ("kv_budget", "chat_cache", "kept_passages", "prefix_store")
        size = {name: parse_bytes(str(getattr(config, name)), name) for name in sizes}
        return LLMEngine(prefiller, EngineConfig(size["kv_budget"], scheduler=scheduler, codec=config.codec,
                                                 native=config.native, chat_cache_bytes=size["chat_cache"],
                                                 kept_passages_bytes=size["kept_passages"], force_full=rule is None,
                                                 prefix_store_bytes=size["prefix_store"],
                                                 selection=rule or DEFAULT_SELECTION, ratio=ratio or DEFAULT_RATIO,
                                                 cuda_graphs=config.cuda_graphs))

    # ---- asking ---------------------------------------------------------------------------------

    def submit(self, question: str, *, k: int = 5, relative_cutoff: float = 0.5, min_score: float = MIN_SCORE,
               chunk_ids: Sequence[str] | None = None, passages: Sequence[Passage] | None = None,
               mode: str = "blend", ratio: float | str | RatioPolicy = "auto", max_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, selection: BlendConfig | None = None,
               kv_tokens: int = 0, kv_rule: str = KV_RULE, logprobs: int | None = None,
               history: Sequence[tuple[str, str]] = (), rag: bool = True, keep_turn: bool = False,
               grammar=None, last_role: str = "user", listener: Callable[[], None] | None = None,
               logit_bias: dict[int, float] | None = None, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, salt: str = "", min_tokens: int = 0) -> Generation:
        """Queue a question and return at once. Its chunks: `passages` given as (title, text), else `chunk_ids` from
        the store, else, where the config's `retrieval` says so, the k best retrieved (dropping those under
        relative_cutoff x the best score, and those under `min_score`, the cosine similarity below which a chunk is
        not about the question: docs/retrieval-cutoff.md). With auto, a prompt that carries passages of its own (a
        stored chunk's text, or a passage-like paragraph: engine/prompt_reuse.py) is not retrieved for; without
        retrieval the prompt's stored passages are found and blended wherever they stand. `rag` False, `k` 0, or no
        chunk passing the cutoffs: plain chat, with no passages and no RAG instruction.
        `selection`: blending's finer settings (check layer, deviation, attention weight); `ratio` overrides its
        ratio. `kv_tokens`: a decode-time KV budget (Keyformer): past it, the lowest-scoring tokens' KV is dropped
        (0: none); `kv_rule`: its score, keyformer, h2o or window (the most recent tokens). `logprobs`: keep each
        generated token's log-probability and its `logprobs` most likely alternatives (None: none). `history`: a
        conversation's earlier turns as (role, text), system first (the prompt is the model's chat template over
        them, the passages inside the last user turn); retrieval searches for the previous user turn and the
        question together. `keep_turn`: keep this turn's KV for a follow-up whose history ends with this answer
        (engine/conversations.py). `grammar`: a Grammar of `self.grammars` (a JSON schema, a tool call) the answer
        is decoded within. `last_role`: "tool" for a tool's result as the last message (with rag False). `salt`:
        whose caches the request reads and adds to (a tenant; "" the shared one). `min_tokens`: no stop token before
        this many (vLLM's, for fixed-length benchmark answers). `listener`: called from the engine's thread after
        each token and at the end (wakes an event loop that reads `Generation.new_text`)."""
        if not question or not question.strip():
            raise KvragError("the question is empty")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise KvragError(f"logprobs takes 0 to {MAX_TOP_LOGPROBS} alternatives, got {logprobs}")
        start = time.perf_counter()
        policy = ratio if isinstance(ratio, RatioPolicy) else RatioPolicy.parse(ratio, "ratio")
        blend = policy.start(selection)
        sampling = SamplingConfig(max_tokens, temperature, top_p, seed, logit_bias=logit_bias or (),
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  min_tokens=min(min_tokens, max_tokens))

        history = tuple((role, text) for role, text in history)
        given = chunk_ids is not None or passages is not None
        staged = self.speculator is not None and not history
        found = self.chunks.find(question, history, k=k, relative_cutoff=relative_cutoff, min_score=min_score,
                                 chunk_ids=chunk_ids, passages=passages, rag=rag, salt=salt, last_role=last_role,
                                 plain=False, staged=staged)

        def request(found: Found) -> Request:
            return Request(question, found.chunks, mode, blend, policy, sampling, found.sources, kv_tokens=kv_tokens,
                           kv_rule=kv_rule, logprobs=logprobs, history=history, rag=given or bool(found.chunks),
                           keep_turn=keep_turn, grammar=grammar, last_role=last_role, salt=salt, prompt=found.prompt,
                           store_chunks=not found.own)

        if staged and found.retrieved:  # the search left to its stages
            # each stage's request keeps the plain prompt the decision rendered (for a search that finds nothing)
            stages = self._stages(question, k, relative_cutoff, min_score,
                                  lambda hits: request(replace(hits, prompt=found.prompt)))
            return Generation(self, *self.speculator.submit(stages, listener, start))
        retrieve_s = time.perf_counter() - start
        return Generation(self, self.loop.submit(request(found), listener), retrieve_s)

    def ask(self, question: str, **options) -> Answer:
        """Answer one question (the options of `submit`) and return when it is done."""
        return self.submit(question, **options).result()

    def stream(self, question: str, **options) -> Iterator[str]:
        """The answer's text piece by piece as it is generated (the options of `submit`)."""
        return iter(self.submit(question, **options))

    def embed(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        """The store's embedder (the one its index was built with) over `texts`, batched: unit vectors
        [len(texts), dim] float32, and the tokens it read (each text truncated where the embedder truncates)."""
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise KvragError("embed takes a non-empty list of non-empty strings")
        embedder = self.retrieval.get().embedder
        return embedder.embed(list(texts)), embedder.count_tokens(list(texts))

    @property
    def grammars(self):
        """The model's grammars for constrained decoding (model/constrain.Grammars), built at first use."""
        with self._grammars_lock:  # not the retriever's: its load holds that one for seconds
            if self._grammars is None:
                from kvrag.model.constrain import Grammars

                self._grammars = Grammars(self.runtime.tokenizer, self.engine.prefiller.stop_ids)
            return self._grammars

    @property
    def load_timings(self) -> dict[str, float]:
        """Seconds the model's load took, and the retriever's (0 until it has loaded)."""
        return {"model_load": self._model_load_s, "embedder_load": self.retrieval.load_s}

    @property
    def embedder_name(self) -> str:
        from kvrag.corpus.embedder import NAME

        return NAME

    def retrieve(self, question: str, k: int = 5, relative_cutoff: float = 0.5, min_score: float = 0.0) -> list[dict]:
        """The chunks retrieval would give this question: chunk_id, doc_id, title, tokens, score."""
        return list(self.retrieval.search(question, k, relative_cutoff, min_score).sources)

    def stats(self) -> EngineStats:
        """The engine's counts now: queue, KV pool, write-back, kept passages, tier hit rates, speculation."""
        engine = self.engine
        keeper = engine.keeper.stats if engine.keeper is not None else None
        tiers = engine.prefiller.source.cache.stats if engine.prefiller.source.cache is not None else None
        return EngineStats(
            waiting=self.loop.waiting(), running=self.loop.running(), free_blocks=engine.free_blocks,
            blocks=engine.kv.pool.num_blocks, prefix_blocks=len(engine.kv.prefix),
            rows_admitted=engine.kv.admitted_rows, rows_gathered=engine.kv.read_out.gathered,
            rows_packed=engine.kv.read_out.packed, prefix_saved=engine.kv.spill.saved if engine.kv.spill else 0,
            prefix_restored=engine.kv.spill.restored if engine.kv.spill else 0,
            writes_given=engine.writes.given, writes_done=engine.writes.done, writes_failed=engine.writes.failed,
            kept_admitted=keeper.admitted if keeper else 0, kept_evicted=keeper.evicted if keeper else 0,
            prefix_hit_rate=tiers.prefix_hit_rate if tiers else 0.0, memory_hit_rate=tiers.memory_hit_rate if tiers else 0.0,
            speculative=dict(self.speculator.counts) if self.speculator is not None else {})

    def held_chunks(self, limit: int = 4096) -> list[str]:
        """The chunks this engine's memory tiers hold, the most recently used first, at most `limit` (what a replica
        reports to a router: cluster/routing.py)."""
        cache = self.engine.prefiller.source.cache
        for _ in range(3 if cache is not None else 0):  # the engine's thread may change the tree as this one reads it
            with contextlib.suppress(RuntimeError):
                return cache.tree.held(limit)
        return []

    # ---- life -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what is still running, stop the engine and close the store."""
        self.loop.close()
        self.engine.close()
        if self.engine.planner.spans is not None:
            self.engine.planner.spans.close()  # the passage index's fill reads the store
        self.env.close()

    def __enter__(self) -> KVRag:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stages(self, question: str, k: int, relative_cutoff: float, min_score: float, request) -> Iterator[Stage]:
        """The staged search's stages (Retriever.search_staged), each with the request its chunks make."""
        for staged in self.retrieval.get().search_staged(question, k, relative_cutoff, min_score=min_score):
            found = from_hits(staged.hits)
            yield Stage(tuple(c for c, _ in found.chunks), partial(request, found), staged.final)


@dataclass(frozen=True)
class EngineStats:
    """The engine's counts at one moment, as one value: what the server's /health and /metrics report, read without
    the server reaching into the engine's parts (another thread may change a count a moment later)."""

    waiting: int  # requests waiting for a prefill
    running: int  # sequences prefilled and decoding
    free_blocks: int  # of the running sequences' KV pool
    blocks: int
    prefix_blocks: int  # pool blocks the prefix cache lists (held or evictable)
    rows_admitted: int  # prompt rows copied into the pool (a prefix hit's rows are referenced, not copied)
    rows_gathered: int  # a cached head's rows copied out of the pool into one tensor, per layer read
    rows_packed: int  # a cached head's rows packed into the row kernel's workspace, per layer read
    prefix_saved: int  # prefix cache blocks handed to the store's prefix table, and read back from it
    prefix_restored: int
    writes_given: int  # write-back jobs given, those done, and those that failed (the log says why)
    writes_done: int
    writes_failed: int
    kept_admitted: int  # client passages kept at their second sighting, and kept ones evicted
    kept_evicted: int
    prefix_hit_rate: float  # the memory tiers' hit rates over the chunks asked for
    memory_hit_rate: float
    speculative: dict[str, int] = field(default_factory=dict)  # started, kept, dropped


class Generation:
    """One submitted question: iterate it for text pieces, or wait for the whole `result()`. Its tokens, how it
    ended, its prompt's costs and sources are read here as it runs: the one view of a request above the engine."""

    def __init__(self, rag: KVRag, seq: EngineSequence, retrieve_s: float):
        self._rag, self._seq = rag, seq
        self.retrieve_s = retrieve_s  # seconds retrieving before it was submitted (speculation: before its prefill)
        self._text = Detokenizer(rag.runtime.tokenizer)  # for its one reader: the text of the tokens read so far

    def tokens(self) -> Iterator[int]:
        """Token ids as the engine produces them (one reader: the tokens are handed out once)."""
        while (token := self._seq.events.get()) is not DONE:
            yield token
        self._raise_if_failed()

    def __iter__(self) -> Iterator[str]:
        for token in self.tokens():
            if piece := self._text.push(token):
                yield piece
        if tail := self._text.flush():
            yield tail

    def new_text(self) -> tuple[str, bool]:
        """Without waiting: the text generated since the last call (a character's bytes held back until it is whole),
        and whether it is the end; for a reader on an event loop, woken by submit's `listener`. One reader, as for
        `tokens` and iterating."""
        pieces = []
        while True:
            try:
                token = self._seq.events.get_nowait()
            except queue.Empty:
                return "".join(pieces), False
            if token is DONE:
                return "".join(pieces) + self._text.flush(), True
            pieces.append(self._text.push(token))

    def cancel(self) -> None:
        """Stop generating; its memory goes back to the engine at its next step."""
        self._rag.loop.cancel(self._seq)

    def result(self, timeout: float | None = None) -> Answer:
        """The whole answer, once generated. KvragError if it failed, TimeoutError after `timeout` seconds."""
        if not self._seq.done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        self._raise_if_failed()
        return self._seq.answer(self._rag.runtime.tokenizer, self.retrieve_s)

    def _raise_if_failed(self) -> None:
        if self._seq.finish_reason == "error":
            raise KvragError(self.error)

    # ---- what it did, read while it runs ------------------------------------------------------------

    @property
    def finish_reason(self) -> str | None:
        """stop (a stop token), length (max_tokens or a full cache), error, cancelled; None while it runs."""
        return self._seq.finish_reason

    @property
    def error(self) -> str:
        """Why it failed (finish_reason error)."""
        return self._seq.error or "the request failed"

    @property
    def token_ids(self) -> list[int]:
        return list(self._seq.output)

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Each generated token's log-probability and its most likely alternatives; None where none were asked."""
        return None if self._seq.request.logprobs is None else list(self._seq.logprobs)

    @property
    def ran(self) -> dict:
        """What produced this answer: mode, ratio (the share of chunk rows recomputed) and selection rule."""
        return self._seq.ran()

    @property
    def prompt_counts(self) -> dict[str, int]:
        """The prompt's tokens: all, those whose KV was reused (of them, blended_cached: reused as an earlier blend
        made it) and computed; 0 until prefilled."""
        seq = self._seq
        return {"all": seq.prompt_tokens, "reused": seq.reused_tokens, "blended_cached": seq.blended_cached_tokens,
                "computed": seq.computed_tokens}

    @property
    def sources(self) -> list[dict]:
        """The chunks the answer was given, each with where its KV came from (`tier`: None until prefilled, and
        for the chunks after a prefix-caching prompt's first)."""
        tiers = self._seq.prefill_info.get("chunk_tiers", ())
        return [{**source, "tier": tiers[i] if i < len(tiers) else None}
                for i, source in enumerate(self._seq.request.sources)]

    @property
    def chunk_ids(self) -> list[str] | None:
        """The chunks its prompt holds, retrieved or given; None for plain chat (no passages, no RAG prompt)."""
        request = self._seq.request
        return [chunk_id for chunk_id, _ in request.chunks] if request.rag else None

    def times(self) -> dict[str, float]:
        """Seconds: retrieval, waiting for a prefill (queued), submission to the first token (ttft), first to last
        token (decode) so far."""
        return {"retrieve": self.retrieve_s, **self._seq.times()}

    def stamps(self) -> tuple[float | None, float | None]:
        """When its first token came and when it ended, on time.perf_counter's clock (None before)."""
        return self._seq.first_token_at, self._seq.finished_at
