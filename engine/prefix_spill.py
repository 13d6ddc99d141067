"""The pool's prefix cache backed by the store (issue 72): what a conversation has computed outlives the process and
is found by every replica on the same store.

Every exact whole block the pool caches (a prompt's, a finished turn's) is copied out once on the engine's thread (its
rows, one small copy) and written by the write-back worker into the store's prefix table (store/prefix_table.py); a
kill loses what was queued, never a block half written. A prompt whose leading blocks the pool lacks looks for the
next ones in the table: those found go into fresh pool blocks and into the prefix cache, exact, and the prompt goes on
as a pool hit (engine/conversations.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvrag.engine.plans import KeptTurn
from kvrag.kvcache.allocator import OutOfBlocks
from kvrag.kvcache.prefix_cache import block_keys
from kvrag.store.prefix_table import PrefixTable, scope_of

TURN = "turn-"  # a kept turn's record among the blocks (its value JSON: ids, chunks, exact rows)
KNOWN_KEYS = 1 << 16  # keys known to be in the table: not copied out again (an LRU of them)


class PrefixSpill:
    """One engine's prefix table. `kv`: its SequenceKV (engine/kv_pool.py); `write`: hands a job to the write-back
    worker (False: its queue is full, the blocks are offered again at their next caching)."""

    def __init__(self, kv, table: PrefixTable, write: Callable[[Callable[[], None]], bool]):
        self.kv, self.table, self.write = kv, table, write
        self.block = kv.block_size
        self._known: OrderedDict[str, None] = OrderedDict()
        self.saved = self.restored = 0  # blocks handed to the worker, and read back into the pool

    @classmethod
    def open(cls, kv, runtime, source, bound: int, write) -> PrefixSpill | None:
        """The spill of an engine over `source`'s store (engine/chunk_source.py; none or read-only: none), at most
        `bound` bytes (0: none), scoped to what makes the pool's bits: the model, dtype, device, weights form, kernels
        and block size. A store on object storage shares the table through its bucket (its table's `objects`)."""
        env, objects = source.env, getattr(source.table, "objects", None)
        if not bound or env is None or env.readonly:
            return None
        m = runtime.model
        scope = scope_of(runtime.fingerprint, m.dtype, m.device.type, m.weights, m.native, m.triton, kv.block_size)
        table = PrefixTable(env, scope, bound)
        if objects is not None:
            # imported here: it imports obstore, which a local store never needs
            from kvrag.store.remote.prefix_objects import SharedPrefixTable

            table = SharedPrefixTable(table, objects)
        return cls(kv, table, write)

    def save(self, ids: Sequence[int], blocks: Sequence[int], salt: str, exact_rows: int) -> None:
        """The exact whole blocks of a sequence whose rows 0.. are `ids` in `blocks`, not in the table yet: copied out
        now, written by the worker."""
        keys = block_keys(ids, self.block, salt)[:min(len(blocks), exact_rows // self.block)]
        new = [i for i, key in enumerate(keys) if key not in self._known]
        if not new:
            return
        index = torch.tensor([blocks[i] for i in new], device=self.kv.pool.kv.device)
        rows = self.kv.pool.kv.index_select(2, index).cpu()  # [L, 2, n, B, Hkv, hd]: the worker's own copy
        names = [keys[i] for i in new]
        table = self.table

        def job() -> None:
            table.put((name, _block_bytes(rows, j)) for j, name in enumerate(names))

        if self.write(job):
            self._remember(names)
            self.saved += len(names)

    def restore(self, ids: Sequence[int], salt: str) -> int:
        """Where the table holds blocks after the pool's exact leading ones, read them into the pool and cache them
        (exact); how many. Nothing when the pool has no room for them (evicting cached blocks no sequence holds)."""
        prefix = self.kv.prefix
        if not prefix.max_blocks:  # caching off: nothing restored would stay
            return 0
        keys = block_keys(ids, self.block, salt)
        hit, n_exact = prefix.match(ids, salt, exact=True)
        have = n_exact // self.block
        found = self.table.leading(keys[have:]) if have < len(keys) else []
        if not found:
            self.kv.release(hit)
            return 0
        try:
            fresh = self.kv.allocate(len(found))
        except OutOfBlocks:
            self.kv.release(hit)
            return 0
        pool = self.kv.pool.kv  # [L, 2, N, B, Hkv, hd]
        shape = (pool.shape[0], 2, 1, *pool.shape[3:])
        for block, rows in zip(fresh, found, strict=True):
            pool[:, :, block:block + 1].copy_(torch.frombuffer(bytearray(rows), dtype=pool.dtype).view(shape))
        end = (have + len(found)) * self.block
        prefix.insert(ids[:end], hit[:have] + fresh, salt, end)
        self.kv.release(hit + fresh)  # the cache holds its own references now
        names = keys[have:have + len(found)]
        self._remember(names)
        self.write(lambda: self.table.used(names))
        self.restored += len(found)
        return len(found)

    def save_turn(self, key: str, turn: KeptTurn) -> None:
        """A kept turn's ids (engine/plans.py), so that a later life renders its history to the same ids as this one
        (re-tokenized, a model's answer need not give back the ids it said)."""
        record = json.dumps({"ids": list(turn.ids), "chunks": sorted(turn.chunk_ids), "exact": turn.exact_rows})
        self.write(lambda: self.table.put([(TURN + key, record.encode())]))

    def load_turn(self, key: str) -> KeptTurn | None:
        found = self.table.leading([TURN + key])
        if not found:
            return None
        record = json.loads(found[0])
        return KeptTurn(tuple(record["ids"]), frozenset(record["chunks"]), record["exact"])

    def _remember(self, names: Sequence[str]) -> None:
        for name in names:
            self._known[name] = None
            self._known.move_to_end(name)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)


def _block_bytes(rows: torch.Tensor, j: int) -> bytes:
    """Block j of rows [L, 2, n, B, Hkv, hd] as its raw bytes (the pool's dtype, viewed as bytes: bf16 has no numpy
    twin)."""
    return rows[:, :, j].contiguous().view(torch.uint8).numpy().tobytes()
