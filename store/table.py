"""The KV table: the one surface the engine, the loaders and precompute read and write chunk KV through.

Three tables implement it whole, each subclassing `KVTable` (which supplies `get_layer` and `put_chunk` from the rest):

    kv.py                LocalKVTable   the LMDB `kv` database of a store directory
    remote/remote_kv.py  RemoteKVTable  one object per chunk on S3-compatible storage
    remote/cached_kv.py  CachedKVTable  a LocalKVTable as a bounded read-through tier in front of a RemoteKVTable

open.py chooses which one a store gets. Beside the protocol: what every table shares (a read layer, the missing
chunk's error, a shard, a chunk's encoding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from kvrag.errors import KvragError
from kvrag.store.codec import CorruptValue, DecodedKV, ValueHeader, checked_body, decode, encode
from kvrag.store.record import KVRecord, TokenIds

Layers = Sequence[tuple[np.ndarray, np.ndarray]]  # per layer: (K, V), each [T, kv_heads, head_dim]
Positions = np.ndarray | Sequence[np.ndarray] | None  # Keyformer subsets: one for all layers, or one per layer


class MissingChunk(KvragError):
    """The chunk has no complete KV in the store (never computed, or dropped by gc/repair)."""


@dataclass(frozen=True)
class Shard:
    """`--shard i/N`: this process computes the chunks whose id hashes to i modulo N (0 ≤ i < N)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise KvragError(f"shard {self.index}/{self.count}: need 0 <= i < N")

    @classmethod
    def parse(cls, text: str) -> Shard:
        try:
            i, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise KvragError(f"--shard takes i/N (e.g. 0/2), got {text!r}") from None
        return cls(i, n)

    def owns(self, chunk_id: str) -> bool:
        return xxhash.xxh3_64_intdigest(chunk_id.encode()) % self.count == self.index


@dataclass(frozen=True)
class RawLayer:
    """A stored value read but not yet decoded, with what the record says it must hold.

    Lets a loader thread do the read and hand decompression/dequantization to another step.
    """

    value: bytes
    codec: str
    shape: tuple[int, int, int]  # (kept tokens, kv_heads, head_dim)

    def decode(self, dtype: type | None = None, copy: bool = True) -> DecodedKV:
        """`copy=False`: an uncompressed value decodes to read-only views of `value`."""
        return decode(self.value, expect_codec=self.codec, expect_shape=self.shape, dtype=dtype, copy=copy)

    def body(self) -> tuple[ValueHeader, bytes | memoryview]:
        """The checked, decompressed payload and its header, not decoded (see codec.checked_body)."""
        return checked_body(self.value, expect_codec=self.codec, expect_shape=self.shape)


LayerRead = RawLayer | MissingChunk | CorruptValue  # one chunk's layer, or why it cannot be had


