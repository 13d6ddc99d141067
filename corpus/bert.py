"""A BERT sentence encoder (all-MiniLM-L6-v2's shape) in plain torch, read straight from its safetensors.

sentence-transformers runs the same network but costs about 3 s of imports (transformers, scikit-learn, scipy)
before the first query is embedded; this reads the weights and the `tokenizers` file directly, so a cold
`kvrag ask` embeds its question in a fraction of a second. tests/test_bert_encoder.py holds it against
sentence-transformers' own vectors.

    ids, mask = tokenize(texts)                    # [B, T] each: [CLS] text [SEP], padded
    h = LayerNorm(word[ids] + pos[0..T) + type[0]) # [B, T, D]
    for layer: h = LN(h + attn(h)); h = LN(h + W2 gelu(W1 h))
    vector = mean of h over the unpadded tokens    # [B, D]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvrag.errors import KvragError


@dataclass(frozen=True)
class BertConfig:
    n_layers: int
    n_heads: int
    dim: int
    eps: float
    max_tokens: int  # longer texts are cut, as sentence-transformers' max_seq_length does

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        try:
            raw = json.loads((path / "config.json").read_text())
            st = path / "sentence_bert_config.json"
            max_tokens = json.loads(st.read_text()).get("max_seq_length", 256) if st.exists() else 256
        except (OSError, ValueError) as exc:
            raise KvragError(f"cannot read the embedder's config in {path}: {exc}") from None
        if raw.get("model_type") != "bert" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise KvragError(f"{path} is not a BERT model with absolute positions")
        return cls(raw["num_hidden_layers"], raw["num_attention_heads"], raw["hidden_size"],
                   raw.get("layer_norm_eps", 1e-12), min(max_tokens, raw["max_position_embeddings"]))


class BertEncoder:
    """Mean-pooled BERT embeddings (not yet normalised) of a batch of texts."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers import

        self.cfg = BertConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.cfg.max_tokens)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest text of the batch
        weights = load_file(str(path / "model.safetensors"), device=device)
        self.w = {name: t.to(dtype) for name, t in weights.items() if t.is_floating_point()}
        self.dtype, self.device = dtype, torch.device(device)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """[B, D] float32 mean-pooled vectors."""
        encoded = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([e.ids for e in encoded], device=self.device)  # [B, T]: T the longest, <= max_tokens
        mask = torch.tensor([e.attention_mask for e in encoded], device=self.device)  # [B, T]
        h = self._embed(ids)  # [B, T, D]
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, T]: padding is never attended
        for i in range(self.cfg.n_layers):
            h = self._layer(i, h, keep)
        m = mask[..., None].to(torch.float32)  # [B, T, 1]
        return (h.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w, t = self.w, ids.shape[1]
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:t]
             + w["embeddings.token_type_embeddings.weight"][0])
        return self._norm(x, "embeddings.LayerNorm")

    def _layer(self, i: int, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        p, w = f"encoder.layer.{i}.", self.w
        b, t, d = h.shape
        heads = self.cfg.n_heads

        def proj(name: str) -> torch.Tensor:  # [B, H, T, hd]
            x = F.linear(h, w[f"{p}attention.self.{name}.weight"], w[f"{p}attention.self.{name}.bias"])
            return x.view(b, t, heads, d // heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(proj("query"), proj("key"), proj("value"), attn_mask=keep)
        a = a.transpose(1, 2).reshape(b, t, d)  # [B, T, D]
        h = self._norm(h + self._linear(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        inner = F.gelu(self._linear(h, p + "intermediate.dense"))  # [B, T, 4D], exact (erf) GELU as BERT
        return self._norm(h + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.cfg.eps)
