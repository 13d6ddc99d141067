"""A prompt's positions are read back to the host once, not once a layer (kernels/attention.py, PositionShape).

On a GPU each such read (a tensor's bool, int, item or tolist) is a sync: the host waits for the device to drain
before it can queue the next layer's kernels. Counted on tiny models of 4 and 8 layers: a full prefill, a blend and
a batched decode step make as many reads at either depth, on the CPU's path and on the GPU's (Triton for a blend's
scattered rows and for decode, under the interpreter here). Before, each layer read them again (SmolLM2's full
prefill: 152 reads, its blend 338; now 4 and 21)."""

from __future__ import annotations

import pytest
import torch

from kvrag.blend.config import BlendConfig
from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.kv_pool import SequenceKV
from kvrag.engine.prefiller import Prefiller
from kvrag.model.prefill import prefill
from kvrag.model.runtime import Runtime
from kvrag.precompute.plain import chunk_kv, layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.tests.conftest import _tiny_model_dir

QUESTION = "Where was the performer born?"
READS = ("__bool__", "__int__", "__index__", "__float__", "item", "tolist")


@pytest.fixture(scope="module")
def deep(tmp_path_factory, smol) -> dict[int, Runtime]:
    return {n: Runtime.load(str(_tiny_model_dir(tmp_path_factory.mktemp(f"layers{n}"), smol, "llama",
                                                num_hidden_layers=n)), "float32") for n in (4, 8)}


def _host_reads(run) -> int:
    """How many times `run()` reads a tensor back to the host."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def read(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        return read

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return count[0]


def _gpu_path(runtime: Runtime, monkeypatch) -> None:
    """The choices a GPU makes: Triton for scattered rows and decode, no native row kernel."""
    monkeypatch.setattr(runtime.model, "triton", True)
    monkeypatch.setattr(runtime.model, "uses_row_kernel", lambda: False)


def _chunks(runtime: Runtime, items) -> list[tuple[str, list[int]]]:
    out = []
    for ctx in items[0]["ctxs"][:3]:  # short: Triton's interpreter runs the GPU path's kernels here
        ids = runtime.prompts.passage_ids("", " ".join(ctx["text"].split()[:12]))
        out.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
    return out


def _prefill_reads(runtime: Runtime, chunks, tmp_path) -> dict[str, int]:
    env = StoreEnv.open(tmp_path / f"store{runtime.model.cfg.n_layers}", create=True)
    engine, full = Prefiller.open(runtime, env, "fp16", compress=False), Prefiller.open(runtime, None)
    with torch.inference_mode():
        for cid, ids in chunks:
            engine.source.table.put_chunk(cid, ids, layers_to_numpy(chunk_kv(runtime, engine.preamble, ids), "fp16"))
        runs = {"full": lambda: full.prefill(chunks, QUESTION, "full"),
                "blend": lambda: engine.prefill(chunks, QUESTION, "blend", BlendConfig(ratio=0.3))}
        for run in runs.values():
            run()  # warm: plans, loaders, the interpreter's first compile
        return {name: _host_reads(run) for name, run in runs.items()}


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_a_prefill_reads_its_positions_once_whatever_the_depth(deep, invented_items, tmp_path, monkeypatch, path):
    reads = {}
    for n, runtime in deep.items():
        if path == "gpu":
            _gpu_path(runtime, monkeypatch)
        reads[n] = _prefill_reads(runtime, _chunks(runtime, invented_items), tmp_path)
    assert reads[4] == reads[8], reads
    assert reads[4]["full"] > 0 and reads[4]["blend"] > 0  # the counting sees the reads that remain


def test_a_decode_step_on_the_gpu_path_reads_nothing_a_layer(deep, monkeypatch):
    """The Triton decode over the paged pool: the lengths come from the tables, so no layer reads them back."""
    reads = {}
    for n, runtime in deep.items():
        _gpu_path(runtime, monkeypatch)
        model, c = runtime.model, runtime.model.cfg
        kv = SequenceKV(model, budget_bytes=64 * 8 * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4, block_size=8)
        with torch.inference_mode():
            tables = [kv.admit(prefill(model, torch.arange(3, 3 + length), extra=4)[1], length) for length in (5, 19)]
            decoder = BatchDecoder(model, kv, 64, native=False)
            for step in range(2):
                for t in tables:
                    kv.grow(t)
                if step == 0:
                    decoder.step([5, 7], tables)  # warm
                else:
                    reads[n] = _host_reads(lambda d=decoder, t=tables: d.step([5, 7], t))
    assert reads[4] == reads[8], reads