class KVTable(Protocol):
    """The KV of one (model fingerprint, codec) in a store; with a `variant`, its reduced (Keyformer) chunks of that
    name instead of the full ones. Every read is checked against the chunk's record: MissingChunk when the chunk is
    not complete, CorruptValue when it is damaged, the layer is out of range, or its token ids differ from the
    expected ones (a chunk id is a hash: a collision must never hand out another chunk's KV)."""

    model_fp: str
    codec: str
    variant: str
    compress: bool  # how new values are written (zstd or as they are); reads take either

    def has(self, chunk_id: str) -> bool:
        """Whether the chunk is complete here."""
        ...

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        """The ids (in the given order, of this shard only) that have no complete KV yet."""
        ...

    def record(self, chunk_id: str) -> KVRecord | None:
        ...

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        """One layer's value, checked, not decoded."""
        ...

    def layer_views(self, chunks: Sequence[tuple[str, TokenIds | None]], layer: int,
                    records: dict[str, KVRecord] | None = None) -> AbstractContextManager[list[LayerRead]]:
        """One layer of these (chunk id, expected token ids), each checked, its MissingChunk or CorruptValue in its
        place; the values stay valid inside the block (a local table's are views of its map). `records`: the
        chunks' records, kept across the layers of one load by a table that can use them."""
        ...

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        """(chunk id, record) of every healthy complete chunk."""
        ...

    def put_encoded(self, chunk_id: str, record: bytes, values: Sequence[bytes]) -> bool:
        """Store an encoded chunk (its record bytes and per-layer values) whole, never half; False when it was
        there (another writer finished it meanwhile)."""
        ...

    def delete_chunk(self, chunk_id: str) -> int:
        """Delete the chunk; how many entries went."""
        ...

    def claim(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> list[str]:
        """Those of the ids this process should compute: missing, and claimed by no other live writer."""
        ...

    def release(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> None:
        """Drop this owner's claims (e.g. on Ctrl-C, for chunks it will not finish)."""
        ...

    def get_layer(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None,
                  dtype: type | None = None) -> DecodedKV:
        """One layer's KV, checked; unpacks as `k, v` ([T, kv_heads, head_dim] each)."""
        return self.get_layer_raw(chunk_id, layer, expect_token_ids).decode(dtype)

    def put_chunk(self, chunk_id: str, token_ids: TokenIds, layers: Layers, positions: Positions = None) -> bool:
        """Encode and store every layer of a chunk and its record; False if it was already there.

        `positions` (a Keyformer subset): None (all tokens), one int array for every layer, or one per
        layer; each is [T_kept] or [T_kept, kv_heads] original token positions.
        """
        if self.has(chunk_id):
            return False  # skip the encoding (and an upload) too
        record, values = encode_chunk(token_ids, layers, positions, self.codec, self.compress)
        return self.put_encoded(chunk_id, record, values)


def check_request(chunk_id: str, record: KVRecord, layer: int, expect_token_ids: TokenIds | None) -> None:
    """The stored chunk must be the one asked for (a chunk id is a hash) and have the layer."""
    if expect_token_ids is not None and not record.matches(expect_token_ids):
        raise CorruptValue(f"chunk {chunk_id}: stored token ids differ from the expected ones")
    if not 0 <= layer < record.n_layers:
        raise CorruptValue(f"chunk {chunk_id} has {record.n_layers} layers, layer {layer} asked")


def read_or_error(read: Callable[[str, int, TokenIds | None], RawLayer | None], chunk_id: str, layer: int,
                  expect_token_ids: TokenIds | None) -> LayerRead | None:
    """`read`'s layer, or the chunk's MissingChunk or CorruptValue in its place (layer_views' items)."""
    try:
        return read(chunk_id, layer, expect_token_ids)
    except (MissingChunk, CorruptValue) as exc:
        return exc


def encode_chunk(token_ids: TokenIds, layers: Layers, positions: Positions, codec: str,
                 compress: bool) -> tuple[bytes, list[bytes]]:
    """A chunk's record bytes and per-layer values, checked: every layer one row per token (or per kept token, with
    positions: None, one array for every layer, or one per layer), one shape of heads."""
    if not layers:
        raise ValueError("a chunk needs at least one layer")
    n_tokens = len(token_ids)
    values, kept = [], []
    for i, ((k, v), pos) in enumerate(zip(layers, _positions_per_layer(positions, len(layers)), strict=True)):
        if pos is None and k.shape[0] != n_tokens:
            raise ValueError(f"layer {i}: K has {k.shape[0]} tokens, the chunk {n_tokens}")
        problem = None if pos is None else positions_problem(np.asarray(pos), n_tokens)
        if problem:
            raise ValueError(f"layer {i}: {problem}")
        if k.shape[1:] != layers[0][0].shape[1:]:
            raise ValueError(f"layer {i}: K shape {k.shape} differs from layer 0's {layers[0][0].shape}")
        values.append(encode(k, v, codec, pos, compress=compress))
        kept.append(k.shape[0])
    _, heads, dim = layers[0][0].shape
    return KVRecord.build(token_ids, heads, dim, kept, [len(v) for v in values]).to_bytes(), values


def positions_problem(positions: np.ndarray, n_tokens: int) -> str | None:
    """What is wrong with a reduced chunk's positions ([T_kept] or [T_kept, kv_heads] token indices), or None:
    they must rise strictly (per head) and lie in 0..n_tokens-1, so a loader can place each row at one spot."""
    if positions.size == 0:
        return None
    if positions.min() < 0 or positions.max() >= n_tokens:
        return f"positions outside 0..{n_tokens - 1}"
    if positions.shape[0] > 1 and not (np.diff(positions, axis=0) > 0).all():
        return "positions do not rise strictly"
    return None


def _positions_per_layer(positions: Positions, n_layers: int) -> list[np.ndarray | None]:
    if positions is None or isinstance(positions, np.ndarray):
        return [positions] * n_layers
    positions = list(positions)
    if len(positions) != n_layers:
        raise ValueError(f"{len(positions)} position arrays for {n_layers} layers")
    return positions
