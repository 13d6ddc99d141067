"""Query-aware selection (issue 49): the preview's reading of each chunk row against transformers' own attention, the
new rules on cases worked out by hand, and a blend that previews equal to full prefill at ratio 1."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.preview import KeptLayers, QueryReading, preview
from kvrag.blend.selection import Check, score
from kvrag.load.layer_work import ChunkRef
from kvrag.load.loader import open_loader
from kvrag.model.prefill import extend
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv

CHUNK = list(range(1000, 1041))  # 41 invented token ids
QUESTION = "Which number comes first?"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


def _check(rows: torch.Tensor, starts: torch.Tensor | None, fresh_v: torch.Tensor, prior: torch.Tensor | None) -> Check:
    r, hd = rows.shape[0], 4
    keys = torch.zeros(r, 1, hd)
    q = torch.zeros(1, 1, hd)
    return Check((keys, fresh_v), (keys, torch.zeros(r, 1, hd)), q, keys, rows, starts, 1, prior)


def test_epic_ranks_every_chunk_start_first():
    """Chunks of 4, 3 and 3 rows: the top three are the three starts, then each chunk's second row."""
    rows, starts = torch.arange(10), torch.tensor([0, 4, 7])
    ranked = score(_check(rows, starts, torch.zeros(10, 1, 4), None), BlendConfig(selection="epic"))
    assert sorted(torch.topk(ranked, 3).indices.tolist()) == [0, 4, 7]
    assert sorted(torch.topk(ranked, 6).indices.tolist()) == [0, 1, 4, 5, 7, 8]


def test_query_ranks_by_the_prior_and_chunks_by_the_chunk_it_falls_in():
    """`query` is the preview's reading itself; `chunks` (A3) weighs each row's deviation by its chunk's share of it:
    the reading [.1 .1 | .6 .2] gives the second chunk 0.8 of 1.0 (weight 1.6, the first 0.4), so row 2 (deviation 1)
    overtakes row 0 (deviation 2): 1.6 x 1 > 0.4 x 2."""
    rows, starts = torch.arange(4), torch.tensor([0, 2])
    prior = torch.tensor([0.1, 0.1, 0.6, 0.2])
    fresh_v = torch.zeros(4, 1, 4)
    fresh_v[0, 0, 0], fresh_v[2, 0, 0] = 2 ** 0.5, 1.0  # squared deviations 2 and 1
    check = _check(rows, starts, fresh_v, prior)
    torch.testing.assert_close(score(check, BlendConfig(selection="query")), prior)
    chunks = score(check, BlendConfig(selection="chunks"))
    torch.testing.assert_close(chunks, torch.tensor([2 * 0.4, 0.0, 1.6, 0.0]))
    blended = score(check, BlendConfig(selection="query-deviation", attention_weight=4.0))
    torch.testing.assert_close(blended, torch.tensor([2 * (1 + 4 * 0.1 / 0.25), 0.0, 1 + 4 * 0.6 / 0.25, 0.0]))
    # without a preview (a caller that ran none) the query rule falls back to the check layer's reading
    no_prior = _check(rows, starts, fresh_v, None)
    assert score(no_prior, BlendConfig(selection="query")).shape == (4,)


