"""CacheBlend fusion: reuse loaded chunk KV, recompute only the tokens whose KV deviates most.

The prompt is preamble (exact KV) + chunks (loaded KV, keys before rotary) + suffix (computed):

    rows   = chunk tokens + suffix tokens, at absolute positions P .. N-1
    layer < check_layer:  every row is computed (its fresh K/V replace the loaded ones)
    layer = check_layer:  every row's K/V is computed; the top `ratio` share of chunk rows by
                          ||fresh - loaded|| (K, V or both), weighted by how much the suffix's
                          queries read each row, is selected, and from here on only the selected
                          rows and the suffix go on through attention and the MLP
    layer > check_layer:  selected + suffix rows computed; their fresh K/V overwrite the loaded
                          ones; every other chunk token's K/V is reused as loaded
    last layer:           those rows' K/V only; attention and the MLP for the last row alone, whose
                          logits are all that is read (as in every prefill here)
    keys are rotated to their absolute positions per layer (a fresh tensor; cached keys never change), by
                          the source as it loads them where it can (`rotated`), else here
    a computed row at position p sees exactly the keys at positions <= p

The first `exact_rows` chunk rows (the first chunk, when its loaded KV is the one it has here: computed right
after the preamble, and stored losslessly enough) are reused as loaded at every layer, as prefix caching does:
never computed, never ranked, yet counted among the chunk tokens the ratio is a share of (their deviation is
nil, so a ranking over every chunk row would never pick them either).

Baselines use the same engine with a fixed set of computed rows: full KV reuse (suffix only) and
prefix caching (all but the first chunk). With every chunk row selected it is a full prefill.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvrag.blend import selection
from kvrag.blend.config import BlendConfig
from kvrag.blend.selection import Check
from kvrag.model.cache import DecodeCache
from kvrag.model.prefill import LayerKV
from kvrag.model.step import Rows, layer_step
from kvrag.model.transformer import Transformer


class ChunkKVSource(Protocol):
    """Loaded KV of the reused chunk rows, one layer at a time (blocking until that layer is ready)."""

    rotated: bool  # keys come rotated to the rows' absolute positions in the prompt, not before rotary

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each [R_loaded, Hkv, hd], for the rows this source covers."""
        ...


@dataclass
class FusionResult:
    logits: torch.Tensor  # [V] at the last prompt position
    # every layer's rotated K and V of the whole prompt, ready to decode, but for a paged preamble's rows (left
    # unwritten: the pool holds them, and the sequence's table takes those blocks as they are)
    cache: DecodeCache
    selected: torch.Tensor  # chunk-row indices recomputed after the check (all chunk rows: full)
    compute_s: float = 0.0
    wait_s: float = 0.0  # time spent waiting for the loader
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)  # (kind, layer, start, end)
    # with keep_rest: per layer (K pre-rotary, V) of the chunk and suffix rows, each [C + S, Hkv, hd],
    # as they stood in this prompt (for the memory tiers' knowledge tree)
    rest_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def prompt_ratio(score: torch.Tensor, n_chunk: int, config: BlendConfig) -> float:
    """The share of chunk tokens this prompt recomputes, from the ranking at its first check (score [n] over every
    ranked chunk row): `ratio`, or with a deviation mass m, as many rows as it takes to hold m of the score's total
    on its norm's scale, between `ratio` and `max_ratio`. A prompt whose deviation is spread out gets more."""
    if config.deviation_mass <= 0 or n_chunk == 0 or score.numel() == 0:  # nothing ranked: one exact chunk
        return config.ratio
    # on the norm's scale: the squared score puts 88-92 % of its total in the top 15 % of rows on every
    # cross-passage prompt looked at; forced rows (inf) are kept anyway and count for nothing here
    norms = torch.nan_to_num(score.double(), posinf=0.0).sqrt()
    mass = norms.sort(descending=True).values.cumsum(0)
    reach = int(torch.searchsorted(mass, config.deviation_mass * mass[-1])) + 1
    return min(max(config.ratio, reach / n_chunk), max(config.ratio, config.max_ratio))


