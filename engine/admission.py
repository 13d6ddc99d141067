"""New passages kept: the passage-like text of clients' prompts that the store lacks, stored at its second sighting.

A plain prompt's text outside its stored spans is cut at line breaks; a segment of PASSAGE_TOKENS or more is a
passage (a retrieved document an application pasted in), anything shorter a template's glue. Each passage is
counted by its ids and its tenant's salt. A one-off passage is never stored (one-off prompts would flood the store
and push nothing useful in: LMCache's non-prefix hit rate decays for that reason); the second sighting stores it,
its KV computed as precompute computes a chunk's, keyed by the salt, so the third is a hit. The bytes kept this
way are bounded, those of earlier runs included: past the bound nothing more is admitted, and what is stored already
(the corpus above all) is never pushed out by it. `kvrag store stats` counts them, `kvrag store gc --client-passages`
drops them.

The KV goes through the chunk source's write-back (after the answer's first token, one LMDB transaction per chunk:
a kill loses nothing stored before and leaves no half-written value); its chunk record, marked as a client's
(doc id "client:<salt>"), follows it, so a record never names KV that is not there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.engine.prompt_reuse import PASSAGE_TOKENS, Piece, PromptSpans
from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable, chunk_id_for

SIGHTINGS_KEPT = 65536  # passages counted at once (least recently seen forgotten first)


def client_chunk_id(ids: Sequence[int], tokenizer_fp: str, salt: str) -> str:
    """A kept passage's content address: its ids under the tokenizer and the tenant's salt (two tenants sending the
    same passage keep two copies, so neither learns from the other's timing that it was sent)."""
    return chunk_id_for(ids, f"{tokenizer_fp}\0client\0{salt}")


@dataclass
class KeeperStats:
    sighted: int = 0  # passage-like segments seen in plain prompts
    admitted: int = 0  # stored at a second sighting
    refused: int = 0  # seen again, but the bound was reached
    kept_tokens: int = 0  # tokens stored this way by this process


class PassageKeeper:
    """Counts and admits one engine's client passages (see the module doc); `bound_tokens` 0 keeps none."""

    def __init__(self, spans: PromptSpans, tokenizer, tokenizer_fp: str, bound_tokens: int):
        self.spans, self.tokenizer, self.tokenizer_fp = spans, tokenizer, tokenizer_fp
        self.bound_tokens = bound_tokens
        self.stats = KeeperStats()
        self._seen: OrderedDict[str, int] = OrderedDict()  # client chunk id: sightings
        self._breaks: frozenset[int] | None = None  # token ids whose text holds a line break
        self._lock = threading.Lock()

    def passages(self, plan_pieces: Sequence[Piece] | None, chunks, head: Sequence[int],
                 tail: Sequence[int]) -> list[tuple[int, ...]]:
        """The passage-like segments of a plan's own text: its head, the text between its stored spans, its tail."""
        regions = [tuple(head), tuple(tail)]
        if plan_pieces is not None:
            regions += [tuple(c) for (_, c), p in zip(chunks, plan_pieces, strict=True) if p.chunk_id is None]
        breaks = self._break_ids()
        out = []
        for region in regions:
            start = 0
            for i, token in enumerate([*region, -1]):
                if token == -1 or token in breaks:
                    if i - start >= PASSAGE_TOKENS:
                        out.append(region[start:i])
                    start = i + 1
        return out

    def sighted(self, passage: tuple[int, ...], salt: str) -> str | None:
        """Count a sighting; the passage's client chunk id when it is to be stored now (its second), else None."""
        chunk_id = client_chunk_id(passage, self.tokenizer_fp, salt)
        with self._lock:
            self.stats.sighted += 1
            count = self._seen.pop(chunk_id, 0) + 1
            self._seen[chunk_id] = count
            while len(self._seen) > SIGHTINGS_KEPT:
                self._seen.popitem(last=False)
            if count != 2:
                return None
            if self.spans.client_tokens + len(passage) > self.bound_tokens:  # the store's, earlier runs' too
                self.stats.refused += 1
                return None
            self.stats.admitted += 1
            self.stats.kept_tokens += len(passage)
            return chunk_id

    def recorded(self, table: ChunkTable, chunk_id: str, passage: tuple[int, ...], salt: str) -> None:
        """After its KV is stored: the passage's record, and the index entry that makes its next sighting a hit."""
        text = self.tokenizer.decode(list(passage))
        table.put_records([ChunkRecord(chunk_id, CLIENT_DOC + salt, "", text, 0, len(text), passage)])
        self.spans.add(chunk_id, passage, salt)

    def _break_ids(self) -> frozenset[int]:
        with self._lock:
            if self._breaks is None:
                rust = self.tokenizer.backend_tokenizer  # one batched call: per-id decodes take a second
                vocab = range(rust.get_vocab_size(with_added_tokens=True))
                texts = rust.decode_batch([[i] for i in vocab], skip_special_tokens=False)
                self._breaks = frozenset(i for i, t in zip(vocab, texts, strict=True) if "\n" in t)
            return self._breaks
