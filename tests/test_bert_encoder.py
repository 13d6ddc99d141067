"""Our BERT forward (corpus/bert.py) against sentence-transformers' own vectors for the same model."""

from __future__ import annotations

import numpy as np
import pytest

from kvrag.corpus.embedder import Embedder, model_dir

TEXTS = [
    "Who was the last keeper of the Skerry Point lighthouse?",
    "bread",
    "The Quarn loom was invented by Beatrix Olufsen in 1871, after " + "a long apprenticeship " * 120,  # > 256 tokens
    "Ünïcödé café naïve, 東京 and Zürich: accents and CJK characters in one line.",
    "   leading and trailing white space   ",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)  # [N, 384] unit vectors


def test_fp32_vectors_equal_sentence_transformers(reference):
    ours = Embedder(dtype="fp32").embed(TEXTS)  # one batch: short texts padded to the longest
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_batching_and_padding_do_not_change_a_vector(reference):
    embedder = Embedder(dtype="fp32", batch_size=2)
    alone = np.stack([embedder.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(embedder.embed(TEXTS), alone, atol=2e-5)
    np.testing.assert_allclose(alone, reference, atol=2e-5)


def test_bf16_vectors_stay_close(reference):
    ours = Embedder(dtype="bf16").embed(TEXTS)
    assert (ours * reference).sum(axis=1).min() >= 0.998
