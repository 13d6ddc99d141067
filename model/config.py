"""Typed configuration of a decoder model, read from a Hugging Face config.json.

Only what the runtime implements is accepted; anything else is refused with one clear line
rather than silently producing wrong logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvrag.errors import KvragError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")  # (1+w) norms, post-attention/feedforward norms, scaled embeddings, gelu-tanh MLP
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first name for LongRoPE
# A multimodal Gemma 3 checkpoint runs as its text model: its config's text_config, filled with HF's Gemma3TextConfig
# defaults (the hub's configs name only what differs), and its language model's weights (Transformer.from_safetensors)
GEMMA3_TEXT_DEFAULTS = {"model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 2304,
                        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 131_072, "sliding_window": 4096, "tie_word_embeddings": True}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as in HF's `rope_parameters` / `rope_scaling` (see SUPPORTED_ROPE_TYPES)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    attention_factor: float = 1.0  # yarn / longrope: cos and sin are scaled by it
    beta_fast: float = 32.0  # yarn's ramp
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors (the long ones are not run)

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
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k before rotary
    partial_rotary_factor: float = 1.0  # Phi-3 and others: only the first fraction of a head rotates
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" or "sliding_attention" (None: all alike)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (None: head_dim's)
    attn_softcap: float | None = None  # Gemma 2: scores become tanh(s / c) * c before the softmax
    final_softcap: float | None = None  # Gemma 2: the same on the final logits
    rope_local_theta: float | None = None  # Gemma 3: sliding layers rotate by this theta (unscaled), full by rope_theta

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        if self.n_heads % self.n_kv_heads:
            raise KvragError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2 or self.rotary_dim % 2:
            raise KvragError(f"head dim {self.head_dim} (rotary {self.rotary_dim}) must be even for rotary embeddings")
        if self.rope_local_theta is not None and self.layer_types is None:
            raise KvragError("a local rope theta needs layer_types to tell the sliding layers")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise KvragError(f"layer_types names {len(self.layer_types)} layers, the model has {self.n_layers}")

    @property
    def gemma(self) -> bool:
        """Gemma's layer: (1+w) RMSNorms, norms after attention and MLP too, embeddings scaled by sqrt(D), gelu-tanh."""
        return self.architecture in GEMMA

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates by rope_local_theta (Gemma 3's sliding layers) rather than rope_theta."""
        return self.rope_local_theta is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def rotary_dim(self) -> int:
        """How many of a head's leading dims rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int | None) -> int | None:
        """The keys a query at p sees at `layer` are those at p - window < k <= p (None: every earlier key)."""
        if self.sliding_window is None or self.layer_types is None:
            return self.sliding_window
        if layer is None:
            if len(set(self.layer_types)) > 1:
                raise KvragError("attention of a model with mixed sliding/full layers needs its layer")
            layer = 0
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def plain_attention(self) -> bool:
        """Causal attention over every earlier key, scaled by head_dim^-1/2 and not capped: what the native row kernel
        and the Triton kernels compute."""
        return not self.gemma and all(self.window(i) is None for i in range(self.n_layers))

    @property
    def plain_rotary(self) -> bool:
        """Every dim of every layer rotates by unscaled cos/sin of one inv_freq: what the blend loader's own rotation
        (inv_freq alone) computes."""
        return (self.rotary_dim == self.head_dim and self.rope_scaling.attention_factor == 1.0
                and self.rope_local_theta is None)

    @property
    def plain(self) -> bool:
        """A Llama-shaped layer throughout: what the native decode step (kernels/decode.cpp) computes."""
        return self.plain_attention and not self.qk_norm and self.rotary_dim == self.head_dim and not self.gemma

    def identity(self) -> dict[str, Any]:
        """What the model's fingerprint hashes: every field, less those added later while at their defaults (so a
        model's fingerprint, and its stores, stay what they were)."""
        def kept(obj) -> dict[str, Any]:
            return {f.name: getattr(obj, f.name) for f in fields(obj)
                    if f.name not in _LATER_FIELDS or getattr(obj, f.name) != f.default}
        return {**kept(self), "rope_scaling": kept(self.rope_scaling)}

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        arch = cfg.get("model_type", "?")
        if arch == "gemma3":  # multimodal: the text model alone (images are not run)
            text = {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
            if text["model_type"] != "gemma3_text":
                raise KvragError(f"gemma3 with a '{text['model_type']}' text model is not supported")
            return cls.from_hf(text)
        _check_architecture(arch)  # before any field is read: one line, not a KeyError
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        gemma: dict[str, Any] = {}
        if arch in GEMMA:
            rope, gemma = _gemma(cfg, arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None
        layer_types = cfg.get("layer_types")
        if window and not layer_types and "max_window_layers" in cfg:  # an older Qwen config: HF's own rule
            layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                           for i in range(int(cfg["num_hidden_layers"]))]
        scaling, max_positions = _rope_scaling(cfg, rope)
        kwargs = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=max_positions,
            sliding_window=int(window) if window else None,
            qk_norm=arch == "qwen3",
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            layer_types=tuple(layer_types) if window and layer_types else None,
        )
        return cls(**{**kwargs, **gemma})


def _gemma(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma 2 / Gemma 3 text config's global rope parameters and the fields that differ from the Llama reading,
    with HF's defaults where a config leaves a key out (older Gemma 3 configs: rope_local_base_freq and
    sliding_window_pattern; transformers 5: rope_parameters per layer type)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise KvragError(f"{arch} with activation '{act}' is not supported (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise KvragError(f"{arch} with bidirectional attention (an embedding model) is not supported")
    n_layers, gemma3 = int(cfg["num_hidden_layers"]), arch == "gemma3_text"
    pattern = int(cfg.get("sliding_window_pattern", 6)) if gemma3 else 2  # every pattern-th layer is global
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                             for i in range(n_layers)]
    params = cfg.get("rope_parameters") or {}
    rope = {**(cfg.get("rope_scaling") or {}), **params}
    local_theta = None
    if gemma3:
        by_type = "full_attention" in params or "sliding_attention" in params  # transformers 5's rope per layer type
        rope = dict(params.get("full_attention") or {}) if by_type else rope
        rope.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = (params.get("sliding_attention") if by_type else None) or \
            {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", "default") != "default":
            raise KvragError(f"gemma3 with a scaled local rope ('{local['rope_type']}') is not supported")
        local_theta = float(local["rope_theta"])
    fields_ = dict(
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        layer_types=tuple(layer_types),
        qk_norm=gemma3,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_softcap=_optional(cfg.get("attn_logit_softcapping", None if gemma3 else 50.0)),
        final_softcap=_optional(cfg.get("final_logit_softcapping", None if gemma3 else 30.0)),
        rope_local_theta=local_theta,
    )
    return rope, fields_


def _check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise KvragError(f"model architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _optional(x: Any) -> float | None:
    return None if x is None else float(x)


_LATER_FIELDS = {"qk_norm", "partial_rotary_factor", "layer_types", "attention_factor", "beta_fast", "beta_slow",
                 "truncate", "short_factor", "query_pre_attn_scalar", "attn_softcap", "final_softcap",
                 "rope_local_theta"}


def _rope_scaling(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[RopeScaling, int]:
    """The rotary scaling of a config.json and the longest context kvrag runs it at."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = ROPE_ALIASES.get(rope_type, rope_type)
    max_positions = int(cfg.get("max_position_embeddings", 4096))
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:  # HF's fallback for yarn and longrope; llama3 configs always name it
        original = max_positions if rope_type in ("yarn", "longrope") else 8192
    factor = rope.get("factor")
    attention = rope.get("attention_factor")
    short = None
    if rope_type == "yarn":
        factor = float(factor if factor is not None else max_positions / original)
        attention = attention if attention is not None else _yarn_mscale(factor, rope)
    elif rope_type == "longrope":
        # HF derives the factor from the two lengths when it is not named
        factor = float(factor if factor is not None else max_positions / original)
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = tuple(float(x) for x in rope["short_factor"])
        # past the original length HF switches every position to the long factors: not run here, so cap there
        max_positions = min(max_positions, int(original))
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_positions=int(original),
        attention_factor=float(attention if attention is not None else 1.0),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        short_factor=short,
    )
    return scaling, max_positions


def _yarn_mscale(factor: float, rope: dict[str, Any]) -> float:
    """YaRN's attention factor (HF's get_mscale), from `factor` and the optional mscale / mscale_all_dim."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
