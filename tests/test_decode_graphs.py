"""The decode step captured per batch bucket (engine/decode_graphs.py) against BatchDecoder's eager step.

On the CPU the capture is injected: the same static-buffer step runs again for each "replay", under Triton's
interpreter (conftest sets it without a GPU), and a dispatch mode checks that every replay runs exactly the
operators the capture ran, on the same shapes, with no value read back to the host: what a CUDA graph would replay.
Marked `cuda` (skipped without a GPU): real CUDA graphs against the eager step, and an engine with them on."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvrag.engine.batch_decode import BatchDecoder
from kvrag.engine.decode_graphs import CudaGraphCapture, StaticInputs, batch_buckets
from kvrag.engine.kv_pool import SequenceKV
from kvrag.kernels import triton_attention
from kvrag.kvcache.allocator import BlockTable
from kvrag.model.prefill import prefill
from kvrag.model.runtime import Runtime

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK = 8
POSITIONS = 64  # the decoders' context: M_max = 8 blocks
LENGTHS = (3, 9, 17, 30, 41)  # prompt tokens of sequences 0-4
# each step's batch, by sequence: buckets 4, eager (5 > the largest bucket, 4), 1, 2, 4 (in another order), 1
SCHEDULE = ([0, 1, 2], [0, 1, 2, 3, 4], [1], [4, 2], [3, 0, 2, 4], [2])
HOST_READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.item"}


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32", device=DEVICE, kernels="torch")  # triton_on turns it on


@contextmanager
def triton_on(model, monkeypatch):
    """The model's attention through Triton, counting the decode kernel's Python calls (the real kernel runs)."""
    calls = []
    real = triton_attention.decode_attention
    monkeypatch.setattr(triton_attention, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.triton = True
    try:
        yield calls
    finally:
        model.triton = False


class OpTrace(TorchDispatchMode):
    """The aten operators a call runs, each with its arguments' shapes, dtypes and plain values."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func.overloadpacket), tuple(_signature(x) for x in tree_leaves((args, kwargs)))))
        return func(*args, **kwargs)


def _signature(x) -> object:
    """A tensor's shape, dtype and device; a plain value itself; anything else (the interpreter's storages) its type
    and size."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype, x.device.type
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
        return x
    return type(x).__name__, getattr(x, "nbytes", lambda: None)()


class CheckedCapture:
    """A capture for the CPU that holds each replay to what was captured: the same operators on the same shapes, no
    value read back to the host, nothing that depends on the batch's values (a CUDA graph replays only that)."""

    def __init__(self):
        self.captured: list[int] = []  # each capture's output rows: the bucket

    def __call__(self, step):
        with OpTrace() as trace:
            out = step()
        self.captured.append(out.shape[0])
        names = {name for name, _ in trace.ops}
        assert not names & HOST_READS, f"the captured step reads values back to the host: {names & HOST_READS}"

        def replay():
            with OpTrace() as again:
                got = step()
            assert again.ops == trace.ops, "a replay ran other operators or shapes than its capture"
            return got

        return replay


def _sequences(model, n_blocks: int = 48):
    """A pool of 8-token blocks, every row NaN until written, holding LENGTHS' prompts (random ids, prefilled)."""
    c = model.cfg
    kv = SequenceKV(model, budget_bytes=n_blocks * BLOCK * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4,
                    block_size=BLOCK)
    kv.pool.kv.fill_(float("nan"))
    g = torch.Generator().manual_seed(5)
    steps = len(SCHEDULE)
    with torch.inference_mode():
        tables = [kv.admit(prefill(model, torch.randint(0, c.vocab_size, (n,), generator=g).to(DEVICE),
                                   extra=steps)[1], n) for n in LENGTHS]
    return kv, tables


def _run(model, decoder_for) -> tuple[list[torch.Tensor], SequenceKV, list[BlockTable], BatchDecoder]:
    """SCHEDULE through one decoder (decoder_for(kv) makes it over the prompts' pool): each step's logits, the
    pool, the tables and the decoder."""
    c = model.cfg
    feeds = torch.randint(0, c.vocab_size, (len(SCHEDULE), len(LENGTHS)), generator=torch.Generator().manual_seed(9))
    kv, tables = _sequences(model)
    decoder = decoder_for(kv)
    out = []
    with torch.inference_mode():
        for j, batch in enumerate(SCHEDULE):
            for b in batch:
                kv.grow(tables[b])
            out.append(decoder.step([int(feeds[j, b]) for b in batch], [tables[b] for b in batch],
                                    [0] * len(batch)))
    return out, kv, tables, decoder


