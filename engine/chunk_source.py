"""Where a prompt's chunk KV comes from: the store, the memory tiers, or computed now (and written back).

A ChunkSource owns the store's KV table (checked against the model's manifest), the memory tiers (a TieredKVCache,
or none) and the chunks computed on the fly (written back between questions, replacing damaged ones). The prefiller
(engine/prefiller.py) asks it for a prompt's chunk refs and its exact prefix; the resident engine asks it what a
prompt will hold in the pool and how much of it is cached.

With memory tiers, a blend or reuse prompt first walks the knowledge tree: the chunks on its matched path are
reused exactly (they join the preamble as an exact prefix, never recomputed); below the first miss, each chunk's
stored KV comes from memory when a tier holds it, else from the store. After the answer, the chunks below the match
are cached as they stood in this prompt, and the chunks read from the store are kept in memory for the next question.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvrag.engine.prompt_reuse import PROMPT_TIER, Piece
from kvrag.errors import KvragError
from kvrag.load.layer_work import ChunkRef, CorruptChunk
from kvrag.model.prefill import LayerKV
from kvrag.model.runtime import Runtime
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.lead_in import ChunkPrefix, LeadIn, tokens_for, widest_window
from kvrag.precompute.lead_in import find as find_lead_in
from kvrag.precompute.plain import chunk_kv, keep_lead_in, layers_to_numpy
from kvrag.store.chunks import ChunkTable
from kvrag.store.codec import CorruptValue, stored_positions
from kvrag.store.env import StoreEnv
from kvrag.store.manifest import check_or_record, preamble_hash
from kvrag.store.open import RemoteOptions, store_table
from kvrag.store.table import MissingChunk
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import STORE as STORE_TIER
from kvrag.store.tiers.lease import as_layers
from kvrag.store.tiers.reorder import order_priority


class ChunkSource:
    """Chunk KV for one model: `env` the store (None: every chunk is computed), `codec` its values, `cache` the
    memory tiers (None: none), `compress` how write-backs are stored, `keep` reduced (Keyformer) chunks instead of
    full ones, `preamble` the preamble's KV (what a chunk computed now follows, with the store's lead-in for a
    sliding-window model; `lead_in` sets it instead of the store's, or for a source without a store)."""

    def __init__(self, runtime: Runtime, env: StoreEnv | None, preamble: LayerKV, codec: str = "fp16", cache=None,
                 compress: bool = True, keep: KeepConfig | None = None, remote: RemoteOptions | None = None,
                 lead_in: LeadIn | None = None):
        self.runtime, self.model, self.preamble = runtime, runtime.model, preamble
        # reduced chunks (Keyformer, `precompute --keep`): blend, reuse and prefix read that variant of the store
        self.keep = keep if keep is not None and keep.reduced else None
        if self.keep is not None and self.keep.per_layer:
            raise KvragError("questions read reduced chunks with one token set per chunk; a --keep-per-layer store "
                             "is for measurement only")
        self.cache = cache  # TieredKVCache or None: no memory tiers
        self._pending_cache: list = []  # (lease, rest chunks, per-layer rest KV, chunks not in memory, prefill s)
        self.env = env
        # the store holds a dense model's KV (precompute runs dense; the store is not keyed by weights form): chunks an
        # int8 or int4 engine computes are served from memory and never stored, so no dense reader takes them as exact
        self.stores = runtime.model.weights == "dense"
        self.table = None
        self.lead_in = None if self.keep is not None else lead_in  # reduced chunks follow the preamble alone
        self.window = widest_window(self.model.cfg)  # a chunk starting within it reads the form after the preamble
        self.near_table = None  # with a lead-in: the table of that form (the full chunks')
        self.form_reads = {"after_preamble": 0, "after_lead_in": 0}  # chunks read in each form (bench reports say)
        self._near_write_back: dict[str, tuple[Sequence[int], LayerKV, bool]] = {}  # computed now: ids, KV, damaged
        keeper = None  # stores the lead-in's KV once computed
        if env is not None:
            keeper = self._open_table(env, codec, compress, remote)
            keeper = keeper if self.stores else None  # (a lead-in computed here, likewise)
        # what a chunk computed here follows (precompute/lead_in.py)
        self.prefix = ChunkPrefix(self.model, runtime.ids_tensor, preamble, self.lead_in, keeper)
        # chunks computed on the fly, to store: (token ids, KV of the rows it holds, the kept tokens or None); the
        # engine's thread computes them, its write-back worker (engine/write_back.py) stores them
        self._write_back: dict[str, tuple[Sequence[int], LayerKV, np.ndarray | None]] = {}
        self._repair: set[str] = set()  # chunks whose stored values were damaged
        self._evicted: set[str] = set()  # kept passages evicted: a computed copy is not stored again
        self._lock = threading.Lock()  # the three above

    def _open_table(self, env: StoreEnv, codec: str, compress: bool, remote: RemoteOptions | None):
        """The store's table of this model's chunks: the reduced variant, the lead-in's (found in the store or chosen
        from its corpus, unless given), or the full chunks'. Returns what stores a lead-in's KV, or None."""
        runtime, preamble_text = self.runtime, self.runtime.prompts.template.preamble
        check_or_record(env, runtime.fingerprint, preamble_text, codec, tokenizer_fp=runtime.local.tokenizer_fingerprint)
        full = store_table(env, runtime.fingerprint, codec, compress, remote=remote)
        if self.keep is not None:
            self.table = store_table(env, runtime.fingerprint, codec, compress, self.keep.variant, remote=remote)
            return None
        if self.lead_in is None:
            self.lead_in = find_lead_in(full, preamble_hash(preamble_text), tokens_for(runtime), ChunkTable(env))
        if self.lead_in is None:
            self.table = full
        else:
            self.table = store_table(env, runtime.fingerprint, codec, compress, self.lead_in.variant, remote=remote)
            self.near_table = full
        return keep_lead_in(full, preamble_text)

    def chunk_refs(self, chunks: Sequence[tuple[str, Sequence[int]]], in_memory: Sequence[LayerKV | None] = (),
                   start: int | None = None, store: bool = True) -> tuple[list[ChunkRef], float]:
        """Refs for (chunk_id, token_ids); chunks missing from the store are computed now (and, with `store`,
        written back later). `in_memory[i]`: chunk i's stored KV already in a memory tier. `start`: the prompt position
        of the first chunk, where a lead-in's chunks are read (`near`: the form after the preamble).
        Returns the refs and the seconds spent computing missing chunks."""
        missing = set(self.table.missing([c for c, _ in chunks])) if self.table is not None else {c for c, _ in chunks}
        begin = time.perf_counter()
        refs, at = [], start
        for i, (chunk_id, ids) in enumerate(chunks):
            self._count_form(at)
            if at is not None and self.near(at):
                kv, read = self._near_kv(chunk_id, ids, store)
                refs.append(ChunkRef(chunk_id, ids, kv, read=read))
            elif i < len(in_memory) and in_memory[i] is not None:
                refs.append(ChunkRef(chunk_id, ids, in_memory[i]))
            elif chunk_id in missing or self.computed(chunk_id):
                kv, kept = self.compute_chunk(chunk_id, ids, store)
                refs.append(ChunkRef(chunk_id, ids, kv, kept))
            else:
                refs.append(ChunkRef(chunk_id, ids, kept=self._stored_kept(chunk_id, ids)))
            at = None if at is None else at + len(ids)
        return refs, time.perf_counter() - begin

    def forms(self) -> dict:
        """The forms this source's chunks are stored and read in (a bench report says which its figures came from)."""
        lead = 0 if self.lead_in is None else len(self.lead_in.ids)
        return {"stored": ["after_preamble", "after_lead_in"][:2 if lead else 1], "lead_in_tokens": lead,
                "window": self.window, "read": dict(self.form_reads)}

    def _count_form(self, position: int | None) -> None:
        near = self.lead_in is None or (position is not None and self.near(position))
        self.form_reads["after_preamble" if near else "after_lead_in"] += 1

    def near(self, position: int) -> bool:
        """Whether a chunk starting at `position` of a prompt reads the form stored after the preamble alone, where
        its chunks are stored after a lead-in too: it follows the preamble itself (that form is exact there), or its
        first rows' windows reach the prompt's start, as that form's did (precompute/lead_in.py)."""
        return self.lead_in is not None and (position == len(self.preamble) or position < self.window)

    def _near_kv(self, chunk_id: str, ids: Sequence[int], store: bool = True) -> tuple[LayerKV, bool]:
        """A chunk's KV as computed right after the preamble, and whether the store had it: read whole, else computed
        now (and with `store`, stored, or its damaged value replaced, at the next write-back)."""
        m = self.model
        try:
            layers = self._read_layers(chunk_id, ids, self.near_table)
        except (MissingChunk, CorruptValue) as exc:
            with self._lock:
                done = self._near_write_back.get(chunk_id)
            if done is None:
                done = (ids, chunk_kv(self.runtime, self.preamble, ids), isinstance(exc, CorruptValue))
                if store:
                    with self._lock:
                        self._near_write_back[chunk_id] = done
            return done[1], False
        k = [torch.from_numpy(d.k).to(m.device, m.dtype) for d in layers]  # [n, Hkv, hd] each
        v = [torch.from_numpy(d.v).to(m.device, m.dtype) for d in layers]
        return LayerKV(k, v, torch.arange(len(ids))), True

    def piece_refs(self, chunks: Sequence[tuple[str, Sequence[int]]], pieces: Sequence[Piece],
                   start: int | None = None) -> tuple[list[ChunkRef], list[str]]:
        """Refs for a plain prompt's pieces (engine/prompt_reuse.py), and where each one's KV came from: a whole
        stored chunk is read by the loader, part of one is read now and cut to its rows, and prompt text gets zeros
        (the blend computes it at every layer). `start`: the prompt position of the first piece, where a lead-in's
        chunks are read (a piece in the first window reads the form after the preamble, as chunk_refs does)."""
        m = self.model
        refs, tiers, at = [], [], start
        for (name, ids), piece in zip(chunks, pieces, strict=True):
            if piece.chunk_id is not None:
                self._count_form(at)
            if piece.chunk_id is None:
                zeros = torch.zeros(len(ids), m.cfg.n_kv_heads, m.cfg.head_dim, dtype=m.dtype, device=m.device)
                kv = LayerKV([zeros] * m.cfg.n_layers, [zeros] * m.cfg.n_layers, torch.arange(len(ids)))
                refs.append(ChunkRef(name, ids, kv))
                tiers.append(PROMPT_TIER)
            elif at is not None and self.near(at):
                whole, read = self._near_kv(piece.chunk_id, piece.stored)
                rows = slice(piece.offset, piece.offset + len(ids))
                refs.append(ChunkRef(name, ids, LayerKV([k[rows] for k in whole.k], [v[rows] for v in whole.v],
                                                        torch.arange(len(ids))), read=read))
                tiers.append(STORE_TIER if read else "computed")
            elif name == piece.chunk_id and self.table is not None and not self.table.missing([name]):
                refs.append(ChunkRef(name, ids))
                tiers.append(STORE_TIER)
            else:
                kv, tier = self._stored_rows(piece, len(ids))
                refs.append(ChunkRef(name, ids, kv))
                tiers.append(tier)
            at = None if at is None else at + len(ids)
        return refs, tiers

    def _stored_rows(self, piece: Piece, n: int) -> tuple[LayerKV, str]:
        """Rows offset .. offset+n of a stored chunk's KV (keys before rotary), and their tier: the store's, or
        computed now (not stored yet, or damaged: then stored, or repaired, at the next write-back)."""
        m, rows = self.model, slice(piece.offset, piece.offset + n)
        try:
            layers = self._read_layers(piece.chunk_id, piece.stored, self.table)
        except KvragError as exc:
            kv, _ = self.compute_chunk(piece.chunk_id, piece.stored)
            if not isinstance(exc, MissingChunk):
                with self._lock:
                    self._repair.add(piece.chunk_id)
            return LayerKV([k[rows] for k in kv.k], [v[rows] for v in kv.v], torch.arange(n)), "computed"
        k = [torch.from_numpy(d.k[rows]).to(m.device, m.dtype) for d in layers]  # [n, Hkv, hd] each
        v = [torch.from_numpy(d.v[rows]).to(m.device, m.dtype) for d in layers]
        return LayerKV(k, v, torch.arange(n)), STORE_TIER

    def _read_layers(self, chunk_id: str, ids: Sequence[int], table) -> list:
        """Every layer of a stored chunk, decoded, from `table` (MissingChunk without one)."""
        if table is None:
            raise MissingChunk(chunk_id)
        return [table.get_layer(chunk_id, layer, expect_token_ids=ids) for layer in range(self.model.cfg.n_layers)]

    def compute_chunk(self, chunk_id: str, ids: Sequence[int], store: bool = True) -> tuple[LayerKV, np.ndarray | None]:
        """A chunk's KV computed now (reduced, when the engine reads reduced chunks) and the tokens it keeps; with
        `store`, written to the store at the next write-back."""
        with self._lock:
            done = self._write_back.get(chunk_id)
        if done is not None:
            return done[1:]
        if self.keep is None:
            kv, kept = chunk_kv(self.runtime, self.prefix.prefix_for(ids), ids), None
        else:
            full, kept = keyformer.reduce_chunk(self.model, self.preamble, self.runtime.ids_tensor(list(ids)),
                                                self.keep, chunk_id)
            kv = keyformer.narrow(full, kept)
        if store:
            with self._lock:
                self._write_back[chunk_id] = (ids, kv, kept)
        return kv, kept

    def computed(self, chunk_id: str | None = None) -> bool:
        """Whether a chunk (None: any) was computed here and is not stored yet."""
        with self._lock:
            return bool(self._write_back) if chunk_id is None else chunk_id in self._write_back

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
        """After an answer: store the chunks computed on the fly, then fill the memory tiers."""
        written = self.store_computed()
        self.fill_cache()
        return written

    def store_computed(self, only: str | None = None) -> int:
        """Store the chunks computed on the fly (or the one chunk `only`), replacing damaged ones, one LMDB
        transaction each; what a kill interrupts is computed again when next asked for."""
        with self._lock:
            if only is not None:
                self._evicted.discard(only)  # kept again
            todo = [(c, *self._write_back[c], c in self._repair) for c in ([only] if only else list(self._write_back))
                    if c in self._write_back]
        written = 0
        for chunk_id, ids, kv, kept, repair in todo:
            with self._lock:
                skip = chunk_id in self._evicted
            if self.table is not None and not skip and self.stores:
                if repair:
                    self.table.delete_chunk(chunk_id)
                written += bool(self.table.put_chunk(chunk_id, ids, layers_to_numpy(kv, self.table.codec), kept))
            with self._lock:
                self._write_back.pop(chunk_id, None)
                self._repair.discard(chunk_id)
        return written + self._store_near()

    def _store_near(self) -> int:
        """Store the chunks' forms after the preamble computed on the fly (a lead-in's store), replacing damaged ones."""
        with self._lock:
            todo, self._near_write_back = self._near_write_back, {}
        written = 0
        for chunk_id, (ids, kv, damaged) in todo.items() if self.near_table is not None and self.stores else ():
            with self._lock:
                if chunk_id in self._evicted:
                    continue
            if damaged:
                self.near_table.delete_chunk(chunk_id)
            written += bool(self.near_table.put_chunk(chunk_id, ids, layers_to_numpy(kv, self.near_table.codec)))
        return written

    def evict(self, chunk_id: str) -> None:
        """Drop a kept passage's KV (its record gone first); a copy a prompt computes meanwhile is not stored."""
        with self._lock:
            self._evicted.add(chunk_id)
        for table in (self.table, self.near_table):  # both forms of a lead-in's store
            if table is not None:
                table.delete_chunk(chunk_id)

    def evicted_elsewhere(self, chunk_id: str) -> None:
        """A kept passage another process evicted (its record and KV gone there): a copy computed here is not stored."""
        with self._lock:
            self._evicted.add(chunk_id)

    def exact_prefix(self, lease) -> LayerKV:
        """The preamble, followed by the chunks on the lease's matched path (their KV as it stood)."""
        if lease is None or not lease.matched:
            return self.preamble
        dtype, pre = self.model.dtype, self.preamble
        layers = as_layers(self.cache.gather(lease.prefix, self.model.device))  # per layer K, V [n, Hkv, hd]
        return LayerKV([torch.cat([pre.k[i].to(dtype), k.to(dtype)]) for i, (k, _) in enumerate(layers)],
                       [torch.cat([pre.v[i].to(dtype), v.to(dtype)]) for i, (_, v) in enumerate(layers)],
                       torch.arange(len(pre) + layers[0][0].shape[0], device=self.model.device))

    def memory_kv(self, lease) -> list[LayerKV | None]:
        """Per chunk below the match: its stored KV from a memory tier, or None (read the store)."""
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

    def fill_cache(self) -> None:
        """After an answer: cache the prompts' chunks as blended, keep the stored KV of the chunks that
        were not in memory (read from the store, or computed and now written back) for the next question,
        and unpin."""
        dtype = getattr(torch, self.cache.layout.dtype) if self._pending_cache else None
        for lease, rest, rest_kv, not_in_memory, prefill_s in self._pending_cache:
            try:
                bounds = itertools.accumulate((len(ids) for _, ids in rest), initial=0)  # each chunk's rows
                per_chunk = [[(k[a:b].to("cpu", dtype), v[a:b].to("cpu", dtype)) for k, v in rest_kv]
                             for a, b in itertools.pairwise(bounds)]
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
        try:
            layers = self._read_layers(chunk_id, ids, self.table)
        except KvragError:
            return None  # damaged or gone: the next question reads (and repairs) it through the loader
        dtype = getattr(torch, self.cache.layout.dtype)
        return [(torch.from_numpy(d.k).to(dtype), torch.from_numpy(d.v).to(dtype)) for d in layers]

    def repair(self, chunk_id: str, ids: Sequence[int]) -> None:
        """A stored chunk failed a check: compute it now, and replace it in the store at the next write-back."""
        self.compute_chunk(chunk_id, ids)
        with self._lock:
            self._repair.add(chunk_id)

    # ---- memory tiers: leases ---------------------------------------------------------------

    def acquire(self, chunks: Sequence[tuple[str, Sequence[int]]], suffix_len: int):
        """A lease on the knowledge tree's path for these chunks (None without tiers, or for reduced chunks: the
        tiers hold full ones)."""
        if self.cache is None or self.keep is not None:
            return None
        return self.cache.acquire([c for c, _ in chunks], [len(ids) for _, ids in chunks], suffix_len)

    def release(self, lease) -> None:
        if lease is not None:
            self.cache.release(lease)

    def keep_for_later(self, lease, rest, rest_kv, not_in_memory, prefill_s: float) -> None:
        """Cache a prompt's chunks as blended once its answer is out (at the next flush_write_back)."""
        self._pending_cache.append((lease, rest, rest_kv, not_in_memory, prefill_s))

    # ---- what the resident engine asks -------------------------------------------------------

    def dropped_rows(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Prompt tokens with no row in the pool: those the stored reduced chunks left out (Keyformer), by their
        records; a chunk not stored yet counts whole (an upper bound: it is computed, then reduced)."""
        if self.keep is None or self.table is None:
            return 0
        records = (self.table.record(chunk_id) for chunk_id, _ in chunks)
        return sum(len(ids) - r.kept[0] for (_, ids), r in zip(chunks, records, strict=True)
                   if r is not None and r.kept[0] <= len(ids))

    def order_priority(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> float:
        """RAGCache's order: tokens whose KV the memory tiers hold per token to compute (no tiers: all equal)."""
        if self.cache is None:
            return 0.0
        cached, compute = self.cache.peek([c for c, _ in chunks], [len(ids) for _, ids in chunks])
        return order_priority(cached, compute)
