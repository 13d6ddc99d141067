"""Keys: byte round trips, and an order in which a chunk's layers and a model's chunks are contiguous."""

from __future__ import annotations

import random

import pytest

from kvrag.store.keys import (
    ChunkKey,
    ClaimKey,
    KVKey,
    after_prefix,
    model_prefix,
    parse_key,
    preamble_chunk_id,
)


def test_round_trips():
    key = KVKey("fp-1", "int8", "abc123", 29)
    assert KVKey.from_bytes(key.to_bytes()) == key
    chunk = key.chunk
    assert ChunkKey.from_bytes(chunk.to_bytes()) == chunk
    assert parse_key(chunk.claim_key()) == ClaimKey(chunk)
    pre = ChunkKey("fp-1", "fp16", preamble_chunk_id("ab" * 16))
    assert ChunkKey.from_bytes(pre.to_bytes()) == pre


def test_sort_order_groups_layers_chunks_and_models():
    rng = random.Random(0)
    models = ["a", "ab", "b" * 24, "é"]  # "a" is a prefix of "ab": lengths must keep them apart
    chunks = ["0", "00", "f" * 32, "0f", preamble_chunk_id("cd")]
    keys = [KVKey(m, c, ch, layer).to_bytes() for m in models for c in ("fp16", "int8") for ch in chunks
            for layer in (0, 1, 2, 255, 256, 300)]
    keys += [ChunkKey(m, c, ch).to_bytes() for m in models for c in ("fp16", "int8") for ch in chunks]
    keys += [ChunkKey(m, c, ch).claim_key() for m in models for c in ("fp16", "int8") for ch in chunks]
    rng.shuffle(keys)
    ordered = [parse_key(k) for k in sorted(keys)]

    def run_of(pred) -> list[int]:
        return [i for i, k in enumerate(ordered) if pred(k)]

    for m in models:
        for c in ("fp16", "int8"):
            group = run_of(lambda k, m=m, c=c: _chunk(k).model_fp == m and _chunk(k).codec == c)
            assert group == list(range(group[0], group[0] + len(group)))  # contiguous
            prefix = model_prefix(m, c)
            assert all(sorted(keys)[i].startswith(prefix) for i in group)
            for ch in chunks:
                run = run_of(lambda k, m=m, c=c, ch=ch: _chunk(k) == ChunkKey(m, c, ch))
                assert run == list(range(run[0], run[0] + len(run)))
                items = [ordered[i] for i in run]
                assert isinstance(items[0], ClaimKey) and isinstance(items[-1], ChunkKey)  # record last
                assert [k.layer for k in items[1:-1]] == [0, 1, 2, 255, 256, 300]  # layer order


def _chunk(key):
    return key if isinstance(key, ChunkKey) else key.chunk


def test_after_prefix_bounds_a_range():
    p = model_prefix("m")
    assert after_prefix(p) > KVKey("m", "bf16", "z" * 200, 65535).to_bytes()
    assert after_prefix(b"a\xff\xff") == b"b"
    assert after_prefix(b"\xff") is None


@pytest.mark.parametrize("raw", [b"", b"\x05ab", b"\x01a\x09\x01x", b"\x01a\x01\x01xQ", b"\x01a\x01\x01xL\x00"])
def test_malformed_keys_raise_value_error(raw):
    with pytest.raises(ValueError):
        parse_key(raw)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError):
        ChunkKey("", "fp16", "x")
    with pytest.raises(ValueError):
        ChunkKey("m", "fp16", "x" * 256)
    with pytest.raises(ValueError):
        ChunkKey("m", "q4", "x")
    with pytest.raises(ValueError):
        KVKey("m", "fp16", "x", 1 << 16)
