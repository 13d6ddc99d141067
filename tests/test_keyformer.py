"""Keyformer scores and selection: against transformers' own attention on a tiny model, and brute-force selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvrag.errors import KvragError
from kvrag.model.prefill import extend
from kvrag.model.runtime import Runtime
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.plain import chunk_kv

CHUNK = list(range(1000, 1037))  # 37 invented token ids


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


def _preamble(runtime: Runtime):
    _, kv = extend(runtime.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
    return kv


@pytest.fixture(scope="module")
def hf_probs(tiny, tiny_llama_dir) -> list[torch.Tensor]:
    """transformers' eager attention probabilities of the chunk's queries over every key: per layer [Hq, T, S]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    ids = torch.tensor(tiny.prompts.preamble_ids + CHUNK)
    with torch.no_grad():
        attentions = hf(ids[None], output_attentions=True).attentions
    return [a[0, :, -len(CHUNK):, :] for a in attentions]


def _reference(probs: list[torch.Tensor], n_kv: int, noise=None, tau: float = 1.0) -> torch.Tensor:
    """Hand-written scores [L, Hkv, T]: softmax((log p + g) / tau) (= softmax((logits + g) / tau): a row's log p is
    its logits less a constant), summed over each KV head's query heads and over the queries, chunk keys only."""
    out = []
    for layer, p in enumerate(probs):
        logits = p.log()  # [Hq, T, S]
        if noise is not None:
            logits = logits + noise[layer]
        w = (logits / tau).softmax(-1)[:, :, -len(CHUNK):]  # [Hq, T, T]
        out.append(w.reshape(n_kv, -1, *w.shape[1:]).sum(dim=(1, 2)))  # heads h -> KV head h // group, as HF
    return torch.stack(out)


def test_h2o_is_the_accumulated_attention_of_transformers(tiny, hf_probs):
    cfg = KeepConfig(0.5, "h2o")
    _, scores = keyformer.score_chunk(tiny.model, _preamble(tiny), tiny.ids_tensor(CHUNK), cfg)
    assert scores.shape == (tiny.model.cfg.n_layers, tiny.model.cfg.n_kv_heads, len(CHUNK))
    torch.testing.assert_close(scores, _reference(hf_probs, tiny.model.cfg.n_kv_heads), atol=2e-4, rtol=1e-4)