def keep_count(n_ranked: int, share: float, n_chunk: int, config: BlendConfig, ratio: float) -> int:
    """Rows to keep at a check whose schedule keeps `share` of the chunk tokens at the configured ratio, scaled to
    this prompt's `ratio`."""
    scale = ratio / config.ratio if config.ratio > 0 else 1.0
    return min(n_ranked, math.ceil(min(1.0, share * scale) * n_chunk))


class BlendKV:
    """A blend's KV target (model/step.py): the whole prompt's rotated K and V for each layer, assembled in place in
    the decode cache from the preamble's, the loaded chunk rows' (cast by the copy from the store's dtype) and the
    computed rows' (rows.index: their places among the rows after the preamble). With `rest_kv` the rows' keys
    before rotary are kept there too."""

    def __init__(self, model: Transformer, cache: DecodeCache, preamble: LayerKV, positions: torch.Tensor, rope,
                 rotated_source: bool, rest_kv: list | None):
        self.model, self.cache, self.preamble, self.rest_kv = model, cache, preamble, rest_kv
        self.positions, self.rope, self.rotated_source = positions, rope, rotated_source  # [N], cos/sin [N, 1, hd]
        self.loaded: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's loaded (k, v), set by the caller
        self.k_rot = self.v = None  # this layer's [N, Hkv, hd] each, between place and attend
        self.tap = None  # called with each layer's queries and keys (kv_budget.AttentionScore), where set

    def place(self, layer: int, rows: Rows, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        m, pre, loaded = self.model, self.preamble, self.loaded
        n_pre, n_total, n_paged = len(pre), self.positions.shape[0], pre.n_paged
        v_all = self.cache.v[layer, :n_total]  # rows before n_paged stay unwritten: attend reads them from the pool
        v_all[n_paged:n_pre] = pre.v[layer]
        if loaded is not None:
            v_all[n_pre:n_pre + loaded[1].shape[0]] = loaded[1]
        v_all[n_pre + rows.index] = new_v
        self.v = v_all
        if self.rotated_source or pre.rotated:  # only the computed rows' keys (and the preamble's) are rotated here
            k_rot = self.cache.k[layer, :n_total]
            if pre.rotated:
                k_rot[n_paged:n_pre] = pre.k[layer]
            else:
                m.rotate_keys(pre.k[layer], *self.at(0, n_pre), out=k_rot[:n_pre], layer=layer)
            if loaded is not None:
                end = n_pre + loaded[0].shape[0]
                k_rot[n_pre:end] = loaded[0] if self.rotated_source else \
                    m.rotate_keys(loaded[0], *self.at(n_pre, end), layer=layer)
            k_rot[n_pre + rows.index] = m.rotate_keys(new_k, rows.pos, rows.rope, layer=layer)
            self.k_rot = k_rot
            return
        k_all = torch.empty(n_total, m.cfg.n_kv_heads, m.cfg.head_dim, dtype=m.dtype, device=m.device)
        k_all[:n_pre] = pre.k[layer]
        if loaded is not None:
            k_all[n_pre:n_pre + loaded[0].shape[0]] = loaded[0]
        k_all[n_pre + rows.index] = new_k
        if self.rest_kv is not None:  # views: the decoder only writes past n_total
            self.rest_kv.append((k_all[n_pre:], v_all[n_pre:]))
        self.k_rot = m.rotate_keys(k_all, self.positions, self.rope, out=self.cache.k[layer, :n_total], layer=layer)

    def at(self, start: int, end: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rows start..end-1's positions [n] and rotary cos/sin [n, 1, hd], as rotate_keys takes them."""
        return self.positions[start:end], (self.rope[0][start:end], self.rope[1][start:end])

    def attend(self, layer: int, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        if self.tap is not None:
            self.tap(layer, q, rows.pos, self.k_rot, self.positions)
        paged = self.preamble.paged
        if paged is None:
            return self.model.attend(q, rows.pos, self.k_rot, self.v, self.positions, layer)
        n = len(paged)
        return self.model.attend(q, rows.pos, self.k_rot[n:], self.v[n:], self.positions, layer, paged.layer(layer))


class Selector:
    """CacheBlend's check at a layer of the selection schedule (model/step.py's one hook): every remaining row's K/V
    is computed and placed, the chunk rows are ranked by the selection rule, and only the kept ones and the suffix
    go on. Queries are computed for the kept rows alone: most ranked rows are dropped, and theirs would be 60 % of
    the layer's projection."""

    def __init__(self, model: Transformer, config: BlendConfig, n_chunk: int, chunk_starts: torch.Tensor | None,
                 selected: torch.Tensor, forced: torch.Tensor | None = None, prior: torch.Tensor | None = None):
        self.model, self.config, self.n_chunk, self.chunk_starts = model, config, n_chunk, chunk_starts
        self.forced = forced  # [C] bool: chunk rows kept at every check (a prompt's own text: it has no loaded KV)
        self.prior = prior  # [C] the preview's reading of every chunk row (blend/preview.py), for the rules that rank by it
        self.schedule = config.selection_schedule()
        self.first = min(self.schedule)
        self.ratio = config.ratio  # this prompt's share, set at the first check
        self.selected = selected  # chunk-row indices recomputed after the latest check

    def __call__(self, layer: int, rows: Rows, kv: BlendKV) -> tuple[Rows, torch.Tensor]:
        m, n_pre = self.model, len(kv.preamble)
        n_sel = int((rows.index < self.n_chunk).sum())  # the rows are the still-selected chunk rows, then the suffix
        x = m.attention_input(layer, rows.h)  # [R, D]
        new_k, new_v = m.project_kv(layer, x)  # [R, Hkv, hd] each
        q = m.queries(layer, x[n_sel:], (rows.rope[0][n_sel:], rows.rope[1][n_sel:]))  # the suffix's [S, Hq, hd]
        kv.place(layer, rows, new_k, new_v)
        chunk_part = rows.index[:n_sel]
        # fresh and loaded keys in the same frame (rotation is orthogonal: the distance is the same in either)
        fresh_k = kv.k_rot[n_pre + chunk_part] if kv.rotated_source else new_k[:n_sel]
        loaded_k, loaded_v = kv.loaded
        check = Check((fresh_k, new_v[:n_sel]), (loaded_k[chunk_part], loaded_v[chunk_part]), q,
                      kv.k_rot[n_pre + chunk_part], chunk_part, self.chunk_starts, m.cfg.group_size,
                      None if self.prior is None else self.prior[chunk_part])
        score = selection.score(check, self.config)
        if layer == self.first:
            self.ratio = prompt_ratio(score, self.n_chunk, self.config)
        n_keep = keep_count(n_sel, self.schedule[layer], self.n_chunk, self.config, self.ratio)
        if self.forced is not None:  # on top of the share: it is a share of the stored rows' work
            forced = self.forced[chunk_part]
            score = score.masked_fill(forced, math.inf)
            n_keep = min(n_sel, n_keep + int(forced.sum()))
        top = torch.topk(score, n_keep).indices.sort().values
        self.selected = chunk_part[top]
        keep = torch.cat([top, torch.arange(n_sel, len(rows), device=top.device)])  # places within `rows`
        rows = rows.take(keep)
        q = torch.cat([m.queries(layer, x[top], (rows.rope[0][:n_keep], rows.rope[1][:n_keep])), q])
        return rows, q


def fused_prefill(model: Transformer, preamble: LayerKV, rest_ids: torch.Tensor, n_chunk: int,
                  source: ChunkKVSource | None, loaded_rows: int, config: BlendConfig | None,
                  extra: int, keep_rest: bool = False, exact_rows: int = 0,
                  chunk_starts: torch.Tensor | None = None, rest_positions: torch.Tensor | None = None,
                  tap=None, forced: torch.Tensor | None = None, prior: torch.Tensor | None = None,
                  layers: int | None = None) -> FusionResult:
    """Prefill preamble + chunks + suffix reusing loaded chunk KV.

    rest_ids [C + S]: chunk tokens then suffix tokens (n_chunk = C). The source covers chunk rows
    0 .. loaded_rows-1 (all chunks for blend/reuse, the first chunk for prefix caching); rows beyond
    are computed at every layer. `config` None means no selection: loaded rows are reused at every
    layer (full reuse or prefix caching); otherwise CacheBlend selection over the loaded rows after the first
    `exact_rows`, which are reused as loaded at every layer (see the module doc). `chunk_starts` [K]: where each
    chunk begins among the chunk tokens (for `config.chunk_start_rows`). `rest_positions` [C + S]: the rows'
    absolute positions when they have gaps (reduced chunks: their kept tokens alone), else right after the preamble.
    `tap`: sees every layer's queries and keys (a decode-time budget's scores). `forced` [C] bool: chunk rows with
    no loaded KV worth the name (a prompt's own text), selected at every check on top of the ratio's share.
    `prior` [C]: the preview's reading of the chunk rows (blend/preview.py), for the rules that rank by it.
    `layers`: run the first this-many layers only (a preview's): no logits.
    """
    dev = model.device
    if tap is not None or keep_rest:  # these read every key from one tensor: the pool's rows are gathered
        preamble = preamble.dense()
    n_pre, n_rest = len(preamble), int(rest_ids.shape[0])
    n_total = n_pre + n_rest
    positions = torch.arange(n_total, device=dev)
    if rest_positions is not None:
        positions[n_pre:] = rest_positions.to(dev)
    rope = model.positions_cos_sin(positions)
    cache = DecodeCache(model, n_total + extra)
    cache.length, cache.offset = n_total, int(positions[-1]) + 1 - n_total
    # chunk rows computed at every layer: those not loaded (all of them in a full prefill)
    result = FusionResult(torch.empty(0), cache, torch.arange(loaded_rows, n_chunk, device=dev))
    # loaded keys already at their positions: only the preamble's and the computed rows' are rotated here
    rotated_source = loaded_rows > 0 and getattr(source, "rotated", False)
    if keep_rest and (rotated_source or preamble.rotated):
        raise ValueError("keep_rest keeps keys before rotary, which a rotated source or exact prefix does not hand out")
    result.rest_kv = [] if keep_rest else None
    kv = BlendKV(model, cache, preamble, positions, rope, rotated_source, result.rest_kv)
    kv.tap = tap
    selector = Selector(model, config, n_chunk, chunk_starts, result.selected, forced, prior) \
        if config is not None else None
    # the rows (indices into rest) that go through attention and the MLP at the first layer
    index = torch.arange(loaded_rows if config is None else exact_rows, n_rest, device=dev)
    rows = Rows(model.embed(rest_ids[index]), positions[n_pre:][index], (rope[0][n_pre + index], rope[1][n_pre + index]),
                index, prompt=True)
    n_layers = model.cfg.n_layers if layers is None else min(layers, model.cfg.n_layers)
    for layer in range(n_layers):
        uses_loaded = loaded_rows > 0 and (selector is None or layer >= selector.first or exact_rows > 0)
        kv.loaded = None
        if uses_loaded:  # wait for the loader first, so compute spans exclude the wait
            w0 = time.perf_counter()
            kv.loaded = source.layer(layer)  # (k, v) [loaded_rows, Hkv, hd] each
            result.wait_s += time.perf_counter() - w0
        t0 = time.perf_counter()
        check = selector if selector is not None and uses_loaded and layer in selector.schedule else None
        rows = layer_step(model, layer, rows, kv, check)
        t1 = time.perf_counter()
        result.spans.append(("compute", layer, t0, t1))
        result.compute_s += t1 - t0
    if selector is not None:
        result.selected = selector.selected
    if n_layers == model.cfg.n_layers:
        result.logits = model.logits(rows.h[-1:])[0]
    return result
