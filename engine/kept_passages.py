"""New passages kept: the passage-like text of clients' prompts that the store lacks, stored at its second sighting.

A plain prompt's text outside its stored spans is cut by prompt_reuse.Paragraphs (at line breaks and tags' brackets);
a run of PASSAGE_TOKENS or more is a passage (a retrieved document an application pasted in), anything shorter a
template's glue. Each passage the prompt had to compute is counted by its ids and its tenant's salt; one the prefix
cache served (a conversation's history, a prompt sent again) is not: its KV is in the pool already, and counting it
would store every chat turn. A one-off passage is never stored (one-off prompts would flood the store and push
nothing useful in: LMCache's non-prefix hit rate decays for that reason); the second sighting stores it, its KV
computed as precompute computes a chunk's, keyed by the salt, so the third is a hit. The tokens kept this way are
bounded (`kept_passages`), those of earlier runs included; when a new passage does not fit, the least valuable kept
ones make room, by RAGCache's PGDSF as the memory tiers rank chunks: clock + uses x seconds a token to compute, the
clock rising to each evicted passage's value. A passage of an earlier run that this one has not used is worth the
clock alone. The corpus is never pushed out. `kvrag store stats` counts kept passages,
`kvrag store gc --client-passages` drops them.

The write-back worker (engine/write_back.py) computes and stores a kept passage off the engine's thread, one LMDB
transaction for its KV, then its chunk record, marked as a client's (doc id "client:<salt>"), so a record never names
KV that is not there; an evicted passage loses its index entry and record before its KV.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.engine.prompt_reuse import Paragraphs, Piece, PromptSpans
from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable, chunk_id_for
from kvrag.store.tiers.policies import PGDSF, AccessStats

SIGHTINGS_KEPT = 65536  # passages counted at once (least recently seen forgotten first)


def client_chunk_id(ids: Sequence[int], tokenizer_fp: str, salt: str) -> str:
    """A kept passage's content address: its ids under the tokenizer and the tenant's salt (two tenants sending the
    same passage keep two copies, so neither learns from the other's timing that it was sent)."""
    return chunk_id_for(ids, f"{tokenizer_fp}\0client\0{salt}")


@dataclass
class KeeperStats:
    sighted: int = 0  # passage-like segments seen in plain prompts
    admitted: int = 0  # to be stored, at a second sighting
    refused: int = 0  # seen again, but longer than the whole bound or the write-back's queue full
    evicted: int = 0  # kept passages dropped to make room
    kept_tokens: int = 0  # tokens stored this way by this process


class PassageKeeper:
    """Counts and admits one engine's client passages (see the module doc); `bound_tokens` 0 keeps none."""

    def __init__(self, spans: PromptSpans, tokenizer, tokenizer_fp: str, bound_tokens: int,
                 paragraphs: Paragraphs | None = None):
        self.spans, self.tokenizer, self.tokenizer_fp = spans, tokenizer, tokenizer_fp
        self.bound_tokens = bound_tokens
        self.paragraphs = paragraphs or Paragraphs(tokenizer)  # the engine's planner's: one rule, built once
        self.stats = KeeperStats()
        self._seen: OrderedDict[str, int] = OrderedDict()  # client chunk id: sightings
        self._policy = PGDSF()
        self._value: dict[str, tuple[AccessStats, float]] = {}  # kept passages' use and priority (this process's)
        self._clock = 0.0  # PGDSF's: the priority of the last passage evicted
        self._cost, self._costs = 0.0, 0  # seconds a token: the mean over the passages computed here (what an earlier
        # run's kept passage is taken to be worth)
        self._tick = 0
        self._lock = threading.Lock()

    def passages(self, plan_pieces: Sequence[Piece] | None, chunks, head: Sequence[int], tail: Sequence[int],
                 cached: int = 0) -> list[tuple[int, ...]]:
        """The passages a prompt computed (Paragraphs' runs, that much of them computed): in its head past the
        `cached` tokens the prefix cache served (a conversation's history, a prompt seen before: the pool has their
        KV), between its stored spans, in its tail."""
        regions = [(tuple(head), cached), (tuple(tail), 0)]
        if plan_pieces is not None:
            regions += [(tuple(c), 0) for (_, c), p in zip(chunks, plan_pieces, strict=True) if p.chunk_id is None]
        return [region[a:b] for region, skip in regions for a, b in self.paragraphs.runs(region, skip)]

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
            if len(passage) > self.bound_tokens:  # no room to make
                self.stats.refused += 1
                return None
            self.stats.admitted += 1
            return chunk_id

    def not_queued(self, chunk_id: str) -> None:
        """An admitted passage the write-back could not take: its next sighting offers it again."""
        with self._lock:
            self.stats.admitted -= 1
            self.stats.refused += 1
            self._seen[chunk_id] = 1

    def used(self, chunk_ids: Sequence[str | None]) -> None:
        """A prompt read these stored spans: the kept passages among them gain value."""
        kept = self.spans.kept_passages()
        with self._lock:
            for chunk_id in chunk_ids:
                if chunk_id in kept:
                    self._access(chunk_id, kept[chunk_id][1])

    def make_room(self, tokens: int, salt: str = "") -> list[str]:
        """Kept passages to evict, least valuable first, so that `tokens` more of tenant `salt`'s fit the bound (the
        store's, earlier runs' included); the clock rises to the last one's priority. Only the passages of tenants
        holding more than an equal share of the bound go (the newcomer's counted in): one tenant sending passages
        after passages evicts its own, never the others' within their share."""
        kept = self.spans.kept_passages()
        held = sum(n for _, n in kept.values())
        usage: dict[str, int] = {salt: tokens}
        for owner, n in kept.values():
            usage[owner] = usage.get(owner, 0) + n
        share = self.bound_tokens / len(usage)
        victims = []
        with self._lock:
            for gone in self._value.keys() - kept.keys():  # evicted by another process (the store's log said so)
                del self._value[gone]
            order = sorted(kept, key=lambda c: (self._value[c][1], self._value[c][0].last_access)
                           if c in self._value else (0.0, -1))  # an earlier run's, unused since: the clock alone
            for chunk_id in order:
                if held + tokens <= self.bound_tokens:
                    break
                owner, n = kept[chunk_id]
                if usage[owner] <= share:
                    continue  # within its share: kept
                held, usage[owner] = held - n, usage[owner] - n
                self._clock = max(self._clock, self._value.pop(chunk_id, (None, 0.0))[1])
                victims.append(chunk_id)
                self._seen[chunk_id] = 1  # seen once: its next sighting is a second one, which stores it again
            self.stats.evicted += len(victims)
        return victims

    def recorded(self, table: ChunkTable, chunk_id: str, passage: tuple[int, ...], salt: str,
                 seconds_per_token: float) -> None:
        """After its KV is stored: the passage's record, the index entry that makes its next sighting a hit, and its
        value (its two sightings, the measured cost of computing it)."""
        text = self.tokenizer.decode(list(passage))
        table.put_records([ChunkRecord(chunk_id, CLIENT_DOC + salt, "", text, 0, len(text), passage)])
        self.spans.add(chunk_id, passage, salt)
        with self._lock:
            self.stats.kept_tokens += len(passage)
            self._costs += 1
            self._cost += (seconds_per_token - self._cost) / self._costs
            stats = AccessStats(len(passage))
            stats.record_compute(seconds_per_token)
            self._value[chunk_id] = (stats, 0.0)
            for _ in range(2):
                self._access(chunk_id, len(passage))

    def _access(self, chunk_id: str, tokens: int) -> None:
        """One use of a kept passage, its priority set with the clock now (under the lock)."""
        self._tick += 1
        stats, _ = self._value.get(chunk_id, (AccessStats(tokens), 0.0))
        if not stats.cost_count:  # kept by an earlier run: what computing a passage costs here
            stats.solo_cost = self._cost
        stats.record_access(self._tick)
        self._value[chunk_id] = (stats, self._policy.priority(stats, self._clock))