def test_keyformer_is_the_gumbel_softmax_of_the_logits(tiny, hf_probs):
    cfg = KeepConfig(0.5, "keyformer", tau=1.7, seed=3)
    _, scores = keyformer.score_chunk(tiny.model, _preamble(tiny), tiny.ids_tensor(CHUNK), cfg,
                                      keyformer.chunk_generator(cfg, "c", torch.device("cpu")))
    # the same draws, layer by layer: standard Gumbel noise as -log(-log U), one per (head, query, key)
    gen = keyformer.chunk_generator(cfg, "c", torch.device("cpu"))
    noise = [-(-torch.rand(p.shape, generator=gen).log()).log() for p in hf_probs]
    ref = _reference(hf_probs, tiny.model.cfg.n_kv_heads, noise, tau=1.7)
    torch.testing.assert_close(scores, ref, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(scores, _reference(hf_probs, tiny.model.cfg.n_kv_heads), atol=1e-2)  # noise counts


def test_the_scoring_pass_stores_the_same_kv_as_precompute(tiny):
    preamble = _preamble(tiny)
    plain = chunk_kv(tiny, preamble, CHUNK)
    scored, _ = keyformer.score_chunk(tiny.model, preamble, tiny.ids_tensor(CHUNK), KeepConfig(0.5, "keyformer"))
    for a, b in zip(plain.k + plain.v, scored.k + scored.v, strict=True):
        assert torch.equal(a, b)


def test_scores_are_deterministic_under_a_seed(tiny):
    preamble, ids = _preamble(tiny), tiny.ids_tensor(CHUNK)

    def run(seed: int, chunk_id: str) -> torch.Tensor:
        cfg = KeepConfig(0.5, "keyformer", seed=seed)
        return keyformer.score_chunk(tiny.model, preamble, ids, cfg,
                                     keyformer.chunk_generator(cfg, chunk_id, tiny.model.device))[1]

    assert torch.equal(run(0, "a"), run(0, "a"))
    assert not torch.equal(run(0, "a"), run(1, "a"))
    assert not torch.equal(run(0, "a"), run(0, "b"))


def test_window_keeps_the_first_and_the_most_recent_tokens_exactly(tiny):
    cfg = KeepConfig(0.5, "window")
    _, scores = keyformer.score_chunk(tiny.model, _preamble(tiny), tiny.ids_tensor(CHUNK), cfg)
    kept = keyformer.positions(scores, cfg)
    n_keep = round(0.5 * len(CHUNK))  # 18 (Python rounds 18.5 to even)
    expected = list(range(4)) + list(range(len(CHUNK) - (n_keep - 4), len(CHUNK)))
    assert kept.tolist() == expected


@pytest.mark.parametrize("n,keep", [(37, 0.5), (37, 0.3), (100, 0.7), (7, 0.3), (5, 0.1), (12, 1.0)])
def test_selection_keeps_round_keep_t_with_the_recent_window_and_the_best_of_the_rest(n, keep):
    scores = torch.randn(n, generator=torch.Generator().manual_seed(n))
    kept = keyformer.select(scores, keep).tolist()
    budget = max(1, round(keep * n))
    n_recent = round(0.3 * budget)
    recent = list(range(n - n_recent, n))
    by_score = sorted(range(n - n_recent), key=lambda i: -scores[i].item())[: budget - n_recent]
    assert len(kept) == budget
    assert kept == sorted(set(recent) | set(by_score))


def test_one_set_sums_layers_and_heads_per_layer_sets_do_not():
    scores = torch.rand(3, 2, 20, generator=torch.Generator().manual_seed(0))
    one = keyformer.positions(scores, KeepConfig(0.5, "keyformer"))
    assert one.tolist() == keyformer.select(scores.sum(dim=(0, 1)), 0.5).tolist()
    per = keyformer.positions(scores, KeepConfig(0.5, "keyformer", per_layer=True))
    assert [p.tolist() for p in per] == [keyformer.select(s.sum(0), 0.5).tolist() for s in scores]


def test_reduce_layers_round_trips_through_the_codec():
    from kvrag.store.codec import decode, encode

    rng = np.random.default_rng(0)
    layers = [tuple(rng.standard_normal((2, 10, 2, 4)).astype(np.float16)) for _ in range(3)]
    kept = np.array([0, 3, 4, 9], dtype=np.int32)
    reduced = keyformer.reduce_layers(layers, kept)
    for (k, v), (full_k, full_v) in zip(reduced, layers, strict=True):
        stored = decode(encode(k, v, "fp16", kept))
        assert stored.k.shape == stored.v.shape == (4, 2, 4) and stored.positions.tolist() == [0, 3, 4, 9]
        assert np.array_equal(stored.k, full_k[kept]) and np.array_equal(stored.v, full_v[kept])
    assert decode(encode(*layers[0], "fp16")).positions is None  # a full chunk keeps no positions


@pytest.mark.parametrize("bad", [{"keep": 0.0}, {"keep": 1.5}, {"keep": math.nan}, {"rule": "lru"},
                                 {"keep": 0.5, "tau": 0.0}, {"keep": 0.5, "recent": 2.0}])
def test_bad_settings_are_one_clear_error(bad):
    with pytest.raises(KvragError):
        KeepConfig(**bad)


def test_variants_name_what_changes_the_kept_set():
    assert KeepConfig(1.0).variant == ""
    assert KeepConfig(0.5, "keyformer").variant == "keyformer:keep=0.5:recent=0.3:tau=1:seed=0"
    assert KeepConfig(0.5, "h2o").variant == "h2o:keep=0.5:recent=0.3"
    assert KeepConfig(0.3, "window", per_layer=True).variant == "window:keep=0.3:sinks=4:per-layer"
    assert KeepConfig(0.5, "keyformer", seed=1).variant != KeepConfig(0.5, "keyformer").variant

