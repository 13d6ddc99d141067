"""Block bookkeeping of one memory tier, in plain Python (PagedAttention's allocator, no torch).

A tier is a fixed number of equal blocks; a chunk's KV is a block table (block ids, token count).
Any free block serves any request, so the pool never fragments. Blocks carry reference counts: a
block referenced by several tables (chunks sharing identical KV, a fork being blended) is freed when
the last reference goes, and is copied before anyone writes to it (copy-on-write, done by the pool).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrag.errors import KvragError

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
CODEC_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "int8": "float16"}  # int8 dequantizes into fp16
DEFAULT_BLOCK_TOKENS = 16


class OutOfBlocks(Exception):
    """Not enough free blocks; the cache evicts and retries, so users never see this."""


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one block: `block_size` tokens × all layers × K and V × KV heads × head dim."""

    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if min(self.n_layers, self.kv_heads, self.head_dim, self.block_size) < 1:
            raise KvragError(f"block layout needs positive sizes, got {self}")
        if self.dtype not in DTYPE_BYTES:
            raise KvragError(f"cache dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")

    @classmethod
    def for_codec(cls, n_layers: int, kv_heads: int, head_dim: int, codec: str = "fp16",
                  block_size: int = DEFAULT_BLOCK_TOKENS) -> BlockLayout:
        """The layout that holds what the store's codec decodes to."""
        if codec not in CODEC_DTYPES:
            raise KvragError(f"unknown codec {codec!r} (choose {', '.join(CODEC_DTYPES)})")
        return cls(n_layers, kv_heads, head_dim, CODEC_DTYPES[codec], block_size)

    @property
    def bytes_per_token(self) -> int:
        """2 (K, V) × layers × KV heads × head dim × dtype size: 23,040 B for SmolLM2-135M in fp16."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)


@dataclass(eq=False)
class BlockTable:
    """One chunk's KV in a tier: token t lives in block `blocks[t // block_size]`, slot `t % block_size`."""

    blocks: list[int]
    n_tokens: int
    block_size: int = DEFAULT_BLOCK_TOKENS
    freed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_tokens < 1 or len(self.blocks) != -(-self.n_tokens // self.block_size):
            raise ValueError(f"{len(self.blocks)} blocks cannot hold exactly {self.n_tokens} tokens "
                             f"of {self.block_size} per block")

    def slots(self) -> list[int]:
        """The flat slot (block * block_size + offset) of every token, in order."""
        b = self.block_size
        return [self.blocks[t // b] * b + t % b for t in range(self.n_tokens)]

    def blocks_of(self, rows: Iterable[int]) -> list[int]:
        """Indices into `blocks` of the blocks holding the given token rows."""
        return sorted({r // self.block_size for r in rows})


class BlockAllocator:
    """Free list and reference counts of `num_blocks` blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are handed out first
        self._refs = [0] * num_blocks
        # blocks a cache holds a reference on (kvcache/prefix_cache.py), and how many of them nothing else holds:
        # what the cache could give back, counted as references change rather than by a scan
        self._cached = [False] * num_blocks
        self.cached_alone = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with reference count 1; OutOfBlocks (and nothing taken) when fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is free; only a held block can be shared")
            self.cached_alone -= self._cached[b] and self._refs[b] == 1
            self._refs[b] += 1

    def mark_cached(self, block: int, cached: bool) -> None:
        """Say that a cache holds (or no longer holds) one of the block's references: a held block's reference
        taken by the cache just before, or given back just after."""
        if self._refs[block] < 1 or self._cached[block] == cached:
            raise ValueError(f"block {block}: cached is {self._cached[block]} with {self._refs[block]} references")
        self._cached[block] = cached
        self.cached_alone += (1 if cached else -1) * (self._refs[block] == 1)

    def is_cached(self, block: int) -> bool:
        return self._cached[block]

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is already free (double free)")
            self._refs[b] -= 1
            self.cached_alone += self._cached[b] and self._refs[b] == 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def check(self) -> None:
        """Assert the invariants: every block is either free (count 0, listed once) or held (count ≥ 1)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is listed free twice"
        for b, refs in enumerate(self._refs):
            assert (refs == 0) == (b in free), f"block {b}: {refs} references, free={b in free}"
            assert not (self._cached[b] and refs == 0), f"block {b} is free yet cached"
        alone = sum(1 for b, refs in enumerate(self._refs) if self._cached[b] and refs == 1)
        assert alone == self.cached_alone, f"{self.cached_alone} cached blocks counted alone, {alone} are"
