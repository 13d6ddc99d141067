"""One chunk as one object: a small header, the chunk's KVRecord, then every layer's value in layer order.

    header (12 bytes, little-endian): magic b"KVRO", format version (u8), 3 reserved bytes, record length (u32)
    record: the KVRecord bytes, as in the local store (its own xxh3 checksum; the token ids and, per layer,
            the kept tokens and the value's length, so layer i starts at header + record + Σ lengths before i)
    values: layer 0 .. L-1, each a codec value (store/codec.py: a 40-byte header with its own xxh3 checksum)

The object's size must be exactly header + record + Σ lengths, so a truncated object fails before any value is
read; a flipped byte fails the record's checksum or the value's. Since the layers lie in layer order, a reader can
take any run of them with one ranged GET: the cache tier's first GET of a chunk takes the index and its first
layers together (`index_bytes` predicts where they end), the next ones a few layers each (ranged.py).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvrag.store.codec import HEADER_SIZE as VALUE_HEADER_SIZE
from kvrag.store.codec import CorruptValue, _checksum, read_header
from kvrag.store.record import HEADER_SIZE as RECORD_HEADER_SIZE
from kvrag.store.record import KVRecord

MAGIC = b"KVRO"
VERSION = 1
_HEAD = struct.Struct("<4sB3xI")
HEAD_SIZE = _HEAD.size  # 12
INDEX_PROBE = 16 << 10  # the first ranged GET: a record of up to ~3.9k tokens (32 layers) fits in it
FIRST_RANGE = 1 << 20  # a cache tier's first GET of a chunk whose size nothing predicts: its index and some layers
FIRST_MIN = 256 << 10  # a GET this small costs about its round trip: a first one reaches at least this far
MARGIN = 1.25  # values compress unevenly: overshoot the prediction (the extra bytes are the next layer's, used)


def pack_chunk(record: bytes, values: Sequence[bytes]) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, len(record)) + record + b"".join(values)


@dataclass(frozen=True)
class ChunkIndex:
    """What a chunk object's head says: its record, where each layer lies, and the object it was read from."""

    record: KVRecord
    record_bytes: bytes
    size: int  # the object's size in bytes
    etag: str | None  # ranged reads ask If-Match this, so a replaced object is never read against a stale index

    @property
    def data_start(self) -> int:
        return HEAD_SIZE + len(self.record_bytes)

    def layer_starts(self) -> list[int]:
        """Where each layer's value starts in the object, and where the last one ends (n_layers + 1 offsets)."""
        starts = [self.data_start]
        for size in self.record.value_sizes:
            starts.append(starts[-1] + size)
        return starts

    def layer_range(self, layer: int) -> tuple[int, int]:
        """[start, end) of the layer's value in the object."""
        start = self.data_start + sum(self.record.value_sizes[:layer])
        return start, start + self.record.value_sizes[layer]


def index_bytes(n_tokens: int, n_layers: int) -> int:
    """Bytes of header + record for a chunk of n_tokens tokens and n_layers layers (record.py's layout)."""
    return HEAD_SIZE + RECORD_HEADER_SIZE + 8 * n_layers + 4 * n_tokens


def index_length(head: bytes) -> int:
    """Bytes of header + record, from the object's first bytes; CorruptValue when they are not a chunk object."""
    if len(head) < HEAD_SIZE:
        raise CorruptValue(f"object is {len(head)} bytes, shorter than its {HEAD_SIZE}-byte header")
    magic, version, record_len = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise CorruptValue(f"chunk object format version {version}, this kvrag reads {VERSION}")
    return HEAD_SIZE + record_len


def parse_index(head: bytes, size: int, etag: str | None) -> ChunkIndex:
    """The index of an object of `size` bytes whose first index_length(head) bytes are `head`."""
    end = index_length(head)
    if end > size or len(head) < end:
        raise CorruptValue(f"object is {size} bytes, its record ends at byte {end} (truncated?)")
    record_bytes = bytes(head[HEAD_SIZE:end])
    index = ChunkIndex(KVRecord.from_bytes(record_bytes), record_bytes, size, etag)
    expected = index.data_start + index.record.total_bytes
    if size != expected:
        raise CorruptValue(f"object is {size} bytes, its record says {expected} (truncated?)")
    return index


def check_value(value: bytes, codec: str, shape: tuple[int, int, int]) -> None:
    """A layer's value must pass its checksum and hold the codec and shape its record says; CorruptValue if not.
    (The checksum alone, not the zstd payload: a whole chunk is checked before a cache keeps it.)"""
    head = read_header(value)
    if _checksum(bytes(value[:VALUE_HEADER_SIZE]), memoryview(value)[VALUE_HEADER_SIZE:]) != head.checksum:
        raise CorruptValue("checksum mismatch")
    if head.codec != codec or head.shape != tuple(shape):
        raise CorruptValue(f"value holds {head.codec} {head.shape}, the record says {codec} {tuple(shape)}")


class SizeHint:
    """Predicts how far a chunk's first GET should reach: value bytes per kept token and layer, and the layer
    count, averaged over the records seen (the local tier's at start, then every index read)."""

    def __init__(self):
        self.per_token = 0.0
        self.n_layers = 0
        self._seen = 0
        self._lock = threading.Lock()

    def observe(self, record: KVRecord) -> None:
        per_token = max(size / max(kept, 1) for kept, size in zip(record.kept, record.value_sizes, strict=True))
        with self._lock:
            self._seen += 1
            self.per_token += (per_token - self.per_token) / self._seen
            self.n_layers = max(self.n_layers, record.n_layers)

    def first_range(self, n_tokens: int | None, layers: int) -> int:
        """Bytes from the object's start to past its first `layers` layers (FIRST_MIN at least), or FIRST_RANGE
        when unknown."""
        if n_tokens is None or not self.per_token:
            return FIRST_RANGE
        values = layers * (VALUE_HEADER_SIZE + self.per_token * n_tokens) * MARGIN
        return max(FIRST_MIN, int(index_bytes(n_tokens, self.n_layers) + values))