def _compare(model, got, want, atol: float) -> None:
    """Same logits step by step; each sequence's K/V rows equal; no block outside the tables (and the graphs'
    scratch block) written; every real row finite."""
    (g_logits, g_kv, g_tables, decoder), (w_logits, w_kv, w_tables, _) = got, want
    for g_step, w_step in zip(g_logits, w_logits, strict=True):
        torch.testing.assert_close(g_step, w_step, rtol=atol, atol=atol)
    for g_t, w_t in zip(g_tables, w_tables, strict=True):
        g_rows, w_rows = g_kv.pool.gather([g_t]), w_kv.pool.gather([w_t])  # [L, 2, T, Hkv, hd]
        assert g_rows.isfinite().all()
        torch.testing.assert_close(g_rows, w_rows, rtol=atol, atol=atol)
    listed = {b for t in g_tables for b in t.blocks} | set(g_kv.shared)
    scratch = decoder.graphs.scratch
    assert scratch not in listed
    idle = [b for b in range(g_kv.pool.num_blocks) if b not in listed and b != scratch]
    assert idle and g_kv.pool.kv[:, :, idle].isnan().all(), "a pad row wrote outside the scratch block"
    assert g_kv.pool.kv[:, :, scratch, 1:].isnan().all()  # pad rows write the scratch block's first row alone


# ---- on the CPU (Triton's interpreter) -------------------------------------------------------------------------


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


def test_static_inputs_pad_a_batch_to_its_bucket_with_rows_on_the_scratch_block():
    inputs = StaticInputs(max_batch=4, max_blocks=3, scratch=7, block_size=4, device=torch.device("cpu"))
    tables = [BlockTable([2, 5], 6, 4), BlockTable([1], 1, 4)]
    inputs.fill(4, [11, 12], tables, [0, 3])
    assert inputs.ints.tolist() == [[11, 12, 0, 0],  # tokens
                                    [5, 3, 0, 0],  # positions: n_tokens - 1 + offset
                                    [5 * 4 + 1, 1 * 4 + 0, 28, 28]]  # new slots; pads on scratch block 7's first row
    assert inputs.lens.tolist() == [6, 1, 1, 1]
    assert inputs.tables.tolist() == [[2, 5, 7], [1, 7, 7], [7, 7, 7], [7, 7, 7]]
    inputs.pad(2)
    assert inputs.lens.tolist()[:2] == [1, 1] and inputs.ints[2].tolist()[:2] == [28, 28]


def test_the_static_buffer_step_gives_the_eager_step_s_logits_across_buckets(runtime, monkeypatch):
    """Five sequences of 3-41 prompt tokens over a NaN-poisoned pool, in batches that shrink and grow across buckets
    1, 2 and 4 (one of 5, past the largest bucket, runs eagerly): the same logits and K/V as the eager Triton step,
    every replay the operators of its capture, and pad rows never outside the scratch block."""
    model = runtime.model
    capture = CheckedCapture()
    with triton_on(model, monkeypatch) as calls:
        want = _run(model, lambda kv: BatchDecoder(model, kv, POSITIONS, native=False))
        eager_calls = len(calls)
        got = _run(model, lambda kv: BatchDecoder(model, kv, POSITIONS, native=False, cuda_graphs=True, max_batch=4,
                                                  capture=capture))
    graphs = got[3].graphs
    assert sorted(capture.captured) == [1, 2, 4]  # each bucket captured once, on its first batch
    assert graphs.stats == {"captured": 3, "replayed": 5, "eager": 1}
    assert len(calls) == 2 * eager_calls + 3 * model.cfg.n_layers  # every step, plus each capture's own run
    _compare(model, got, want, atol=1e-5)


def test_taps_fall_back_to_the_eager_step(runtime, monkeypatch):
    model = runtime.model
    kv, tables = _sequences(model)
    decoder = BatchDecoder(model, kv, POSITIONS, native=False, cuda_graphs=True, max_batch=4)
    seen = []
    with triton_on(model, monkeypatch), torch.inference_mode():
        for t in tables[:2]:
            kv.grow(t)
        decoder.step([1, 2], tables[:2], taps=[None, lambda layer, *a: seen.append(layer)])
        model.triton = False  # off the Triton path: eager as well
        decoder.step([3], tables[:1])
    assert decoder.graphs.stats == {"captured": 0, "replayed": 0, "eager": 2}
    assert seen == list(range(model.cfg.n_layers))


def test_the_graphs_hold_one_scratch_block_and_capture_every_bucket_up_front(runtime, monkeypatch):
    model = runtime.model
    kv, _ = _sequences(model)
    free = kv.num_free
    decoder = BatchDecoder(model, kv, POSITIONS, native=False, cuda_graphs=True)
    assert kv.num_free == free - 1 and decoder.reserved_blocks == 1
    assert decoder.graphs.buckets == (1, 2, 4, 8, 16, 32)
    assert decoder.graphs.max_blocks == POSITIONS // BLOCK
    assert BatchDecoder(model, kv, POSITIONS, native=False).reserved_blocks == 0
    small = BatchDecoder(model, kv, POSITIONS, native=False, cuda_graphs=True, max_batch=3)
    with triton_on(model, monkeypatch):
        small.graphs.capture_all()
    assert sorted(small.graphs.replays) == [1, 2, 3] and small.graphs.stats["captured"] == 3


