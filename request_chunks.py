"""The chunks a request will read, found without loading the model: what a router needs to send a request to the
replica whose memory tiers already hold them (`kvrag serve --ray-serve`, server/routing.py).

It decides as KVRag.submit does: chunks named by `chunk_ids` or sent as `passages`; else, where the config's
`retrieval` says so, the k best retrieved (done here, once, so the replica is handed them as `chunk_ids`); else the
stored passages found in the prompt's own text, which the replica blends wherever they stand.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrag.api import MIN_SCORE, Passage, search_text
from kvrag.config import KVRagConfig
from kvrag.corpus.mirror import local_store
from kvrag.engine.prompt_reuse import PromptSpans, client_texts, passage_like, stored_spans
from kvrag.model.files import resolve_model
from kvrag.model.prompt import PromptBuilder
from kvrag.store.chunks import ChunkTable, chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.remote import RemoteOptions


@dataclass(frozen=True)
class Found:
    chunks: tuple[tuple[str, int], ...]  # (chunk id, tokens) in prompt order
    retrieved: tuple[str, ...] | None = None  # the retrieved chunk ids, when retrieval ran here (else None)


class RequestChunks:
    def __init__(self, store: str | Path, config: KVRagConfig | None = None, **options):
        self.config = config = config if config is not None else KVRagConfig.resolve(**options)
        remote = RemoteOptions.of(config.aws, config.mirror_dir, config.remote_cache)
        self.env = StoreEnv.open(local_store(store, remote), max_map_size=config.max_map_size)
        local = resolve_model(config.model)
        self.tokenizer_fp = local.tokenizer_fingerprint
        self.prompts = PromptBuilder(local.load_tokenizer())
        self.spans = PromptSpans(self.env)
        self._retriever = None
        self._lock = threading.Lock()

    def find(self, question: str, history: Sequence[tuple[str, str]] = (), *, k: int = 5,
             relative_cutoff: float = 0.5, min_score: float = MIN_SCORE, chunk_ids: Sequence[str] | None = None,
             passages: Sequence[Passage] | None = None, rag: bool = True, salt: str = "") -> Found:
        """The chunks of a request with KVRag.submit's options; a chunk id the store has not counts 0 tokens (the
        replica says what is wrong with it)."""
        if passages is not None:
            ids = [self.prompts.passage_ids(title, text) for title, text in passages]
            return Found(tuple((chunk_id_for(i, self.tokenizer_fp), len(i)) for i in ids))
        if chunk_ids is not None:
            return Found(tuple((c, self._tokens(c)) for c in chunk_ids))
        texts = client_texts(question, history)
        if rag and k > 0 and self._retrieves(texts, salt):
            hits = self.retriever().search(search_text(question, history), k, relative_cutoff, min_score)
            chunks = tuple((h.chunk.chunk_id, len(h.chunk.token_ids)) for h in hits)
            return Found(chunks, tuple(c for c, _ in chunks))
        spans = stored_spans(self.prompts.tokenizer, self.spans, texts, salt)
        return Found(tuple((s.chunk_id, s.length) for s in spans))

    def retriever(self):
        """The store's embedder and vector index, loaded at first use."""
        with self._lock:
            if self._retriever is None:
                from kvrag.corpus.embedder import Embedder
                from kvrag.corpus.retrieve import Retriever

                self._retriever = Retriever(self.env, Embedder())
            return self._retriever

    def close(self) -> None:
        self.env.close()

    def _retrieves(self, texts: list[str], salt: str) -> bool:
        if self.config.retrieval != "auto":
            return self.config.retrieval == "server"
        tokenizer = self.prompts.tokenizer
        return not (passage_like(tokenizer, texts) or stored_spans(tokenizer, self.spans, texts, salt))

    def _tokens(self, chunk_id: str) -> int:
        record = ChunkTable(self.env).get(chunk_id)
        return 0 if record is None else len(record.token_ids)
