"""Memory tiers for a question-answering process: the TieredKVCache a ChunkSource reads through.

Built from `--host-cache` / `--gpu-cache` / `--cache-policy` (or their environment variables). PGDSF's
Cost/Size comes from each request's measured prefill time (`insert(cost_s=...)`); chunks kept only as
their stored KV cost a flat per-token time, recalibrated from each measured prefill (ChunkSource).
"""

from __future__ import annotations

import torch

from kvrag.kvcache.allocator import BlockLayout
from kvrag.model.runtime import Runtime
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.config import CacheConfig
from kvrag.store.tiers.cost_profile import CostProfile


def build_cache(runtime: Runtime, codec: str, host_cache: str | None = None, gpu_cache: str | None = None,
                policy: str | None = None) -> TieredKVCache | None:
    """The tiers this process may use, or None when the host budget is 0 (tiers off)."""
    config = CacheConfig.from_options(host_cache, gpu_cache, policy, cuda_available=torch.cuda.is_available())
    if config.host_bytes == 0:
        return None
    c = runtime.model.cfg
    layout = BlockLayout.for_codec(c.n_layers, c.n_kv_heads, c.head_dim, codec)
    gpu_device = runtime.model.device if runtime.model.device.type == "cuda" else None
    # on a GPU the host tier is pinned: its chunks go to the device in one asynchronous copy, never staged
    return TieredKVCache.from_config(config, layout, cost=CostProfile.linear(),
                                     preamble_tokens=len(runtime.prompts.preamble_ids), gpu_device=gpu_device,
                                     pin_host=gpu_device is not None)
