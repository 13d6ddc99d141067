"""The chunks a request will read, decided once: by the API before it submits (what it found is carried on the
request, so the engine tokenizes and probes nothing again), and by the cluster's front, without the model, to send
a request to the replica whose memory tiers already hold them (cluster/serve.py, cluster/routing.py).

A request reads the chunks named by `chunk_ids` or sent as `passages`; else, where the config's `retrieval` says so,
the k best retrieved; else none of ours, and its plain prompt is cut around the stored passages found in it, which
the engine blends wherever they stand. With `retrieval` auto, a prompt whose client messages carry passages of their
own (a stored chunk's text, or a passage-like run: engine/prompt_reuse.py) is not retrieved for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrag.config import MIN_SCORE, KVRagConfig
from kvrag.corpus.mirror import local_store
from kvrag.engine.kept_passages import client_chunk_id
from kvrag.engine.prompt_reuse import Paragraphs, PromptFound, PromptSpans, carries_passages, find_in_prompt
from kvrag.errors import KvragError
from kvrag.model.chat import ChatPrompts
from kvrag.model.files import resolve_model
from kvrag.model.prompt import PromptBuilder
from kvrag.store.chunks import ChunkTable, chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.open import RemoteOptions

Passage = tuple[str, str]  # (title, text)


@dataclass(frozen=True)
class Found:
    chunks: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (chunk id, ids) in prompt order: given or retrieved
    sources: tuple[dict, ...] = ()  # what an answer reports of them
    retrieved: bool = False  # retrieval was decided (`staged`: the search left to the caller)
    prompt: PromptFound | None = None  # a plain prompt rendered here: its ids and stored spans
    own: bool = False  # the chunks are the request's own passages: computed for it, never written to the store

    @property
    def routed(self) -> tuple[tuple[str, int], ...]:
        """(chunk id, tokens) a replica will read, in prompt order: what a router weighs."""
        if not self.chunks and self.prompt is not None:
            return tuple((s.chunk_id, s.length) for s in self.prompt.spans)
        return tuple((c, len(ids)) for c, ids in self.chunks)


class Retrieval:
    """The store's embedder and vector index, loaded once at first use (and warmed up on a query)."""

    def __init__(self, env: StoreEnv):
        self.env, self.load_s = env, 0.0  # load_s: seconds the load took
        self._retriever = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._retriever is None:
                from kvrag.corpus.embedder import Embedder
                from kvrag.corpus.retrieve import Retriever

                start = time.perf_counter()
                if ChunkTable(self.env).count() == 0:
                    raise KvragError(f"the store at {self.env.path} has no indexed chunks; run `kvrag index` first")
                embedder = Embedder()
                embedder.embed(["warm-up"])  # the weights and torch's first-call setup, out of the first question
                self._retriever = Retriever(self.env, embedder)
                self.load_s = time.perf_counter() - start
            return self._retriever

    def preload(self) -> None:
        try:
            self.get()
        except KvragError:
            pass  # no index: said when a question needs retrieval

    def search(self, query: str, k: int, relative_cutoff: float, min_score: float) -> Found:
        return from_hits(self.get().search(query, k, relative_cutoff, min_score))


