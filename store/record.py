"""The KV record of a chunk: written last in a chunk's transaction, it is the chunk's "complete" mark.

    header (24 bytes, little-endian): magic b"KVRC", version, flags (0), n_layers (u16), n_tokens (u32),
        kv_heads (u16), head_dim (u16), checksum (u64: xxh3-64 of the header's first 16 bytes + body)
    body: tokens kept per layer (u32 × n_layers), value bytes per layer (u32 × n_layers),
          the chunk's token ids (u32 × n_tokens)

The token ids let a reader prove that a stored chunk is the one it asked for (a chunk id is a hash);
the per-layer counts and sizes let `verify` check every value's shape and length against the record.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvrag.store.codec import CorruptValue

TokenIds = Sequence[int] | np.ndarray  # a chunk's token ids, as the indexer stored them

MAGIC = b"KVRC"
VERSION = 1
_HEADER = struct.Struct("<4sBBHIHHQ")
HEADER_SIZE = _HEADER.size  # 24


@dataclass(frozen=True)
class KVRecord:
    token_bytes: bytes  # u32 little-endian token ids; kept as bytes so records stay cheap to scan
    kv_heads: int
    head_dim: int
    kept: tuple[int, ...]  # tokens stored per layer (n_tokens unless a Keyformer subset)
    value_sizes: tuple[int, ...]  # bytes of each layer's value

    def __post_init__(self) -> None:
        if len(self.kept) != len(self.value_sizes) or not self.kept:
            raise ValueError("a record needs one kept count and one value size per layer (at least one layer)")

    @classmethod
    def build(cls, token_ids: TokenIds, kv_heads: int, head_dim: int, kept: Sequence[int],
              value_sizes: Sequence[int]) -> KVRecord:
        return cls(token_id_bytes(token_ids), kv_heads, head_dim, tuple(map(int, kept)),
                   tuple(map(int, value_sizes)))

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, dtype="<u4")  # [n_tokens], read-only view

    @property
    def n_tokens(self) -> int:
        return len(self.token_bytes) // 4

    @property
    def n_layers(self) -> int:
        return len(self.kept)

    @property
    def total_bytes(self) -> int:
        return sum(self.value_sizes)

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        return (self.kept[layer], self.kv_heads, self.head_dim)

    def matches(self, token_ids: TokenIds) -> bool:
        return self.token_bytes == token_id_bytes(token_ids)

    def to_bytes(self) -> bytes:
        body = (np.asarray(self.kept, dtype="<u4").tobytes() + np.asarray(self.value_sizes, dtype="<u4").tobytes()
                + self.token_bytes)
        head = _HEADER.pack(MAGIC, VERSION, 0, self.n_layers, self.n_tokens, self.kv_heads, self.head_dim, 0)
        return head[:-8] + _checksum(head, body).to_bytes(8, "little") + body

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVRecord:
        """Parse a record; CorruptValue on any mismatch."""
        if len(raw) < HEADER_SIZE:
            raise CorruptValue(f"chunk record is {len(raw)} bytes, shorter than its header")
        magic, version, _flags, n_layers, n_tokens, heads, dim, checksum = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise CorruptValue(f"bad chunk record magic/version {magic!r}/{version}")
        body = bytes(raw[HEADER_SIZE:])
        if len(body) != 8 * n_layers + 4 * n_tokens:
            raise CorruptValue(f"chunk record body is {len(body)} bytes, header implies {8 * n_layers + 4 * n_tokens}")
        if _checksum(bytes(raw[:HEADER_SIZE]), body) != checksum:
            raise CorruptValue("chunk record checksum mismatch")
        counts = np.frombuffer(body[: 8 * n_layers], dtype="<u4").tolist()
        return cls(body[8 * n_layers :], heads, dim, tuple(counts[:n_layers]), tuple(counts[n_layers:]))


def token_id_bytes(token_ids: TokenIds) -> bytes:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= 1 << 32)):
        raise ValueError("token ids must be a 1-D sequence of integers in [0, 2**32)")
    return ids.astype("<u4").tobytes()


def _checksum(header: bytes, body: bytes) -> int:
    digest = xxhash.xxh3_64()
    digest.update(header[: HEADER_SIZE - 8])
    digest.update(body)
    return digest.intdigest()
