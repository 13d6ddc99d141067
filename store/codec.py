"""The value format of one (chunk, layer): a fixed header, then the zstd-compressed K and V.

    header (40 bytes, little-endian): magic b"KVRV", format version, codec id, source dtype, flags,
        n_tokens (u32), kv_heads (u16), head_dim (u16), raw payload length (u64),
        compressed payload length (u64), checksum (u64: xxh3-64 of the header's first 32 bytes + payload)
    payload (zstd): K then V, then int8 scales, then optional token positions (int32)

The checksum covers the header too, so a flipped shape byte is caught like a flipped payload byte.
Compressed 16-bit values store their two byte planes apart (all low bytes, then all high bytes): zstd squeezes
the repetitive high bytes (sign, exponent) better. Uncompressed values (`compress=False`, FLAG_RAW) keep K then
V in natural little-endian order: larger, but they decode to zero-copy views of the stored bytes, which spares
a CPU blend the decode on its own cores (figures: docs/performance.md, "Precompute and the store").

Decoded arrays are fresh and writable (unless `copy=False` lets an uncompressed value decode to views), fp16 as
float16 (exact: the loader converts once to its compute dtype), bf16 and int8 as float32, unless `dtype` asks
otherwise. `stored_kv` gives K and V without dequantising int8 (values and scales), for a load that dequantises
on the device (load/loader.py's fused path).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from kvrag.errors import KvragError
from kvrag.store.keys import CODEC_NAMES, codec_id

MAGIC = b"KVRV"
FORMAT_VERSION = 1
ZSTD_LEVEL = 3
COPY_BLOCK = 1 << 18  # copy_checked hashes each 256 KiB block as it copies it, while the block is in L2
_HEADER = struct.Struct("<4sBBBBIHHQQQ")
HEADER_SIZE = _HEADER.size  # 40
FLAG_POSITIONS = 1  # a Keyformer-reduced subset: original positions follow the scales
FLAG_POSITIONS_PER_HEAD = 2  # positions are [T, kv_heads] rather than [T]
FLAG_SHUFFLED = 4  # 16-bit codecs: byte planes stored apart
FLAG_K_PER_CHANNEL = 8  # int8: K scales per (head, channel) instead of per (token, head)
FLAG_RAW = 16  # payload not compressed (and 16-bit values not split into byte planes)
SRC_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float16): 2}
SRC_DTYPE_NAMES = {1: "float32", 2: "float16"}
# what `decode` returns per codec, unless asked otherwise (see the module doc)
DECODED_DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(np.float32), "int8": np.dtype(np.float32)}

# int8 K scales per (head, channel), as KIVI does: pre-rotary keys have outlier channels (docs/performance.md).
# The per-token K layout stays readable (flag clear), so the choice can change without a format change.
INT8_K_PER_CHANNEL = True


class CorruptValue(KvragError):
    """A stored value failed a check (magic, version, length, checksum, shape); recompute that chunk."""


@dataclass(frozen=True)
class ValueHeader:
    codec: str
    src_dtype: str
    flags: int
    shape: tuple[int, int, int]  # (n_tokens, kv_heads, head_dim)
    raw_len: int
    payload_len: int
    checksum: int


@dataclass(frozen=True)
class DecodedKV:
    """One layer's K and V, each [T, kv_heads, head_dim]; unpacks as `k, v = decoded`."""

    k: np.ndarray  # [T, kv_heads, head_dim]
    v: np.ndarray  # [T, kv_heads, head_dim]
    positions: np.ndarray | None = None  # int32 [T] or [T, kv_heads]; None: all chunk tokens, in order

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter((self.k, self.v))


@dataclass(frozen=True)
class StoredKV:
    """One layer's K and V as stored (see `stored_kv`): x = q * scale for int8, the values themselves otherwise."""

    k: np.ndarray  # [T, kv_heads, head_dim] float16, float32 (bf16) or int8
    v: np.ndarray  # [T, kv_heads, head_dim]
    k_scale: np.ndarray | None = None  # int8: float32 [kv_heads, head_dim] (k_per_channel) or [T, kv_heads]
    v_scale: np.ndarray | None = None  # int8: float32 [T, kv_heads]
    k_per_channel: bool = False