def test_an_engine_with_cuda_graphs_answers_as_one_without(runtime, monkeypatch):
    """Three requests through LLMEngine (batches of 3, 2, 1 as they finish), with the option on and off; the same
    tokens, and the graphs served every decode step (here in the interpreter; on a GPU real graphs)."""
    from kvrag.engine.llm_engine import EngineConfig, LLMEngine
    from kvrag.engine.prefiller import Prefiller
    from kvrag.engine.scheduler import SchedulerConfig
    from kvrag.engine.sequence import Request
    from kvrag.model.sampling import SamplingConfig

    questions = ["Where does the Nile flow?", "How deep is Lake Baikal?", "Who wrote Hamlet?"]

    def answers(graphs: bool) -> tuple[list[list[int]], dict | None]:
        engine = LLMEngine(Prefiller.open(runtime, None), EngineConfig(4 << 20, 16, SchedulerConfig(4),
                                                                       native=False, cuda_graphs=graphs))
        seqs = [engine.add(Request(q, (), "full", sampling=SamplingConfig(max_tokens=3 + 2 * i)))
                for i, q in enumerate(questions)]
        while engine.has_work():
            engine.step()
        return [s.output for s in seqs], engine.decoder.graphs and dict(engine.decoder.graphs.stats)

    with triton_on(runtime.model, monkeypatch):
        want, _ = answers(False)
        got, stats = answers(True)
    assert got == want and all(len(tokens) > 1 for tokens in got)
    assert stats["replayed"] > 0 and stats["eager"] == 0


def test_the_bench_case_times_and_counts_both_steps():
    """bench/gpu_graphs.decode_graph_case, as `kvrag bench gpu` calls it: on the CPU (smoke) each step once."""
    from kvrag.bench.gpu_graphs import decode_graph_case

    smoke = not torch.cuda.is_available()
    case = decode_graph_case(DEVICE, 3, 40, smoke=smoke, warmup=1, reps=3)
    assert case["bucket"] == 3 and case["graph_stats"]["captured"] == 1 and case["graph_stats"]["eager"] == 0
    assert case["max_abs_diff"] < (1e-5 if smoke else 5e-2)  # bf16 on a GPU, other split plans
    assert case["eager_ms"] > 0 and case["graph_ms"] > 0 and case["eager"]["ops"] > 0
    if not smoke:  # one graph launch a replayed step, and far fewer kernel launches from the host
        assert case["graph"]["graph_launches"] == 1 and case["graph"]["launch_calls"] < case["eager"]["launch_calls"]


# ---- on a GPU (skip without one) -------------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
def test_real_cuda_graphs_give_the_eager_step_s_logits(runtime, monkeypatch):
    """torch.cuda.CUDAGraph per bucket (a host sync or a shape-dependent branch inside fails the capture): the same
    logits and K/V as the eager step, within the split plans' summation order, and a replay calls no Python."""
    model = runtime.model
    with triton_on(model, monkeypatch) as calls:
        want = _run(model, lambda kv: BatchDecoder(model, kv, POSITIONS, native=False))
        eager_calls = len(calls)
        got = _run(model, lambda kv: BatchDecoder(model, kv, POSITIONS, native=False, cuda_graphs=True, max_batch=4))
    graphs = got[3].graphs
    assert isinstance(graphs.capture, CudaGraphCapture)
    assert graphs.stats == {"captured": 3, "replayed": 5, "eager": 1}
    # the eager batch, then per capture two warm-ups and the capture's own trace; replays add nothing
    assert len(calls) == eager_calls + eager_calls // len(SCHEDULE) + 3 * 3 * model.cfg.n_layers
    _compare(model, got, want, atol=1e-4)




def test_the_setting_reaches_the_engine_from_the_environment(store_copy, tiny_llama_dir, monkeypatch):
    """KVRAG_CUDA_GRAPHS (config.py, read once at the edge) turns the graphs on for KVRag's engine; off by default."""
    from kvrag import KVRag

    for value, on in (("1", True), (None, False)):
        if value is None:
            monkeypatch.delenv("KVRAG_CUDA_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("KVRAG_CUDA_GRAPHS", value)
        with KVRag(store_copy, model=str(tiny_llama_dir), host_cache="0") as rag:
            assert (rag.engine.decoder.graphs is not None) is on
            assert rag.engine.decoder.reserved_blocks == int(on)
