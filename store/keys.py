"""Content-addressed keys of the `kv` database, as small frozen dataclasses (LMCache `CacheEngineKey` style).

Byte layout, chosen so that plain byte order groups what scans need together:

    len(model_fp) model_fp  codec_id  [len(variant) variant]  len(chunk_id) chunk_id  tag [layer]
    `-- model prefix ------------------------------------'                      |
    `-- chunk prefix ------------------------------------------------------------'

tag b"C" = claim, b"L" + u16 big-endian layer = one layer's KV, b"R" = the chunk record. Lengths are one
byte, so no id can be a prefix of another; all layers of a chunk sit together, in layer order, followed
by its record; all chunks of one (model, codec, variant) form one contiguous range.

A variant is a reduced (Keyformer) form of the chunks, e.g. "keyformer:keep=0.5:...", or the full chunks of a
sliding-window model computed after a lead-in, "lead:<hash>" (precompute/lead_in.py). It is a codec-like
qualifier: full chunks (variant "") keep the original key bytes, and a variant sets the codec byte's high bit
(VARIANT_BIT) and follows it, so stores written before variants existed read unchanged, a reader of full chunks
never meets a reduced one (another key range), and one store holds both side by side, as it holds two codecs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvrag.errors import KvragError

CODEC_IDS = {"fp16": 1, "bf16": 2, "int8": 3}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
PREAMBLE_PREFIX = "~preamble:"  # reserved chunk ids; `~` never occurs in the indexer's hex ids
LEAD_IN_SUFFIX = ":lead-in"
LEAD_IN_VARIANT = "lead:"  # + the lead-in's hash: full chunks computed after a lead-in (precompute/lead_in.py)

TAG_CLAIM, TAG_LAYER, TAG_RECORD = b"C", b"L", b"R"
MAX_LAYERS = 1 << 16
VARIANT_BIT = 0x80  # on the codec byte: a length-prefixed variant follows (codec ids stay below it)


def _lp(text: str, what: str) -> bytes:
    """Length-prefixed UTF-8 bytes (one length byte)."""
    raw = text.encode()
    if not 0 < len(raw) < 256:
        raise ValueError(f"{what} must be 1..255 bytes of UTF-8, got {len(raw)}: {text[:40]!r}")
    return bytes([len(raw)]) + raw


class UnknownCodec(KvragError, ValueError):
    """A codec name that is not one of CODEC_IDS (usually a user's --codec: hence a KvragError)."""


def codec_id(codec: str) -> int:
    if codec not in CODEC_IDS:
        raise UnknownCodec(f"unknown codec {codec!r} (choose {', '.join(CODEC_IDS)})")
    return CODEC_IDS[codec]


def model_prefix(model_fp: str, codec: str | None = None, variant: str = "") -> bytes:
    """Key prefix of every entry of one model (and, given a codec, of one model+codec+variant: "" = full chunks)."""
    prefix = _lp(model_fp, "model fingerprint")
    if codec is None:
        return prefix
    if not variant:
        return prefix + bytes([codec_id(codec)])
    return prefix + bytes([codec_id(codec) | VARIANT_BIT]) + _lp(variant, "variant")


def preamble_chunk_id(preamble_hash: str) -> str:
    """The reserved chunk id under which a preamble's KV is stored."""
    return PREAMBLE_PREFIX + preamble_hash[:64]


def lead_in_chunk_id(preamble_hash: str) -> str:
    """The reserved chunk id of the lead-in a sliding-window model's chunks are computed after
    (precompute/lead_in.py): beside the preamble's, kept and skipped as it is."""
    return preamble_chunk_id(preamble_hash) + LEAD_IN_SUFFIX


def lead_in_variant(token_bytes: bytes) -> str:
    """The variant of the chunks computed after a lead-in (its token ids as a record stores them)."""
    return LEAD_IN_VARIANT + hashlib.blake2b(token_bytes, digest_size=8).hexdigest()


def is_reduced(variant: str) -> bool:
    """Whether a variant's chunks keep a subset of their tokens (and carry their positions)."""
    return bool(variant) and not variant.startswith(LEAD_IN_VARIANT)


def is_preamble_id(chunk_id: str) -> bool:
    return chunk_id.startswith(PREAMBLE_PREFIX)


@dataclass(frozen=True)
class ChunkKey:
    """One chunk's record (its "complete" mark); its `prefix` starts every key of that chunk."""

    model_fp: str
    codec: str
    chunk_id: str
    variant: str = ""  # "": the full chunk; else a reduced form's id (see the module doc)

    def __post_init__(self) -> None:
        _ = self.prefix  # validates lengths and codec now, not at first use

    @property
    def prefix(self) -> bytes:
        return model_prefix(self.model_fp, self.codec, self.variant) + _lp(self.chunk_id, "chunk id")

    def to_bytes(self) -> bytes:
        return self.prefix + TAG_RECORD

    def layer(self, layer: int) -> KVKey:
        return KVKey(self.model_fp, self.codec, self.chunk_id, layer, self.variant)

    def claim_key(self) -> bytes:
        return self.prefix + TAG_CLAIM

    @classmethod
    def from_bytes(cls, raw: bytes) -> ChunkKey:
        key = parse_key(raw)
        if not isinstance(key, ChunkKey) or key.to_bytes() != bytes(raw):
            raise ValueError(f"not a chunk record key: {bytes(raw)!r}")
        return key


@dataclass(frozen=True)
class KVKey:
    """One (chunk, layer) value: K and V of that layer for the chunk's tokens."""

    model_fp: str
    codec: str
    chunk_id: str
    layer: int
    variant: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.layer < MAX_LAYERS:
            raise ValueError(f"layer {self.layer} out of range 0..{MAX_LAYERS - 1}")
        _ = self.chunk.prefix

    @property
    def chunk(self) -> ChunkKey:
        return ChunkKey(self.model_fp, self.codec, self.chunk_id, self.variant)

    def to_bytes(self) -> bytes:
        return self.chunk.prefix + TAG_LAYER + self.layer.to_bytes(2, "big")

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVKey:
        key = parse_key(raw)
        if not isinstance(key, KVKey):
            raise ValueError(f"not a layer key: {bytes(raw)!r}")
        return key


@dataclass(frozen=True)
class ClaimKey:
    """A precompute process's claim on a chunk it is computing (see `KVTable.claim`)."""

    chunk: ChunkKey

    def to_bytes(self) -> bytes:
        return self.chunk.claim_key()


def chunk_of(key: ChunkKey | KVKey | ClaimKey) -> ChunkKey:
    return key if isinstance(key, ChunkKey) else key.chunk


def after_prefix(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with `prefix` (None: there is none)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


def parse_key(raw: bytes) -> ChunkKey | KVKey | ClaimKey:
    """Decode any key of the `kv` database; ValueError on bytes that are not one."""
    raw = bytes(raw)
    try:
        model_fp, pos = _read_lp(raw, 0)
        codec = CODEC_NAMES[raw[pos] & ~VARIANT_BIT]
        variant, pos = _read_lp(raw, pos + 1) if raw[pos] & VARIANT_BIT else ("", pos + 1)
        chunk_id, pos = _read_lp(raw, pos)
        tail = raw[pos:]
    except (IndexError, KeyError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"malformed kv key {raw!r}: {exc}") from None
    chunk = ChunkKey(model_fp, codec, chunk_id, variant)
    if tail == TAG_RECORD:
        return chunk
    if tail == TAG_CLAIM:
        return ClaimKey(chunk)
    if len(tail) == 3 and tail[:1] == TAG_LAYER:
        return KVKey(model_fp, codec, chunk_id, int.from_bytes(tail[1:], "big"), variant)
    raise ValueError(f"malformed kv key {raw!r}: unknown tail {tail!r}")


def _read_lp(raw: bytes, pos: int) -> tuple[str, int]:
    """The length-prefixed string at `pos` and the position after it; ValueError when short or empty."""
    n = raw[pos]
    text = raw[pos + 1 : pos + 1 + n].decode()
    if n == 0 or len(text.encode()) != n:
        raise ValueError("short key")
    return text, pos + 1 + n