def encode(
    k: np.ndarray,
    v: np.ndarray,
    codec: str = "fp16",
    positions: np.ndarray | None = None,
    *,
    k_per_channel: bool = INT8_K_PER_CHANNEL,
    compress: bool = True,
) -> bytes:
    """Encode one layer's K and V ([T, kv_heads, head_dim], float32 or float16) into a stored value.

    `compress=False` stores the payload as it is (see the module doc)."""
    cid = codec_id(codec)
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"K and V must share a [T, kv_heads, head_dim] shape, got {k.shape} and {v.shape}")
    if k.dtype != v.dtype or k.dtype not in SRC_DTYPES:
        raise ValueError(f"K and V must both be float32 or float16, got {k.dtype} and {v.dtype}")
    t, h, d = k.shape
    if not (0 < t < 1 << 32 and 0 < h < 1 << 16 and 0 < d < 1 << 16):
        raise ValueError(f"shape {k.shape} out of range")
    if not (_all_finite(k) and _all_finite(v)):
        raise ValueError("K/V contain NaN or inf; refusing to store them")
    flags = 0
    if codec == "int8":
        sections = _int8_sections(k, v, k_per_channel)
        flags |= FLAG_K_PER_CHANNEL if k_per_channel else 0
    else:
        kv = np.concatenate([k.reshape(-1), v.reshape(-1)])  # [2*T*H*D]
        bits = _to_fp16_bits(kv) if codec == "fp16" else _to_bf16_bits(kv)
        if compress:
            sections = [_shuffle(bits)]
            flags |= FLAG_SHUFFLED
        else:
            sections = [bits.astype("<u2", copy=False).tobytes()]
    if positions is not None:
        pos = np.ascontiguousarray(positions, dtype="<i4")
        if pos.shape not in ((t,), (t, h)):
            raise ValueError(f"positions must be [T] or [T, kv_heads] = {(t,)} or {(t, h)}, got {pos.shape}")
        flags |= FLAG_POSITIONS | (FLAG_POSITIONS_PER_HEAD if pos.ndim == 2 else 0)
        sections.append(pos.tobytes())
    raw = b"".join(sections)
    if compress:
        payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    else:
        payload, flags = raw, flags | FLAG_RAW
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, cid, SRC_DTYPES[k.dtype], flags, t, h, d, len(raw), len(payload), 0)
    return head[:-8] + _checksum(head, payload).to_bytes(8, "little") + payload


