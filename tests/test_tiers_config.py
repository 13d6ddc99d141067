"""Byte budgets and cache options: human sizes, env vars, clear errors."""

from __future__ import annotations

import pytest

from kvrag.errors import KvragError
from kvrag.store.tiers.config import CacheConfig, format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20), (" 2 GiB ", 2 << 30),
    ("1.5GiB", 3 << 29), ("64KiB", 64 << 10), ("1TiB", 1 << 40), ("3G", 3 << 30), ("10M", 10 << 20),
    ("1GB", 10**9), ("250MB", 250 * 10**6), ("2KB", 2000), ("123", 123), ("123B", 123), ("0", 0),
    (".5KiB", 512), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 gigs", "-1GiB", "4GiBs", "1e9", "four", "4 Gi B", "1.2.3MiB"])
def test_parse_bytes_refuses_with_one_line(text):
    with pytest.raises(KvragError, match="--host-cache: cannot read") as exc:
        parse_bytes(text, "--host-cache")
    assert "\n" not in str(exc.value)


def test_parse_bytes_refuses_negative_int():
    with pytest.raises(KvragError):
        parse_bytes(-5)


def test_format_bytes():
    assert format_bytes(4 << 30) == "4GiB"
    assert format_bytes(1536) == "1.5KiB"
    assert format_bytes(100) == "100B"


def test_config_defaults_and_env(monkeypatch):
    for var in ("KVRAG_HOST_CACHE", "KVRAG_GPU_CACHE", "KVRAG_CACHE_POLICY", "KVRAG_REORDER_WINDOW"):
        monkeypatch.delenv(var, raising=False)
    cfg = CacheConfig.from_options()
    assert (cfg.host_bytes, cfg.gpu_bytes, cfg.policy, cfg.reorder_window) == (4 << 30, 0, "pgdsf", 32)
    assert CacheConfig.from_options(cuda_available=True).gpu_bytes == 2 << 30

    monkeypatch.setenv("KVRAG_HOST_CACHE", "1GiB")
    monkeypatch.setenv("KVRAG_CACHE_POLICY", "LRU")
    monkeypatch.setenv("KVRAG_REORDER_WINDOW", "8")
    cfg = CacheConfig.from_options()
    assert (cfg.host_bytes, cfg.policy, cfg.reorder_window) == (1 << 30, "lru", 8)
    cfg = CacheConfig.from_options(host_cache="256MiB", policy="gdsf", reorder_window=0)
    assert (cfg.host_bytes, cfg.policy, cfg.reorder_window) == (256 << 20, "gdsf", 0)


def test_config_errors(monkeypatch):
    monkeypatch.delenv("KVRAG_GPU_CACHE", raising=False)
    with pytest.raises(KvragError, match="needs a CUDA device"):
        CacheConfig.from_options(gpu_cache="1GiB", cuda_available=False)
    assert CacheConfig.from_options(gpu_cache="0", cuda_available=False).gpu_bytes == 0
    with pytest.raises(KvragError, match="unknown cache policy"):
        CacheConfig.from_options(policy="fifo")
    with pytest.raises(KvragError, match="reorder-window"):
        CacheConfig(reorder_window=-1)
    monkeypatch.setenv("KVRAG_REORDER_WINDOW", "many")
    with pytest.raises(KvragError, match="KVRAG_REORDER_WINDOW"):
        CacheConfig.from_options()
