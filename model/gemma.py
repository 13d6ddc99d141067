"""What Gemma 2 and Gemma 3 compute differently from a Llama layer, where it is more than a flag in transformer.py:
their attention (scaled by query_pre_attn_scalar^-1/2 and, in Gemma 2, soft-capped: tanh(s / c) * c before the
softmax) and the final logits' soft-capping.

The rest of their forward lives in transformer.py behind `cfg.gemma` (ModelConfig): embeddings scaled by sqrt(D),
(1 + w) RMSNorms, norms after attention and after the MLP, a gelu-tanh MLP, Gemma 3's q/k norms and its sliding
layers' own rope theta (Transformer.layer_rope). The native and Triton kernels compute none of it
(cfg.plain / plain_attention are False): torch's ops here are the whole path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrag.model.config import ModelConfig

# query rows per block of the explicit (soft-capped) attention: [Hq, rows, S] float32 scores stay near 64 MB
SCORE_BYTES = 64 << 20


# a multimodal Gemma 3 checkpoint's language-model prefixes (as saved: transformers 4 and 5; as held in memory by
# transformers 5) and what stands for them in a text model's checkpoint; its vision tower and projector are not loaded
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """A checkpoint tensor's name as a text model's (itself for every text-only checkpoint); None: not loaded."""
    for prefix, text in TEXT_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return None if name.startswith(VISION_PREFIXES) else name


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap (HF's soft-capping of attention scores and final logits); x itself where cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def attend(cfg: ModelConfig, q: torch.Tensor, q_pos: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
           k_pos: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """Attention of queries q [R, Hq, hd] at q_pos [R] over rotated keys k and values v [S, Hkv, hd] at k_pos [S]:
    a query at p sees the keys at p - window < k_pos <= p (window None: every k_pos <= p); k_pos None: every key
    (a decode step, its keys already cut to the window). -> [R, Hq * hd] float32.

    Without soft-capping (Gemma 3) SDPA computes it with the model's scale and a mask; with it (Gemma 2) the scores
    must pass through tanh before the softmax, which no fused kernel does: explicit float32 matmuls, in row blocks.
    """
    r, hq, hd = q.shape
    mask = None  # [R, S] bool: the keys each query sees
    if k_pos is not None:
        qp, kp = q_pos.to(q.device)[:, None], k_pos.to(q.device)[None, :]
        mask = kp <= qp
        if window is not None:
            mask &= kp > qp - window
    elif window is not None:
        k, v = k[-window:], v[-window:]
    if cfg.attn_softcap is None:
        qh, kh, vh = (x.float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, len, hd]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=cfg.attention_scale,
                                             enable_gqa=cfg.group_size > 1)  # [1, Hq, R, hd]
        return out[0].transpose(0, 1).reshape(r, hq * hd)
    g = cfg.group_size
    qg = q.float().view(r, -1, g, hd).permute(1, 2, 0, 3)  # [Hkv, g, R, hd]
    kt, vf = k.float().permute(1, 2, 0), v.float().transpose(0, 1)  # [Hkv, hd, S], [Hkv, S, hd]
    out = torch.empty(qg.shape, dtype=torch.float32, device=q.device)  # [Hkv, g, R, hd]
    step = max(1, SCORE_BYTES // (4 * hq * max(1, k.shape[0])))
    for start in range(0, r, step):
        rows = slice(start, start + step)
        scores = softcap(torch.matmul(qg[:, :, rows], kt[:, None]) * cfg.attention_scale, cfg.attn_softcap)  # [Hkv, g, r, S]
        if mask is not None:
            scores.masked_fill_(~mask[rows], float("-inf"))
        out[:, :, rows] = torch.matmul(scores.softmax(-1), vf[:, None])
    return out.permute(2, 0, 1, 3).reshape(r, hq * hd)