def read_header(raw: bytes | memoryview) -> ValueHeader:
    """Parse and sanity-check the header (not the checksum); CorruptValue on any mismatch."""
    if len(raw) < HEADER_SIZE:
        raise CorruptValue(f"value is {len(raw)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, cid, sdt, flags, t, h, d, raw_len, payload_len, checksum = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptValue(f"value format version {version}, this kvrag reads {FORMAT_VERSION}")
    if cid not in CODEC_NAMES or sdt not in SRC_DTYPE_NAMES:
        raise CorruptValue(f"unknown codec id {cid} or source dtype {sdt}")
    if len(raw) != HEADER_SIZE + payload_len:
        raise CorruptValue(f"value is {len(raw)} bytes, header says {HEADER_SIZE + payload_len} (truncated?)")
    head = ValueHeader(CODEC_NAMES[cid], SRC_DTYPE_NAMES[sdt], flags, (t, h, d), raw_len, payload_len, checksum)
    if raw_len != _raw_len(head):
        raise CorruptValue(f"payload length {raw_len} does not match shape {head.shape} and codec {head.codec}")
    if flags & FLAG_RAW and payload_len != raw_len:
        raise CorruptValue(f"uncompressed payload is {payload_len} bytes, its shape needs {raw_len}")
    return head


def decode(
    raw: bytes | memoryview,
    *,
    expect_codec: str | None = None,
    expect_shape: tuple[int, int, int] | None = None,
    dtype: type | None = None,
    copy: bool = True,
) -> DecodedKV:
    """Check and decode a stored value; CorruptValue on any problem (never returns wrong data).

    `copy=False` lets an uncompressed value decode to read-only views of `raw` (no copy at all)."""
    head, body = checked_body(raw, expect_codec=expect_codec, expect_shape=expect_shape)
    if copy and head.flags & FLAG_RAW:
        body = bytearray(body)  # a bytearray: writable arrays
    kv = stored_kv(head, body)
    k, v = kv.k, kv.v
    if kv.k_scale is not None:
        ks = kv.k_scale[None] if kv.k_per_channel else kv.k_scale[..., None]  # [1, H, D] or [T, H, 1]
        k, v = k.astype(np.float32) * ks, v.astype(np.float32) * kv.v_scale[..., None]  # [T, H, D] each
    if dtype is not None:
        k, v = k.astype(dtype, copy=False), v.astype(dtype, copy=False)
    return DecodedKV(k, v, stored_positions(head, body))


def checked_body(raw: bytes | memoryview, *, expect_codec: str | None = None,
                 expect_shape: tuple[int, int, int] | None = None) -> tuple[ValueHeader, bytes | memoryview]:
    """A stored value's header and its payload, decompressed (a view of `raw` when stored uncompressed), once
    the checksum, codec and shape hold; CorruptValue otherwise. 16-bit values are in byte planes when the header
    has FLAG_SHUFFLED, else in natural order: K's values, then V's."""
    head = read_header(raw)
    payload = memoryview(raw)[HEADER_SIZE:]
    if _checksum(bytes(memoryview(raw)[:HEADER_SIZE]), payload) != head.checksum:
        raise CorruptValue("checksum mismatch")
    if expect_codec is not None and head.codec != expect_codec:
        raise CorruptValue(f"value has codec {head.codec}, expected {expect_codec}")
    if expect_shape is not None and head.shape != tuple(expect_shape):
        raise CorruptValue(f"value has shape {head.shape}, expected {tuple(expect_shape)}")
    if head.flags & FLAG_RAW:
        return head, payload
    try:
        body = zstandard.ZstdDecompressor().decompress(payload, max_output_size=head.raw_len)
    except zstandard.ZstdError as exc:
        raise CorruptValue(f"zstd: {exc}") from None
    if len(body) != head.raw_len:
        raise CorruptValue(f"payload decompressed to {len(body)} bytes, expected {head.raw_len}")
    return head, body


def copy_checked(raw: bytes | memoryview, destinations: list[np.ndarray], *, expect_codec: str | None = None,
                 block: int = COPY_BLOCK) -> ValueHeader:
    """An uncompressed value's payload copied into `destinations` (uint8 arrays, filled in order; what is left of the
    payload is only checked), its checksum computed from each block just copied, while it is in the cache: the
    bytes are read from the store once, where checked_body and a copy read them twice. CorruptValue (and nothing
    to trust in the destinations) when the value fails a check."""
    head = read_header(raw)
    if not head.flags & FLAG_RAW:
        raise ValueError("copy_checked takes uncompressed values; checked_body decompresses the others")
    if expect_codec is not None and head.codec != expect_codec:
        raise CorruptValue(f"value has codec {head.codec}, expected {expect_codec}")
    payload = np.frombuffer(raw, dtype=np.uint8, offset=HEADER_SIZE)
    digest = xxhash.xxh3_64()
    digest.update(bytes(memoryview(raw)[: HEADER_SIZE - 8]))
    at = 0
    for out in destinations:
        for start in range(0, out.size, block):
            piece = out[start:start + block]
            piece[:] = payload[at + start:at + start + piece.size]
            digest.update(piece)
        at += out.size
    digest.update(payload[at:])
    if digest.intdigest() != head.checksum:
        raise CorruptValue("checksum mismatch")
    return head


def stored_positions(head: ValueHeader, body: bytes | bytearray | memoryview) -> np.ndarray | None:
    """A checked body's kept positions (int32 [T] or [T, kv_heads], the payload's last section), None for a full
    chunk: readable without decoding K and V."""
    if not head.flags & FLAG_POSITIONS:
        return None
    t, h, _ = head.shape
    pshape = (t, h) if head.flags & FLAG_POSITIONS_PER_HEAD else (t,)
    size = 4 * t * (h if len(pshape) == 2 else 1)
    return np.frombuffer(memoryview(body)[len(body) - size:], dtype="<i4").astype(np.int32).reshape(pshape)


def stored_kv(head: ValueHeader, body: bytes | bytearray | memoryview) -> StoredKV:
    """A checked body's K and V as stored, not dequantised (what a device-side dequantising load takes): fp16 as
    float16, bf16 as float32 (exact), int8 as int8 with its float32 scales. Views of `body` where it holds them
    in natural order (int8, uncompressed 16-bit values); 16-bit byte planes are put back together."""
    t, h, d = head.shape
    n = t * h * d
    buf = memoryview(body)
    if head.codec == "int8":
        q = np.frombuffer(buf[: 2 * n], dtype=np.int8).reshape(2, t, h, d)
        per_channel = bool(head.flags & FLAG_K_PER_CHANNEL)
        k_scale_len = h * d if per_channel else t * h
        scales = np.frombuffer(buf[2 * n : 2 * n + 4 * (k_scale_len + t * h)], dtype="<f4")
        ks = scales[:k_scale_len].reshape((h, d) if per_channel else (t, h))
        return StoredKV(q[0], q[1], ks, scales[k_scale_len:].reshape(t, h), per_channel)
    if head.flags & FLAG_SHUFFLED:  # byte planes apart (every compressed 16-bit value)
        planes = np.frombuffer(buf[: 4 * n], dtype=np.uint8).reshape(2, 2 * n)  # [low bytes; high bytes]
        bits = planes[1].astype(np.uint16)  # 10x faster than transposing the byte planes
        bits <<= 8
        bits |= planes[0]
    else:  # natural order: a view of the body
        bits = np.frombuffer(buf[: 4 * n], dtype="<u2")
    bits = bits.reshape(2, t, h, d)  # [K|V, T, H, D]
    if head.codec == "fp16":
        kv = bits.view(np.float16)
    else:  # bf16: the upper half of a float32
        kv = (bits.astype(np.uint32) << 16).view(np.float32)
    return StoredKV(kv[0], kv[1])


def _int8_sections(k: np.ndarray, v: np.ndarray, k_per_channel: bool) -> list[bytes]:
    """Symmetric int8: x ≈ q * scale, scale = amax / 127 over each (token, head) row or K channel."""
    qk, k_scale = _quantize(k.astype(np.float32, copy=False), axis=0 if k_per_channel else 2)
    qv, v_scale = _quantize(v.astype(np.float32, copy=False), axis=2)
    return [qk.tobytes(), qv.tobytes(), k_scale.astype("<f4").tobytes(), v_scale.astype("<f4").tobytes()]


def _quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(x).max(axis=axis, keepdims=True)  # [T, H, 1] per token-head, [1, H, D] per channel
    scale = (amax / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))  # all-zero rows: q = 0, scale 0
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis=axis)