def test_preview_reads_what_transformers_attention_reads(tiny, tiny_llama_dir):
    """A chunk computed right after the preamble is what full prefill computes there, so the preview (the question over
    its loaded KV) sees full prefill's attention: per layer, the question's softmax weights on the chunk rows,
    averaged over its queries and heads, equal transformers' eager attention probabilities (at the last layer, the
    last query's)."""
    from transformers import AutoModelForCausalLM

    rt = tiny
    _, pre = extend(rt.model, None, rt.ids_tensor(rt.prompts.preamble_ids))
    suffix = rt.prompts.build([], QUESTION).suffix
    with torch.inference_mode():
        kv = chunk_kv(rt, pre, CHUNK)
        loader = open_loader(None, [ChunkRef("c", CHUNK, kv)], range(rt.model.cfg.n_layers), rt.model.dtype,
                             rt.model.device).start()
        reading = QueryReading(rt.model.cfg.n_layers, len(pre), len(CHUNK), rt.model.device)
        kept = KeptLayers(loader)
        from kvrag.blend.fusion import fused_prefill

        fused_prefill(rt.model, pre, rt.ids_tensor(CHUNK + suffix), len(CHUNK), kept, len(CHUNK), None, 0, tap=reading)
        loader.close()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    ids = torch.tensor(rt.prompts.preamble_ids + CHUNK + suffix)
    with torch.no_grad():
        attentions = hf(ids[None], output_attentions=True).attentions  # per layer [1, Hq, T, T]
    n_pre, s = len(pre), len(suffix)
    for layer, probs in enumerate(attentions):
        # the last layer computes the last row alone (all a prefill reads of it): its query is the reading there
        queries = slice(-1, None) if layer == len(attentions) - 1 else slice(-s, None)
        want = probs[0, :, queries, n_pre:n_pre + len(CHUNK)].mean(dim=(0, 1))  # [C]
        torch.testing.assert_close(reading.per_layer[layer], want, atol=1e-6, rtol=1e-4)
    # the kept layers are the loader's, copied: a second read gives the same tensors without the loader
    torch.testing.assert_close(kept.layer(0)[1], kv.v[0])
    fused = reading.fused()
    assert fused.shape == (len(CHUNK),) and torch.isclose(fused.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("rule", ["query", "chunks-preview", "query-deviation", "chunks"])
def test_a_previewing_blend_at_ratio_one_is_full_prefill(tiny, rule):
    """Through the prefiller: the preview's extra pass and its kept layers change nothing when every row is
    recomputed; at the default ratio it recomputes the share asked for."""
    from kvrag.engine.prefiller import Prefiller

    pf = Prefiller(tiny)
    other = list(range(2000, 2033))
    chunks = [("a", CHUNK), ("b", other)]
    full = pf.prefill(chunks, QUESTION, "full").logits
    whole = pf.prefill(chunks, QUESTION, "blend", BlendConfig(ratio=1.0, selection=rule))
    torch.testing.assert_close(whole.logits, full, atol=1e-4, rtol=1e-4)
    part = pf.prefill(chunks, QUESTION, "blend", BlendConfig(ratio=0.2, selection=rule))
    assert 0 < part.recomputed_chunk_tokens < len(CHUNK) + len(other)


@pytest.mark.parametrize("layers", [0, 2])
def test_preview_keeps_each_layer_once(tiny, layers):
    """`preview` reads every layer of its source once: the ones it reads itself (all, or the first `layers`) are kept
    for the blend after it, the later ones pass through as the source gives them."""
    rt = tiny
    _, pre = extend(rt.model, None, rt.ids_tensor(rt.prompts.preamble_ids))
    suffix = rt.prompts.build([], QUESTION).suffix

    class Counting:
        rotated = False

        def __init__(self, kv):
            self.kv, self.reads = kv, []

        def layer(self, index):
            self.reads.append(index)
            return self.kv.k[index], self.kv.v[index]

    with torch.inference_mode():
        source = Counting(chunk_kv(rt, pre, CHUNK))
        prior, kept = preview(rt.model, pre, rt.ids_tensor(CHUNK + suffix), len(CHUNK), source, layers=layers)
        n = layers or rt.model.cfg.n_layers
        assert source.reads == list(range(n)) and sorted(kept.kept) == list(range(n))
        for layer in range(rt.model.cfg.n_layers):
            kept.layer(layer)
    assert source.reads == list(range(rt.model.cfg.n_layers)) and prior.shape == (len(CHUNK),)
    assert not kept.kept  # every copy handed over once


def test_a_rule_that_ranks_by_the_preview_checks_at_layer_zero():
    """The preview's rules need nothing the check layer computes, so they rank at layer 0 (a row's layer-0 K/V is
    the same in any context); the others at CacheBlend's layer 1; an explicit check layer is kept either way."""
    wide = 0.2 * 1.5  # gradual filtering's first share
    assert BlendConfig(ratio=0.2, selection="query").selection_schedule() == {0: pytest.approx(wide), 1: 0.2}
    assert BlendConfig(ratio=0.2, selection="chunks").selection_schedule() == {1: pytest.approx(wide), 2: 0.2}
    assert BlendConfig(ratio=0.2, selection="query", check_layer=2).selection_schedule() == {
        2: pytest.approx(wide), 3: 0.2}
    assert BlendConfig(selection="query", gradual=False).check_at == 0
