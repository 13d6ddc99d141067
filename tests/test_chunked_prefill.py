"""A full prefill run a piece at a time against transformers' logits and the one-piece prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrag.model.decode import generate
from kvrag.model.files import resolve_model
from kvrag.model.prefill import ChunkedPrefill, prefill
from kvrag.model.sampling import SamplingConfig
from kvrag.model.transformer import Transformer


def _model(path) -> Transformer:
    local = resolve_model(str(path))
    return Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)


@pytest.mark.parametrize("piece", [1, 7, 16, 45])
def test_pieces_give_transformers_logits_and_cache(tiny_llama_dir, piece):
    ids = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(11))
    model = _model(tiny_llama_dir)
    job = ChunkedPrefill(model, ids, extra=4)
    advances = 0
    while not job.advance(piece):
        assert job.logits is None  # nothing to read before the last piece
        advances += 1
    assert advances + 1 == -(-45 // piece) and job.cache.length == 45
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0, -1]
    torch.testing.assert_close(job.logits, want, rtol=1e-4, atol=1e-4)
    _, whole = prefill(model, ids, extra=4)  # every position's K and V as one piece computes them
    torch.testing.assert_close(job.cache.k[:, :45], whole.k[:, :45], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(job.cache.v[:, :45], whole.v[:, :45], rtol=1e-5, atol=1e-5)


def test_decoding_after_pieces_matches_one_piece(tiny_qwen2_dir):
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(12))
    model = _model(tiny_qwen2_dir)
    job = ChunkedPrefill(model, ids, extra=16)
    while not job.advance(9):
        pass
    logits, cache = prefill(model, ids, extra=16)
    sampling = SamplingConfig(max_tokens=16)
    assert list(generate(model, job.cache, job.logits, sampling, set())) == \
        list(generate(model, cache, logits, sampling, set()))
