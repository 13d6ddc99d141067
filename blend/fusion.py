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

from kvrag import KvragError
from kvrag.blend import selection
from kvrag.blend.decode import DecodeCache
from kvrag.blend.model import Transformer
from kvrag.blend.prefill import LayerKV
from kvrag.blend.selection import Check

DEVIATIONS = ("k", "v", "kv")
WIDER_AT_CHECK = 1.5  # gradual filtering: the share kept at the check layer, as a multiple of the ratio
ATTENTION_WEIGHT = 4.0  # first 50 MuSiQue items, ratio 0.15: mean first-token KL 0.041 at 1, 0.037 at 2, 0.035 at 4


@dataclass(frozen=True)
class BlendConfig:
    ratio: float = 0.15  # share of chunk tokens recomputed from the check layer on
    check_layer: int = 1  # layers before it are computed for every token
    deviation: str = "v"  # what ||fresh - loaded|| is measured on
    gradual: bool = True  # select 1.5x the share at the check layer, `ratio` at the next (CacheBlend's gradual filtering)
    # rank by deviation x (1 + attention_weight x how much the suffix reads the token / the mean): a token's
    # error reaches the answer through the question's attention to it; 0 ranks by deviation alone (see the
    # docs/performance.md's measurements for the default)
    attention_weight: float = ATTENTION_WEIGHT
    # reuse the first chunk's KV as loaded when it is exact there (it follows the preamble), as prefix caching
    # does, instead of computing its rows at the layers up to the check and ranking them
    exact_first_chunk: bool = True
    # recompute the first this-many tokens of every chunk after the first at the selected layers, whatever their
    # deviation (EPIC: the attention sink at each chunk's start carries much of a loaded chunk's error)
    chunk_start_rows: int = 0
    # with mass m > 0, the share kept at the last check grows past `ratio` until the kept rows hold m of the
    # selection score's total on its norm's scale (up to max_ratio): a prompt whose deviation is spread out gets more
    deviation_mass: float = 0.0
    max_ratio: float = 0.5
    selection: str = "cacheblend"  # the rule that ranks chunk rows at a check (blend/selection.py's RULES)

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise KvragError(f"--ratio must be between 0 and 1 (or auto), got {self.ratio}")
        if self.check_layer < 0:
            raise KvragError(f"--check-layer must be >= 0, got {self.check_layer}")
        if self.deviation not in DEVIATIONS:
            raise KvragError(f"--deviation must be one of {', '.join(DEVIATIONS)}, got {self.deviation}")
        if self.selection not in selection.RULES:
            raise KvragError(f"--selection must be one of {', '.join(selection.RULES)}, got {self.selection}")
        if not 0.0 <= self.attention_weight < math.inf:
            raise KvragError(f"--attention-weight must be a number >= 0, got {self.attention_weight}")
        if self.chunk_start_rows < 0:
            raise KvragError(f"--chunk-start-rows must be >= 0, got {self.chunk_start_rows}")
        if not 0.0 <= self.deviation_mass < 1.0:
            raise KvragError(f"--deviation-mass must be in [0, 1), got {self.deviation_mass}")

    def selection_schedule(self) -> dict[int, float]:
        """Layer -> share of chunk tokens kept after that layer's check."""
        if not self.gradual or self.ratio >= 1.0:
            return {self.check_layer: self.ratio}
        # start wider and narrow down to `ratio` at the next layer. First 50 MuSiQue items, ratio 0.15, attention
        # weight 4, bf16: mean first-token KL 0.0526 with no narrowing, 0.0442 from 1.5x, 0.0420 from 2x, 0.0349
        # from 2x over two layers (2x, 1.5x, 1x), top-1 49/50 each; every wider row at a check layer costs a
        # blended layer's row, so 1.5x over one layer saves about one blended layer (of 30) on the 2x-1.5x schedule
        return {self.check_layer: min(1.0, self.ratio * WIDER_AT_CHECK), self.check_layer + 1: self.ratio}


class ChunkKVSource(Protocol):
    """Loaded KV of the reused chunk rows, one layer at a time (blocking until that layer is ready)."""

    rotated: bool  # keys come rotated to the rows' absolute positions in the prompt, not before rotary

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each [R_loaded, Hkv, hd], for the rows this source covers."""
        ...


@dataclass
class FusionResult:
    logits: torch.Tensor  # [V] at the last prompt position
    cache: DecodeCache  # every layer's rotated K and V of the whole prompt, ready to decode
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


def _assemble_kv(model: Transformer, cache: DecodeCache, layer: int, preamble: LayerKV, positions: torch.Tensor,
                 rope, rows: torch.Tensor, rows_rope, new_k: torch.Tensor, new_v: torch.Tensor,
                 loaded: tuple[torch.Tensor, torch.Tensor] | None, rotated_source: bool,
                 rest_kv: list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole prompt's rotated K and V for this layer, [N, Hkv, hd] each, assembled in place in the decode cache:
    the preamble's, the loaded chunk rows' (cast by the copy from the store's dtype), and the computed `rows`' (indices
    into the rows after the preamble). With `rest_kv` the rows' keys before rotary are kept there too."""
    n_pre, n_total = len(preamble), positions.shape[0]
    v_all = cache.v[layer, :n_total]
    v_all[:n_pre] = preamble.v[layer]
    if loaded is not None:
        v_all[n_pre:n_pre + loaded[1].shape[0]] = loaded[1]
    v_all[n_pre + rows] = new_v
    if rotated_source:  # loaded keys come rotated: only the preamble's and the computed rows' are rotated here
        k_rot = cache.k[layer, :n_total]
        model.rotate_keys(preamble.k[layer], positions[:n_pre], (rope[0][:n_pre], rope[1][:n_pre]), out=k_rot[:n_pre])
        if loaded is not None:
            k_rot[n_pre:n_pre + loaded[0].shape[0]] = loaded[0]
        k_rot[n_pre + rows] = model.rotate_keys(new_k, positions[n_pre:][rows], rows_rope)
        return k_rot, v_all
    k_all = torch.empty(n_total, model.cfg.n_kv_heads, model.cfg.head_dim, dtype=model.dtype, device=model.device)
    k_all[:n_pre] = preamble.k[layer]
    if loaded is not None:
        k_all[n_pre:n_pre + loaded[0].shape[0]] = loaded[0]
    k_all[n_pre + rows] = new_k
    if rest_kv is not None:  # views: the decoder only writes past n_total
        rest_kv.append((k_all[n_pre:], v_all[n_pre:]))
    return model.rotate_keys(k_all, positions, rope, out=cache.k[layer, :n_total]), v_all


def _project(model: Transformer, layer: int, h: torch.Tensor, pos: torch.Tensor, rope, n_ranked: int | None):
    """x (the attention input, or None), k, v and q of rows h [R, D] at positions `pos`. At a check (`n_ranked` of
    the rows to rank, then the suffix) q is the suffix's alone: most ranked rows are dropped, and their queries
    would be 60 % of that layer's projection; the kept ones get theirs from x once they are known."""
    if n_ranked is None:
        qkv = model.project(layer, h, pos, rope)
        return None, qkv.k, qkv.v, qkv.q
    x = model.attention_input(layer, h)  # [R, D]
    k, v = model.project_kv(layer, x)  # [R, Hkv, hd] each
    return x, k, v, model.queries(layer, x[n_ranked:], (rope[0][n_ranked:], rope[1][n_ranked:]))  # q [S, Hq, hd]


