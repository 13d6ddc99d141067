"""Rotary position embedding (HF "rotate half" convention) at explicit absolute positions.

Keys are kept *before* rotation everywhere outside this module, so the same cached key can be
placed at any offset: rotate a fresh copy at load time, never a cached tensor in place.
"""

from __future__ import annotations

import math

import torch

from kvrag.blend.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
        low_wavelen = s.original_max_positions / s.low_freq_factor
        high_wavelen = s.original_max_positions / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * inv / s.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / s.factor, torch.where(wavelen < high_wavelen, inv, blended))
    return inv.float()


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, head_dim] for absolute `positions` [T] (computed in float32)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, 1, head_dim]; returns a new tensor."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin
