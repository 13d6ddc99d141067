"""Byte budgets and cache options: human sizes, env vars, clear errors."""

from __future__ import annotations

import pytest

from kvrag.config import KVRagConfig
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


def test_config_defaults_and_env():
    """Defaults, then the environment over them, then options over both (config.py resolves; the tiers take it)."""
    cfg = CacheConfig.from_options()
    assert (cfg.host_bytes, cfg.gpu_bytes, cfg.policy) == (4 << 30, 0, "pgdsf")
    assert CacheConfig.from_options(cuda_available=True).gpu_bytes == 2 << 30

    env = {"KVRAG_HOST_CACHE": "1GiB", "KVRAG_CACHE_POLICY": "LRU", "KVRAG_REORDER_WINDOW": "3"}
    settings = KVRagConfig.resolve(env)
    cfg = CacheConfig.from_options(settings.host_cache, settings.gpu_cache, settings.cache_policy)
    assert (cfg.host_bytes, cfg.policy, settings.reorder_window) == (1 << 30, "lru", 3)
    settings = KVRagConfig.resolve(env, host_cache="256MiB", cache_policy="gdsf", reorder_window=0)
    cfg = CacheConfig.from_options(settings.host_cache, settings.gpu_cache, settings.cache_policy)
    assert (cfg.host_bytes, cfg.policy, settings.reorder_window) == (256 << 20, "gdsf", 0)
    assert KVRagConfig.resolve({}).reorder_window == 8  # the engine's window, and the one default


def test_config_errors():
    with pytest.raises(KvragError, match="needs a CUDA device"):
        CacheConfig.from_options(gpu_cache="1GiB", cuda_available=False)
    assert CacheConfig.from_options(gpu_cache="0", cuda_available=False).gpu_bytes == 0
    with pytest.raises(KvragError, match="unknown cache policy"):
        CacheConfig.from_options(policy="fifo")
    with pytest.raises(KvragError, match="reorder window"):
        KVRagConfig.resolve({}, reorder_window=-1)
    with pytest.raises(KvragError, match="KVRAG_REORDER_WINDOW"):
        KVRagConfig.resolve({"KVRAG_REORDER_WINDOW": "many"})