def fused_prefill(model: Transformer, preamble: LayerKV, rest_ids: torch.Tensor, n_chunk: int,
                  source: ChunkKVSource | None, loaded_rows: int, config: BlendConfig | None,
                  extra: int, keep_rest: bool = False, exact_rows: int = 0,
                  chunk_starts: torch.Tensor | None = None) -> FusionResult:
    """Prefill preamble + chunks + suffix reusing loaded chunk KV.

    rest_ids [C + S]: chunk tokens then suffix tokens (n_chunk = C). The source covers chunk rows
    0 .. loaded_rows-1 (all chunks for blend/reuse, the first chunk for prefix caching); rows beyond
    are computed at every layer. `config` None means no selection: loaded rows are reused at every
    layer (full reuse or prefix caching); otherwise CacheBlend selection over the loaded rows after the first
    `exact_rows`, which are reused as loaded at every layer (see the module doc). `chunk_starts` [K]: where each
    chunk begins among the chunk tokens (for `config.chunk_start_rows`).
    """
    dev = model.device
    n_pre, n_rest = len(preamble), int(rest_ids.shape[0])
    n_total = n_pre + n_rest
    positions = torch.arange(n_total, device=dev)
    rope = model.positions_cos_sin(positions)
    rest_pos = positions[n_pre:]
    cache = DecodeCache(model, n_total + extra)
    cache.length = n_total
    # chunk rows computed at every layer: those not loaded (all of them in a full prefill)
    result = FusionResult(torch.empty(0), cache, torch.arange(loaded_rows, n_chunk, device=dev))
    # loaded keys already at their positions: only the preamble's and the computed rows' are rotated here
    rotated_source = loaded_rows > 0 and getattr(source, "rotated", False)
    if keep_rest:
        if rotated_source:
            raise ValueError("keep_rest keeps keys before rotary: give a source that hands them out so")
        result.rest_kv = []

    schedule = config.selection_schedule() if config is not None else {}
    first_check = min(schedule) if schedule else None
    ratio_here = config.ratio if config is not None else 0.0  # this prompt's share, set at the first check
    # rows (indices into rest) that go through attention and the MLP at the current layer
    rows = torch.arange(loaded_rows if config is None else exact_rows, n_rest, device=dev)
    h = model.embed(rest_ids[rows])  # [R, D]
    rest_rope = (rope[0][n_pre:], rope[1][n_pre:])  # cos, sin [C + S, 1, hd]
    rows_rope = (rest_rope[0][rows], rest_rope[1][rows])  # gathered again only when the rows change

    for layer in range(model.cfg.n_layers):
        uses_loaded = loaded_rows > 0 and (config is None or layer >= first_check or exact_rows > 0)
        if uses_loaded:  # wait for the loader first, so compute spans exclude the wait
            w0 = time.perf_counter()
            loaded_k, loaded_v = source.layer(layer)  # [loaded_rows, Hkv, hd]
            result.wait_s += time.perf_counter() - w0
        t0 = time.perf_counter()
        selecting = layer in schedule and uses_loaded
        # with a check at this layer, the rows are the still-selected chunk rows, then the suffix
        n_sel = int((rows < n_chunk).sum()) if selecting else 0
        x, new_k, new_v, q = _project(model, layer, h, rest_pos[rows], rows_rope, n_sel if selecting else None)
        loaded = (loaded_k, loaded_v) if uses_loaded else None
        k_rot, v_all = _assemble_kv(model, cache, layer, preamble, positions, rope, rows, rows_rope, new_k, new_v,
                                    loaded, rotated_source, result.rest_kv)
        if selecting:
            chunk_part = rows[:n_sel]
            # fresh and loaded keys in the same frame (rotation is orthogonal: the distance is the same in either)
            fresh_k = k_rot[n_pre + chunk_part] if rotated_source else new_k[:n_sel]
            check = Check((fresh_k, new_v[:n_sel]), (loaded_k[chunk_part], loaded_v[chunk_part]), q,
                          k_rot[n_pre + chunk_part], chunk_part, chunk_starts, model.cfg.group_size)
            score = selection.score(check, config)
            if layer == first_check:
                ratio_here = prompt_ratio(score, n_chunk, config)
            n_keep = keep_count(n_sel, schedule[layer], n_chunk, config, ratio_here)
            top = torch.topk(score, n_keep).indices.sort().values
            result.selected = chunk_part[top]
            keep = torch.cat([top, torch.arange(n_sel, rows.shape[0], device=dev)])  # positions within `rows`
            rows, h = rows[keep], h[keep]
            rows_rope = (rest_rope[0][rows], rest_rope[1][rows])
            q = torch.cat([model.queries(layer, x[top], (rows_rope[0][:n_keep], rows_rope[1][:n_keep])), q])
        out = model.rows_read_after(layer, rows.shape[0])  # the last layer: only the last row goes on
        rows, h, q = rows[out], h[out], q[out]
        attn = model.attend(q, rest_pos[rows], k_rot, v_all, positions)
        h = model.finish(layer, h, attn)
        t1 = time.perf_counter()
        result.spans.append(("compute", layer, t0, t1))
        result.compute_s += t1 - t0
    result.logits = model.logits(h[-1:])[0]
    return result
