"""The value format: exact 16-bit round trips, the int8 error bound, and every kind of corruption caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag.errors import KvragError
from kvrag.store.codec import DECODED_DTYPES, HEADER_SIZE, CorruptValue, decode, encode, read_header

ODD_SHAPES = [(1, 1, 2), (7, 3, 64), (33, 2, 10), (5, 5, 3)]


def _kv(shape, seed=0, scale=1.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal(shape) * scale).astype(dtype)
    v = (rng.standard_normal(shape) * scale).astype(dtype)
    return k, v


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("src", [np.float32, np.float16])
def test_fp16_is_exact_against_numpy_cast(shape, src):
    k, v = _kv(shape, scale=30.0, dtype=src)
    out = decode(encode(k, v, "fp16"))
    assert out.k.dtype == np.float16  # documented: fp16 decodes to float16, no float32 detour
    np.testing.assert_array_equal(out.k, k.astype(np.float16))
    np.testing.assert_array_equal(out.v, v.astype(np.float16))
    assert out.positions is None
    assert decode(encode(k, v, "fp16"), dtype=np.float32).k.dtype == np.float32


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_bf16_rounds_to_nearest_even_like_torch(shape):
    k, v = _kv(shape, seed=1, scale=1e3)
    # ties and carries into the exponent, which truncation would get wrong
    special = np.array([0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x7F7FFFFF], dtype=np.uint32).view(np.float32)
    n = min(len(special), k.size)
    k.reshape(-1)[:n] = special[:n]
    out = decode(encode(k, v, "bf16"))
    assert out.k.dtype == np.float32
    for got, ref in ((out.k, k), (out.v, v)):
        want = torch.from_numpy(ref).to(torch.bfloat16).to(torch.float32).numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("k_per_channel", [False, True])
def test_int8_error_is_within_half_a_step(shape, k_per_channel):
    """Symmetric int8 with scale = amax/127 rounds to the nearest step, so |x - x̂| <= amax/254 for the
    amax of each quantization group ((token, head) row, or K channel); the 1e-6 slack covers float32
    rounding of x/scale and q*scale. For N(0,1) rows of 64 values that is <= ~1 % of amax."""
    k, v = _kv(shape, seed=2, scale=5.0)
    k[:, 0, :] *= 40  # an outlier head/channel, as real keys have
    out = decode(encode(k, v, "int8", k_per_channel=k_per_channel))
    k_amax = np.abs(k).max(axis=0, keepdims=True) if k_per_channel else np.abs(k).max(axis=2, keepdims=True)
    v_amax = np.abs(v).max(axis=2, keepdims=True)
    assert np.all(np.abs(out.k - k) <= k_amax / 254 * (1 + 1e-6) + 1e-30)
    assert np.all(np.abs(out.v - v) <= v_amax / 254 * (1 + 1e-6) + 1e-30)


def test_int8_all_zero_rows_and_relative_error():
    k, v = _kv((64, 3, 64), seed=3)
    k[5] = 0
    out = decode(encode(k, v, "int8"))
    assert np.all(out.k[5] == 0)
    rel = np.linalg.norm(out.v - v) / np.linalg.norm(v)
    assert rel < 0.01  # ~0.5 % expected for Gaussian rows: step/sqrt(12) with step = 2.4σ/127


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("compress", [True, False])
def test_positions_round_trip(codec, compress):
    k, v = _kv((6, 2, 8))
    pos = np.array([0, 3, 4, 9, 10, 11], dtype=np.int64)
    out = decode(encode(k, v, codec, positions=pos, compress=compress))
    assert out.k.dtype == out.v.dtype == DECODED_DTYPES[codec]  # what the loader stages them in
    np.testing.assert_array_equal(out.positions, pos)
    assert out.positions.dtype == np.int32
    per_head = np.arange(12, dtype=np.int32).reshape(6, 2)
    np.testing.assert_array_equal(decode(encode(k, v, codec, positions=per_head, compress=compress)).positions,
                                  per_head)
    with pytest.raises(ValueError):
        encode(k, v, codec, positions=np.arange(5), compress=compress)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_uncompressed_values_decode_like_compressed_ones(codec, shape):
    """Same numbers either way; uncompressed, the payload is the raw sections (K then V in natural order),
    and copy=False hands out read-only views of the value instead of copies."""
    k, v = _kv(shape, seed=6, scale=20.0)
    packed, plain = encode(k, v, codec), encode(k, v, codec, compress=False)
    want, got = decode(packed), decode(plain)
    np.testing.assert_array_equal(got.k, want.k)
    np.testing.assert_array_equal(got.v, want.v)
    assert len(plain) - HEADER_SIZE == read_header(plain).raw_len
    assert got.k.flags.writeable  # copy=True (the default): fresh arrays, as documented
    views = decode(plain, copy=False)
    np.testing.assert_array_equal(views.k, want.k)
    if codec == "fp16":  # nothing to convert: the stored bytes themselves
        assert not views.k.flags.writeable and views.k.base is not None
        np.testing.assert_array_equal(np.frombuffer(plain[HEADER_SIZE:], "<f2")[: k.size].reshape(shape),
                                      k.astype(np.float16))


def test_unpacks_as_k_v():
    k, v = _kv((3, 1, 4))
    dk, dv = decode(encode(k, v))
    np.testing.assert_array_equal(dk, k.astype(np.float16))


def test_bad_inputs_are_refused():
    k, v = _kv((4, 2, 8))
    with pytest.raises(KvragError, match="fp16 range"):
        encode(k * 1e5, v, "fp16")
    encode(k * 1e5, v, "bf16")  # bf16 has the range
    bad = k.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        encode(bad, v, "bf16")
    with pytest.raises(ValueError):
        encode(k, v[:3], "fp16")
    with pytest.raises(ValueError):
        encode(k.astype(np.float64), v.astype(np.float64), "fp16")
    with pytest.raises(ValueError, match="unknown codec"):
        encode(k, v, "fp8")


@pytest.fixture(params=[(codec, compress) for codec in ("fp16", "bf16", "int8") for compress in (True, False)],
                ids=lambda p: f"{p[0]}-{'zstd' if p[1] else 'raw'}")
def value(request) -> bytes:
    k, v = _kv((9, 3, 16), seed=4)
    codec, compress = request.param
    return encode(k, v, codec, positions=np.arange(9), compress=compress)


def _flip(raw: bytes, at: int) -> bytes:
    b = bytearray(raw)
    b[at] ^= 0x10
    return bytes(b)


def test_every_corruption_is_caught(value):
    decode(value)  # the intact value decodes
    cases = {
        "payload byte": _flip(value, HEADER_SIZE + len(value[HEADER_SIZE:]) // 2),
        "last byte": _flip(value, len(value) - 1),
        "truncated": value[:-7],
        "extra byte": value + b"\0",
        "header only": value[:HEADER_SIZE],
        "short header": value[:10],
        "empty": b"",
        "wrong magic": b"XXXX" + value[4:],
        "version": value[:4] + bytes([9]) + value[5:],
        "codec id": value[:5] + bytes([77]) + value[6:],
        "shape byte": _flip(value, 12),  # n_tokens: caught by the length check or the checksum
        "head dim": _flip(value, 18),
        "checksum": _flip(value, HEADER_SIZE - 1),
        "flags": _flip(value, 8),
    }
    for name, raw in cases.items():
        for copy in (True, False):
            with pytest.raises(CorruptValue):
                decode(raw, copy=copy)
                pytest.fail(f"{name} was not caught")


def test_expectations_are_checked(value):
    head = read_header(value)
    with pytest.raises(CorruptValue, match="shape"):
        decode(value, expect_shape=(head.shape[0] + 1, *head.shape[1:]))
    other = "fp16" if head.codec != "fp16" else "bf16"
    with pytest.raises(CorruptValue, match="codec"):
        decode(value, expect_codec=other)
    decode(value, expect_codec=head.codec, expect_shape=head.shape)


def test_sixteen_bit_codecs_compress_random_kv():
    k, v = _kv((256, 3, 64), seed=5)
    raw = k.size * 2 * 2
    assert len(encode(k, v, "fp16")) < 0.92 * raw  # byte planes: the exponent bytes squeeze
    assert len(encode(k, v, "bf16")) < 0.80 * raw
    assert len(encode(k, v, "int8")) < 0.55 * raw


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_copy_checked_copies_what_decode_reads_and_refuses_a_damaged_value(codec):
    """An uncompressed value copied into its parts in small blocks, checked as it is copied: the parts hold the
    payload's bytes in order (K, V, then int8's scales), and one flipped byte anywhere is a CorruptValue."""
    from kvrag.store.codec import HEADER_SIZE, copy_checked

    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((7, 2, 8)).astype(np.float32) for _ in range(2))
    raw = encode(k, v, codec, compress=False)
    payload = np.frombuffer(raw, dtype=np.uint8, offset=HEADER_SIZE)
    sizes = [7 * 2 * 8 * (1 if codec == "int8" else 2)] * 2 + ([2 * 8 * 4, 7 * 2 * 4] if codec == "int8" else [])
    parts = [np.empty(n, dtype=np.uint8) for n in sizes]
    head = copy_checked(raw, parts, expect_codec=codec, block=5)  # blocks that split every part unevenly
    assert head.shape == (7, 2, 8) and np.array_equal(np.concatenate(parts), payload[:sum(sizes)])
    for at in (HEADER_SIZE + 3, len(raw) - 1):
        damaged = bytearray(raw)
        damaged[at] ^= 0x40
        with pytest.raises(CorruptValue, match="checksum"):
            copy_checked(bytes(damaged), [np.empty(n, dtype=np.uint8) for n in sizes])
