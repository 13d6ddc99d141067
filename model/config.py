"""Typed configuration of a Llama-family model, read from a Hugging Face config.json.

Only what the runtime implements is accepted; anything else is refused with one clear line
rather than silently producing wrong logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrag.errors import KvragError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in HF's `rope_parameters` / `rope_scaling` (linear or llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise KvragError(
                f"rope scaling '{self.rope_type}' is not implemented (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.factor <= 0:
            raise KvragError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    qkv_bias: bool
    tie_embeddings: bool
    max_positions: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise KvragError(
                f"model architecture '{self.architecture}' is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.n_heads % self.n_kv_heads:
            raise KvragError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise KvragError(f"head dim {self.head_dim} must be even for rotary embeddings")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        arch = cfg.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise KvragError(
                f"model architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope = {**legacy_scaling, **rope}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_positions=int(rope.get("original_max_position_embeddings", 8192)),
        )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=int(window) if window else None,
        )