def _all_finite(x: np.ndarray) -> bool:
    """np.isfinite, but on float16 through the exponent bits: numpy emulates float16 math, 15× slower."""
    if x.dtype == np.float16:
        return _fp16_bits_finite(x.reshape(-1).view(np.uint16))
    return bool(np.isfinite(x).all())


def _fp16_bits_finite(bits: np.ndarray) -> bool:
    """True when no float16 bit pattern has an all-ones exponent (inf or NaN)."""
    return bool((bits.view(np.int16) & np.int16(0x7C00)).max(initial=0) < 0x7C00)


def _to_fp16_bits(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float16:
        bits = x.view(np.uint16)  # finite already checked by encode
    else:
        with np.errstate(over="ignore"):  # overflow is reported below, as one clear error
            bits = x.astype(np.float16).view(np.uint16)  # round to nearest even
        if not _fp16_bits_finite(bits):
            raise KvragError("KV values exceed the fp16 range (|x| > 65504); use --codec bf16")
    return bits


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns, rounding to nearest even (inputs are finite, so no NaN case)."""
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    bits = bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))  # cannot wrap: finite floats are < 0xFF800000
    return (bits >> 16).astype(np.uint16)


def _shuffle(bits: np.ndarray) -> bytes:
    """uint16 [N] → all low bytes, then all high bytes."""
    planes = np.empty((2, bits.size), dtype=np.uint8)
    planes[0] = bits & 0xFF
    planes[1] = bits >> 8
    return planes.tobytes()


def _raw_len(head: ValueHeader) -> int:
    t, h, d = head.shape
    n = t * h * d
    if head.codec == "int8":
        kv = 2 * n + 4 * ((h * d if head.flags & FLAG_K_PER_CHANNEL else t * h) + t * h)
    else:
        kv = 4 * n
    if head.flags & FLAG_POSITIONS:
        kv += 4 * (t * h if head.flags & FLAG_POSITIONS_PER_HEAD else t)
    return kv


def _checksum(header: bytes, payload: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(header[: HEADER_SIZE - 8])
    digest.update(payload)
    return digest.intdigest()

