"""Rotary position embedding (HF "rotate half" convention) at explicit absolute positions.

Keys are kept *before* rotation everywhere outside this module, so the same cached key can be
placed at any offset: rotate a fresh copy at load time, never a cached tensor in place.
"""

from __future__ import annotations

import math

import torch

from kvrag.model.config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, with the config's rope scaling applied (`local`: Gemma 3's
    sliding layers', from rope_local_theta and unscaled).

    "dynamic" is the default frequencies: HF rescales them only for a sequence past max_position_embeddings,
    which kvrag never runs (ModelConfig.max_positions). "longrope" runs its short factors alone (the long ones
    only serve past original_max_position_embeddings, where config.py caps the context).
    """
    d, s = cfg.rotary_dim, cfg.rope_scaling
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d  # [d/2]
    if local:
        return (1.0 / (cfg.rope_local_theta ** exponents)).float()
    inv = 1.0 / (cfg.rope_theta ** exponents)
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        inv = _llama3(inv, s)
    elif s.rope_type == "yarn":
        inv = _yarn(inv, s, d, cfg.rope_theta)
    elif s.rope_type == "longrope":
        inv = inv / torch.tensor(s.short_factor, dtype=torch.float64)
    return inv.float()


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between."""
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return torch.where(wavelen > low_wavelen, inv / s.factor, torch.where(wavelen < high_wavelen, inv, blended))


def _yarn(inv: torch.Tensor, s: RopeScaling, d: int, base: float) -> torch.Tensor:
    """YaRN (HF's _compute_yarn_parameters): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by factor), those turning more than beta_fast times kept, a ramp between."""
    def correction_dim(rotations: float) -> float:
        return d * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [d/2]
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / s.factor * (1 - keep) + inv * keep


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
            attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, rotary_dim] for absolute `positions` [T] (computed in float32), scaled by
    `attention_factor` (yarn, longrope) before the cast, as HF does."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, 1, rotary_dim] into `out` (a new tensor by default); dims past
    rotary_dim (a partial rotary) pass through unchanged.

    Equal to x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], computed per half
    (cos and sin repeat over the two halves) so that no rotated copy of x is made.
    """
    if cos.shape[-2] != 1:  # a model with per-layer rope (Transformer.layer_rope) must pick its layer's first
        raise ValueError(f"rotate takes one layer's cos/sin [T, 1, rot], got {tuple(cos.shape)}")
    rot = cos.shape[-1]
    half = rot // 2
    out = torch.empty_like(x) if out is None else out
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    x1, x2 = x[..., :half], x[..., half:rot]
    c, s = cos[..., :half], sin[..., :half]
    o1, o2 = out[..., :half], out[..., half:rot]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s)
    torch.mul(x2, c, out=o2)
    o2.add_(x1 * s)
    return out
