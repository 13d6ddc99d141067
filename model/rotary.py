"""Rotary position embedding (HF "rotate half" convention) at explicit absolute positions.

Keys are kept *before* rotation everywhere outside this module, so the same cached key can be
placed at any offset: rotate a fresh copy at load time, never a cached tensor in place.
"""

from __future__ import annotations

import math

import torch

from kvrag.model.config import ModelConfig


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, 1, head_dim] into `out` (a new tensor by default).

    Equal to x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], computed per half
    (cos and sin repeat over the two halves) so that no rotated copy of x is made.
    """
    half = x.shape[-1] // 2
    out = torch.empty_like(x) if out is None else out
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s)
    torch.mul(x2, c, out=o2)
    o2.add_(x1 * s)
    return out
