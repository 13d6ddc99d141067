"""kvrag's Python API: open a store and a model once, then ask, stream, or submit many questions at once.

    from kvrag import KVRag

    with KVRag("my-store") as rag:
        answer = rag.ask("Who founded the company?")          # retrieval, blending, greedy decoding
        print(answer.text, [s["title"] for s in answer.sources])
        for piece in rag.stream("And when?"):                 # text as it is generated
            print(piece, end="")
        jobs = [rag.submit(q) for q in questions]              # run together, decoded in one batch
        answers = [job.result() for job in jobs]

Every request goes through one resident engine (engine/): one model, the store's stored KV, the memory tiers and
one paged KV pool shared by all of them. Methods may be called from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.config import DEFAULT_SELECTION, KV_RULE, MIN_SCORE, KVRagConfig  # (corpus.retrieve: faiss here)
from kvrag.corpus.mirror import local_store
from kvrag.engine.answer import Answer
from kvrag.engine.llm_engine import EngineConfig, LLMEngine, PromptTooLong
from kvrag.engine.loop import EngineLoop
from kvrag.engine.model_check import blend_rule
from kvrag.engine.prefiller import Prefiller
from kvrag.engine.prompt_reuse import carries_passages
from kvrag.engine.scheduler import QueueFull, SchedulerConfig
from kvrag.engine.sequence import DONE, Request
from kvrag.engine.sequence import Sequence as EngineSequence
from kvrag.engine.speculation import Speculator, Stage
from kvrag.errors import KvragError
from kvrag.model.generate import SamplingConfig, stream_text
from kvrag.model.runtime import Runtime
from kvrag.store.env import StoreEnv
from kvrag.store.remote import RemoteOptions
from kvrag.store.tiers.config import parse_bytes

Passage = tuple[str, str]  # (title, text)


# What callers above the engine (the server, applications) use: the API, the end-of-stream mark a Generation's
# events close with, the two refusals a submission can meet (queue full, prompt too long for the model/pool), the
# error every bad input raises, and the `ratio` option as a value.
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
__all__ = ["DONE", "KV_RULE", "MIN_SCORE", "Generation", "KVRag", "KVRagConfig", "KvragError", "PromptTooLong", "QueueFull", "RatioPolicy"]


class KVRag:
    def __init__(self, store: str | Path, config: KVRagConfig | None = None, **options):
        """Open the store (made by `kvrag index`) and load the model once. `config` (config.py's KVRagConfig): every
        setting, resolved; else `options` (its field names: model, dtype, device, codec, kv_budget, host_cache,
        gpu_cache, cache_policy, max_running, reorder_window, max_waiting, native, preload_retriever, tune_process,
        speculate, keep, keep_rule, ...) over the environment over the defaults, resolved here once.

        kv_budget: memory for the KV of the sequences being answered; host_cache / gpu_cache: memory tiers for hot
        chunks' KV across questions ("0" turns them off). max_waiting: refuse a new request (QueueFull) while that
        many wait (0: no bound). The retriever loads beside the model unless preload_retriever is False (then at the
        first retrieval). tune_process: let kvrag set torch's threads and keep freed memory in the C allocator for
        the whole process (faster prefills; what `kvrag ask` does). speculate: start a retrieved question's prefill
        on an IVF index's early search stages (engine/speculation.py). keep, keep_rule: read the reduced chunks
        `kvrag precompute --keep KEEP --keep-rule RULE` stored (Keyformer; 1: full chunks)."""
        from kvrag.blend.keyformer import KeepConfig

        self.config = config = config if config is not None else KVRagConfig.resolve(**options)
        keep_config = KeepConfig(config.keep, config.keep_rule)  # bad settings are said before anything loads
        remote = RemoteOptions.of(config.aws, config.mirror_dir, config.remote_cache)
        self.env = StoreEnv.open(local_store(store, remote), max_map_size=config.max_map_size)  # s3://: its mirror
        self._retriever = None
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self._retriever_lock = threading.Lock()
        self.load_timings = {"model_load": 0.0, "embedder_load": 0.0}  # seconds
        preload = threading.Thread(target=self._preload_retriever, daemon=True) if config.preload_retriever else None
        try:
            if preload is not None:
                preload.start()  # torch releases the GIL in both loads: they overlap
            start = time.perf_counter()
            self.engine = self._engine(config, keep_config, remote)
            self.load_timings["model_load"] = time.perf_counter() - start
        except BaseException:
            if preload is not None:
                preload.join()
            self.env.close()
            raise
        self.loop = EngineLoop(self.engine)
        spans = self.engine.planner.spans  # the store's passage index, built beside the first questions
        if spans is not None:
            threading.Thread(target=spans.fill, name="kvrag-passage-index", daemon=True).start()
        self.speculator = Speculator(self.loop) if config.speculate else None

    def _engine(self, config: KVRagConfig, keep, remote: RemoteOptions) -> LLMEngine:
        """The model, its prefiller over this store and the memory tiers, and the resident engine over them."""
        from kvrag.engine.memory import build_cache

        self.runtime = Runtime.from_config(config)
        cache = build_cache(self.runtime, config.codec, config.host_cache, config.gpu_cache, config.cache_policy)
        prefiller = Prefiller.open(self.runtime, self.env, config.codec, cache=cache, keep=keep, remote=remote)
        # the rule its blending check passed with; None: a model blending gets wrong, answered in full
        rule = blend_rule(self.runtime) if config.model_check else DEFAULT_SELECTION
        scheduler = SchedulerConfig(config.max_running, config.reorder_window, config.max_waiting)
        return LLMEngine(prefiller, EngineConfig(parse_bytes(str(config.kv_budget), "kv_budget"), scheduler=scheduler,
                                                 codec=config.codec, native=config.native,
                                                 chat_cache_bytes=parse_bytes(str(config.chat_cache), "chat_cache"),
                                                 kept_passages_bytes=parse_bytes(str(config.kept_passages),
                                                                                 "kept_passages"),
                                                 force_full=rule is None, selection=rule or DEFAULT_SELECTION,
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
               presence_penalty: float = 0.0, salt: str = "") -> Generation:
        """Queue a question and return at once. Its chunks: `passages` given as (title, text), else `chunk_ids`
        from the store, else the k best retrieved (dropping those under relative_cutoff x the best score, and those
        under `min_score`, the cosine similarity below which a chunk is not about the question: docs/retrieval-cutoff.md).
        `selection`: blending's finer settings (check layer, deviation, attention weight); `ratio` overrides its
        ratio. `kv_tokens`: a decode-time KV budget (Keyformer): past it, the lowest-scoring tokens' KV is dropped
        (0: none); `kv_rule`: its score, keyformer, h2o or window (the most recent tokens). `logprobs`: keep each
        generated token's log-probability and its `logprobs` most likely alternatives (`Generation.seq.logprobs`;
        None: none). `history`: a conversation's earlier turns as (role, text), system first (the prompt is the
        model's chat template over them, the passages inside the last user turn); retrieval then searches for the
        previous user turn and the question together. `rag` False, `k` 0, or no chunk passing the cutoffs: plain chat,
        with no passages and no RAG instruction. `keep_turn`: keep this turn's KV, so that a follow-up whose history
        ends with this answer reuses it (engine/conversations.py). `grammar`: a Grammar of `self.grammars` (a JSON
        schema, a tool call) the answer is decoded within. `last_role`: "tool" for a tool's result as the last
        message (with rag False). `salt`: whose caches the request reads and adds to (a tenant; "" the shared one).
        Where retrieval happens is the config's `retrieval`: with auto, a prompt that carries passages of its own (a
        stored chunk's text, or a passage-like paragraph: engine/prompt_reuse.py) is not retrieved for; without
        retrieval the prompt's stored passages are found and blended wherever they stand. `listener`: called with no
        arguments from the
        engine's thread after each token and at the end (to wake an event loop that reads `Generation.seq.events`
        without blocking)."""
        if not question or not question.strip():
            raise KvragError("the question is empty")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise KvragError(f"logprobs takes 0 to {MAX_TOP_LOGPROBS} alternatives, got {logprobs}")
        start = time.perf_counter()
        policy = ratio if isinstance(ratio, RatioPolicy) else RatioPolicy.parse(ratio, "ratio")
        blend = policy.start(selection)
        sampling = SamplingConfig(max_tokens, temperature, top_p, seed, logit_bias=logit_bias or (),
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)

        history = tuple((role, text) for role, text in history)
        given = chunk_ids is not None or passages is not None
        retrieve = rag and k > 0 and not given and self._retrieves(question, history, salt)

        def request(chunks: list[tuple[str, list[int]]], sources: list[dict]) -> Request:
            return Request(question, tuple((c, tuple(ids)) for c, ids in chunks), mode, blend, policy, sampling,
                           tuple(sources), kv_tokens=kv_tokens, kv_rule=kv_rule, logprobs=logprobs, history=history,
                           rag=given or bool(chunks), keep_turn=keep_turn, grammar=grammar, last_role=last_role,
                           salt=salt)

        query = search_text(question, history)
        if self.speculator is not None and retrieve and not history:
            stages = self._stages(query, k, relative_cutoff, min_score, request)
            return Generation(self, *self.speculator.submit(stages, listener, start))
        chunks, sources = self._chunks(query, k, relative_cutoff, chunk_ids, passages, min_score) \
            if retrieve or given else ([], [])
        retrieve_s = time.perf_counter() - start
        return Generation(self, self.loop.submit(request(chunks, sources), listener), retrieve_s)

    def _retrieves(self, question: str, history: Sequence[tuple[str, str]], salt: str) -> bool:
        """Whether a question that may be retrieved for is (the config's `retrieval`)."""
        if self.config.retrieval != "auto":
            return self.config.retrieval == "server"
        return not carries_passages(self.engine.planner, question, history, salt)

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
        embedder = self._load_retriever().embedder
        return embedder.embed(list(texts)), embedder.count_tokens(list(texts))

    @property
    def grammars(self):
        """The model's grammars for constrained decoding (model/constrain.Grammars: json_object, json_schema,
        tool_call), built at first use (its token table takes a few tenths of a second)."""
        with self._grammars_lock:  # not the retriever's: its load holds that one for seconds
            if self._grammars is None:
                from kvrag.model.constrain import Grammars

                self._grammars = Grammars(self.runtime.tokenizer, self.engine.prefiller.stop_ids)
            return self._grammars

    @property
    def embedder_name(self) -> str:
        from kvrag.corpus.embedder import NAME

        return NAME

    def retrieve(self, question: str, k: int = 5, relative_cutoff: float = 0.5, min_score: float = 0.0) -> list[dict]:
        """The chunks retrieval would give this question: chunk_id, doc_id, title, tokens, score."""
        return self._chunks(question, k, relative_cutoff, None, None, min_score)[1]

    def held_chunks(self, limit: int = 4096) -> list[str]:
        """The chunks this engine's memory tiers hold, the most recently used first, at most `limit` (what a replica
        reports to a router: server/routing.py)."""
        cache = self.engine.prefiller.source.cache
        for _ in range(3):  # the engine's thread may change the tree while this one reads it: read again
            try:
                return [] if cache is None else cache.tree.held(limit)
            except RuntimeError:
                continue
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

    # ---- chunks -----------------------------------------------------------------------------------

    def _chunks(self, question: str, k: int, relative_cutoff: float, chunk_ids: Sequence[str] | None,
                passages: Sequence[Passage] | None,
                min_score: float = 0.0) -> tuple[list[tuple[str, list[int]]], list[dict]]:
        from kvrag.store.chunks import ChunkTable, chunk_id_for

        if passages is not None:
            prompts, fp = self.runtime.prompts, self.runtime.local.tokenizer_fingerprint
            found = [(title, prompts.passage_ids(title, text)) for title, text in passages]
            return ([(chunk_id_for(ids, fp), ids) for _, ids in found],
                    [{"chunk_id": chunk_id_for(ids, fp), "title": title, "tokens": len(ids)} for title, ids in found])
        if chunk_ids is not None:
            records = ChunkTable(self.env).get_many(list(chunk_ids))  # a missing id is a KvragError
            return [(r.chunk_id, list(r.token_ids)) for r in records], [_source(r) for r in records]
        return _from_hits(self._load_retriever().search(question, k, relative_cutoff, min_score))

    def _stages(self, question: str, k: int, relative_cutoff: float, min_score: float, request) -> Iterator[Stage]:
        """The staged search's stages (Retriever.search_staged), each with the request its chunks make."""
        for staged in self._load_retriever().search_staged(question, k, relative_cutoff, min_score=min_score):
            chunks, sources = _from_hits(staged.hits)
            yield Stage(tuple(c for c, _ in chunks), partial(request, chunks, sources), staged.final)

    def _load_retriever(self):
        """The embedder and the vector index, loaded once (and warmed up on a query)."""
        with self._retriever_lock:
            if self._retriever is None:
                from kvrag.corpus.embedder import Embedder
                from kvrag.corpus.retrieve import Retriever
                from kvrag.store.chunks import ChunkTable

                start = time.perf_counter()
                if ChunkTable(self.env).count() == 0:
                    raise KvragError(f"the store at {self.env.path} has no indexed chunks; run `kvrag index` first")
                embedder = Embedder()
                embedder.embed(["warm-up"])  # the weights and torch's first-call setup, out of the first question
                self._retriever = Retriever(self.env, embedder)
                self.load_timings["embedder_load"] = time.perf_counter() - start
            return self._retriever

    def _preload_retriever(self) -> None:
        try:
            self._load_retriever()
        except KvragError:
            pass  # no index: said when a question needs retrieval


class Generation:
    """One submitted question: iterate it for text pieces, or wait for the whole `result()`."""

    def __init__(self, rag: KVRag, seq: EngineSequence, retrieve_s: float):
        self._rag, self.seq, self._retrieve_s = rag, seq, retrieve_s

    @property
    def retrieve_s(self) -> float:
        """Seconds spent retrieving before the request was submitted (speculation: before its prefill began)."""
        return self._retrieve_s

    def tokens(self) -> Iterator[int]:
        """Token ids as the engine produces them (one reader: the tokens are handed out once)."""
        while (token := self.seq.events.get()) is not DONE:
            yield token
        self._raise_if_failed()

    def __iter__(self) -> Iterator[str]:
        return stream_text(self._rag.runtime.tokenizer, self.tokens())

    def cancel(self) -> None:
        """Stop generating; its memory goes back to the engine at its next step."""
        self._rag.loop.cancel(self.seq)

    @property
    def done(self) -> bool:
        return self.seq.done.is_set()

    def result(self, timeout: float | None = None) -> Answer:
        """The whole answer, once generated. KvragError if it failed, TimeoutError after `timeout` seconds."""
        if not self.seq.done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        self._raise_if_failed()
        return self._answer()

    def _raise_if_failed(self) -> None:
        if self.seq.finish_reason == "error":
            raise KvragError(self.seq.error or "the request failed")

    def _answer(self) -> Answer:
        return self.seq.answer(self._rag.runtime.tokenizer, self._retrieve_s)


def search_text(question: str, history: Sequence[tuple[str, str]]) -> str:
    """What retrieval searches for: the question, after the previous user turn where there is one (a follow-up
    such as "When did she retire?" names its subject there)."""
    earlier = [text for role, text in history if role == "user" and text.strip()]
    return f"{earlier[-1].strip()}\n{question}" if earlier else question


def _from_hits(hits) -> tuple[list[tuple[str, list[int]]], list[dict]]:
    return ([(h.chunk.chunk_id, list(h.chunk.token_ids)) for h in hits],
            [{**_source(h.chunk), "score": round(h.score, 4)} for h in hits])


def _source(record) -> dict:
    return {"chunk_id": record.chunk_id, "doc_id": record.doc_id, "title": record.title,
            "tokens": len(record.token_ids)}
