"""A blend's preview (ProphetKV's first stage): before choosing what to recompute, the question alone is run over the
loaded chunk KV, as full KV reuse runs it, and how much its queries read each chunk row is kept per layer. Ranking
single rows by it (`query`) needs the deep layers' reading; ranking passages does not: the check layer's reading
picks the same chunks (`chunks` against `chunks-preview`, docs/performance.md), which is why the default previews
nothing.

The preview's loaded layers are kept (`KeptLayers`) and handed to the blend that follows, so the store is read
once; what it costs is the question's rows through every layer over the whole prompt's keys (reuse's compute).
"""

from __future__ import annotations

import torch

from kvrag.blend.fusion import fused_prefill
from kvrag.model.prefill import LayerKV
from kvrag.model.step import attention_logits
from kvrag.model.transformer import Transformer


class QueryReading:
    """The fusion tap (model/step.py) that keeps, per layer, how much the question's queries read each chunk row:
    `per_layer` [L, C], each layer's row summing to the share of attention the chunk rows get there. At the last layer
    a prefill computes its last row alone, so the reading there is the last query's."""

    def __init__(self, n_layers: int, n_pre: int, n_chunk: int, device: torch.device | str):
        self.n_pre, self.n_chunk = n_pre, n_chunk
        self.per_layer = torch.zeros(n_layers, n_chunk, device=device)  # [L, C] float32

    def __call__(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                 k_pos: torch.Tensor | None) -> None:
        """q [S, Hq, hd] the question's queries at q_pos [S]; k [N, Hkv, hd] every key of the prompt, rotated."""
        k_pos = torch.arange(k.shape[0], device=q_pos.device) if k_pos is None else k_pos.to(q_pos.device)
        probs = attention_logits(q, k, q_pos, k_pos, exact=False).softmax(-1)  # [Hkv, g, S, N]
        chunk = probs[..., self.n_pre:self.n_pre + self.n_chunk]  # [Hkv, g, S, C]
        self.per_layer[layer] = chunk.mean(dim=(0, 1, 2))

    def fused(self, layers: range | None = None) -> torch.Tensor:
        """One score per chunk row [C]: each layer's reading made a distribution over the chunk rows (the sink and
        the question's own rows take most of some layers' attention), then averaged over `layers` (default all)."""
        rows = self.per_layer if layers is None else self.per_layer[layers.start:layers.stop]
        share = rows / rows.sum(dim=1, keepdim=True).clamp_min(1e-12)
        return share.mean(dim=0)


class KeptLayers:
    """A chunk KV source (blend/fusion.py's ChunkKVSource) that passes `source`'s layers on and keeps a copy of each,
    so that the blend after a preview reads them again without the store."""

    def __init__(self, source, keep_below: int | None = None):
        self.source, self.rotated, self.keep_below = source, source.rotated, keep_below
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s (k, v) [C, Hkv, hd] each: a kept copy, or the source's (layers past `keep_below`, which
        only the blend reads, pass through)."""
        if index in self.kept:
            return self.kept.pop(index)  # each layer is read once more, by the blend
        k, v = self.source.layer(index)
        if self.keep_below is not None and index >= self.keep_below:
            return k, v
        self.kept[index] = (k.clone(), v.clone())  # the loader may reuse its buffers
        return self.kept[index]


def preview(model: Transformer, preamble: LayerKV, rest_ids: torch.Tensor, n_chunk: int, source,
            rest_positions: torch.Tensor | None = None, layers: int = 0) -> tuple[torch.Tensor, KeptLayers]:
    """The question's reading [C] of the chunk rows over its first `layers` layers (0: every layer), from full KV
    reuse's pass over `source`'s layers (every chunk row loaded); those layers kept for the blend, the later ones
    passed on as the source gives them (see fusion.fused_prefill's arguments)."""
    n = model.cfg.n_layers if layers <= 0 else min(layers, model.cfg.n_layers)
    kept = KeptLayers(source, keep_below=n)
    reading = QueryReading(model.cfg.n_layers, len(preamble), n_chunk, model.device)
    fused_prefill(model, preamble, rest_ids, n_chunk, kept, n_chunk, None, 0, rest_positions=rest_positions,
                  tap=reading, layers=n)
    return reading.fused(range(n)), kept