class RequestChunks:
    """Decides one store's requests (`mode`: the config's retrieval); `spans` and `paragraphs` are the engine's
    where there is one (its passage index), else this process's own."""

    def __init__(self, env: StoreEnv, mode: str, prompts: PromptBuilder, tokenizer_fp: str, retrieval: Retrieval,
                 spans: PromptSpans | None, paragraphs: Paragraphs | None = None):
        self.env, self.mode, self.prompts, self.tokenizer_fp = env, mode, prompts, tokenizer_fp
        self.retrieval, self.spans = retrieval, spans
        self.chat = ChatPrompts(prompts)
        self.paragraphs = paragraphs or Paragraphs(prompts.tokenizer)

    @classmethod
    def open(cls, store: str | Path, config: KVRagConfig | None = None, **options) -> RequestChunks:
        """A router's: the store and the model's tokenizer, no model."""
        config = config if config is not None else KVRagConfig.resolve(**options)
        remote = RemoteOptions.of(config.aws, config.mirror_dir, config.remote_cache)
        env = StoreEnv.open(local_store(store, remote), max_map_size=config.max_map_size)
        local = resolve_model(config.model)
        return cls(env, config.retrieval, PromptBuilder(local.load_tokenizer()), local.tokenizer_fingerprint,
                   Retrieval(env), PromptSpans(env))

    def _own_chunks(self, passages: Sequence[tuple[int, ...]], salt: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """A request's own passages as chunks: a passage the corpus holds (the same ids) reads the corpus's stored
        KV; any other gets its tenant's salted id (kept_passages.client_chunk_id), so a memory tier's copy made for
        one tenant is never another's hit, and the engine never writes it to the store (Found.own)."""
        table = ChunkTable(self.env)
        corpus = [chunk_id_for(ids, self.tokenizer_fp) for ids in passages]
        return tuple((c if table.get(c) is not None else client_chunk_id(ids, self.tokenizer_fp, salt), ids)
                     for c, ids in zip(corpus, passages, strict=True))

    def find(self, question: str, history: Sequence[tuple[str, str]] = (), *, k: int = 5,
             relative_cutoff: float = 0.5, min_score: float = MIN_SCORE, chunk_ids: Sequence[str] | None = None,
             passages: Sequence[Passage] | None = None, rag: bool = True, salt: str = "", last_role: str = "user",
             plain: bool = True, staged: bool = False) -> Found:
        """The chunks of a request with KVRag.submit's options (a chunk id the store has not: KvragError). `plain`: a
        plain prompt's stored spans are found here even where no decision needs them (a router weighs them; else the
        engine finds them). `staged`: where retrieval is decided, leave the search to the caller."""
        if passages is not None:
            found = [(title, tuple(self.prompts.passage_ids(title, text))) for title, text in passages]
            chunks = self._own_chunks([ids for _, ids in found], salt)
            return Found(chunks, tuple({"chunk_id": c, "title": title, "tokens": len(ids)}
                                       for (c, ids), (title, _) in zip(chunks, found, strict=True)), own=True)
        if chunk_ids is not None:
            records = ChunkTable(self.env).get_many(list(chunk_ids))
            return Found(tuple((r.chunk_id, tuple(r.token_ids)) for r in records), tuple(map(_source, records)))
        prompt = None
        if rag and k > 0:
            if self.mode == "auto":  # the prompt rendered and probed once: what decides is what the engine plans from
                prompt = find_in_prompt(self.chat, self.spans, history, question, last_role, salt)
            if self.mode == "server" or (prompt is not None
                                         and not carries_passages(self.paragraphs, prompt, question, history)):
                if staged:  # the search left to the caller
                    return Found(retrieved=True, prompt=prompt)
                found = self.retrieval.search(search_text(question, history), k, relative_cutoff, min_score)
                return found if found.chunks else Found(retrieved=True, prompt=prompt)
        if prompt is None and plain:
            prompt = find_in_prompt(self.chat, self.spans, history, question, last_role, salt)
        return Found(prompt=prompt)

    def close(self) -> None:
        self.env.close()


def search_text(question: str, history: Sequence[tuple[str, str]]) -> str:
    """What retrieval searches for: the question, after the previous user turn where there is one (a follow-up
    such as "When did she retire?" names its subject there)."""
    earlier = [text for role, text in history if role == "user" and text.strip()]
    return f"{earlier[-1].strip()}\n{question}" if earlier else question


def from_hits(hits) -> Found:
    """Retrieval's hits as a request's chunks and sources."""
    return Found(tuple((h.chunk.chunk_id, tuple(h.chunk.token_ids)) for h in hits),
                 tuple({**_source(h.chunk), "score": round(h.score, 4)} for h in hits), retrieved=True)


def _source(record) -> dict:
    return {"chunk_id": record.chunk_id, "doc_id": record.doc_id, "title": record.title,
            "tokens": len(record.token_ids)}
