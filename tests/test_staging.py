"""The staging area (load/staging.py) against the codec's own decode, and the staged loader's slots across loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvrag.load.layer_work import ChunkRef, CorruptChunk
from kvrag.load.loader import open_loader
from kvrag.load.staged_loader import StagedLoader
from kvrag.load.staging import LayerPlan, StagingArea
from kvrag.store.codec import FLAG_K_PER_CHANNEL, read_header, stored_kv
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

HKV, HD, N_LAYERS = 3, 8, 2
LENGTHS = (5, 9, 1, 7)


@pytest.fixture(params=[("fp16", True), ("fp16", False), ("bf16", True), ("bf16", False), ("int8", True)])
def table(tmp_path, request):
    """Chunks of random KV in one codec, compressed or not (int8's payload is as stored either way)."""
    codec, compress = request.param
    env = StoreEnv.open(tmp_path / "s", create=True)
    table = LocalKVTable(env, "m", codec, compress)
    rng = np.random.default_rng(len(codec) + compress)
    for n, length in enumerate(LENGTHS):
        layers = [(rng.standard_normal((length, HKV, HD)).astype(np.float32),
                   rng.standard_normal((length, HKV, HD)).astype(np.float32)) for _ in range(N_LAYERS)]
        table.put_chunk(f"c{n}", list(range(n * 100, n * 100 + length)), layers)
    yield table
    env.close()


def _refs() -> list[ChunkRef]:
    return [ChunkRef(f"c{n}", list(range(n * 100, n * 100 + length))) for n, length in enumerate(LENGTHS)]


def _plan(table: LocalKVTable, refs: list[ChunkRef]) -> LayerPlan:
    head = read_header(table.get_layer_raw(refs[0].chunk_id, 0).value)
    starts = tuple(np.cumsum([0, *LENGTHS]).tolist())
    return LayerPlan(table.codec, starts[-1], HKV, HD, starts,
                     table.codec == "int8" and bool(head.flags & FLAG_K_PER_CHANNEL))


def test_a_staged_layer_holds_each_chunk_as_the_codec_stores_it(table):
    """Every chunk's rows in the slot equal codec.stored_kv of its value: 16-bit values bit for bit (byte planes put
    back together), int8 with its scales in the slot's scale sections."""
    refs, area = _refs(), StagingArea(slots=1, threads=2)
    plan = _plan(table, refs)
    for layer in range(N_LAYERS):
        slot = area.acquire(layer)
        with table.layer_views([(r.chunk_id, r.token_ids) for r in refs], layer) as raws:
            staged = area.stage(slot, plan, [raw.value for raw in raws], lambda *_: None)
        for i, ref in enumerate(refs):
            want = stored_kv(*table.get_layer_raw(ref.chunk_id, layer).body())
            rows = slice(plan.starts[i], plan.starts[i + 1])
            for got, exp in ((staged.k[rows], want.k), (staged.v[rows], want.v)):  # widening is exact: equal bits
                assert torch.equal(got.to(torch.float32), torch.from_numpy(np.array(exp, dtype=np.float32)))
            if plan.codec == "int8":
                assert torch.equal(staged.k_scale[i], torch.from_numpy(want.k_scale.copy()))
                assert torch.equal(staged.v_scale[rows], torch.from_numpy(want.v_scale.copy()))
        area.release(slot)
    assert staged.staged_bytes == sum(len(table.get_layer_raw(r.chunk_id, 1).value) for r in refs)


def test_loads_one_after_another_share_the_slots_and_give_them_back(table):
    """An engine's loads reuse its slots: each load frees every slot it took, taken layers or not (a load stopped
    early, as a failed prefill's), so the next one never waits; the buffers grow once."""
    area, refs = StagingArea(), _refs()
    first = None
    for taken in (N_LAYERS, 1, N_LAYERS):
        loader = open_loader(table, refs, range(N_LAYERS), torch.float32, torch.device("cpu"), decode="thread",
                             area=area)
        assert isinstance(loader, StagedLoader)
        loader.start()
        got = [loader.layer(layer) for layer in range(taken)]
        loader.close()
        first = first or got
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, first, strict=False))
    assert area.grown == area.slots


def test_a_damaged_value_fails_its_layer_naming_the_chunk_and_frees_the_slot(table):
    key = table.key("c2").layer(1).to_bytes()
    with table.env.env.begin(write=True, db=table.env.db("kv")) as txn:
        value = bytearray(txn.get(key))
        value[-1] ^= 0x01
        txn.put(key, bytes(value))
    area = StagingArea()
    loader = open_loader(table, _refs(), range(N_LAYERS), torch.float32, torch.device("cpu"), decode="thread",
                         area=area).start()
    try:
        loader.layer(0)
        with pytest.raises(CorruptChunk, match="c2"):
            loader.layer(1)
    finally:
        loader.close()
    for slot in range(area.slots):  # every slot free again
        area.acquire(slot)


def test_bench_load_reports_what_the_issue_asks(tmp_path):
    """`kvrag bench load`'s report at a small size (the numbers themselves are measurements, not asserted): its keys,
    and the staged loader's one copy and one launch a layer, counted under Triton's interpreter."""
    from kvrag.bench import load

    report = load.run(chunks=2, tokens=16, threads=2, work=tmp_path, log=lambda _: None)
    for key in ("staging_gbps", "memcpy_gbps", "map_copy_gbps", "staging_share_of_memcpy", "copies_per_layer",
                "launches_per_layer",
                "python_ms_per_layer"):
        assert report[key] > 0, key
    assert (report["copies_per_layer"], report["launches_per_layer"]) == (1, 1)
    assert "copies / launches a layer" in load.render(report)


def test_staging_threads_are_the_cores_a_gpu_leaves_spare(monkeypatch):
    from kvrag.load import staging

    monkeypatch.setattr(staging.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert staging.spare_cores("cuda") == 15  # the lent GPU machines' 16 cores, one launching the GPU's work
    assert staging.spare_cores("cpu") == 2  # torch's forward has the cores
    monkeypatch.setattr(staging.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert staging.spare_cores("cuda") == 2


def test_layers_kept_by_the_consumer_outlive_their_slot(tmp_path):
    """A CPU load whose stored dtype is the model's (bf16 stored, bf16 model) hands out layers the reader must not
    write over: the slot goes back at hand-over and the reader stages layer i+2 into it while layer i is still in
    use, so each layer taken earlier still equals the codec's values after every later one is read."""
    layers = 6
    env = StoreEnv.open(tmp_path / "s", create=True)
    table = LocalKVTable(env, "m", "bf16", False)
    rng = np.random.default_rng(7)
    for n, length in enumerate(LENGTHS):
        table.put_chunk(f"c{n}", list(range(n * 100, n * 100 + length)),
                        [(rng.standard_normal((length, HKV, HD)).astype(np.float32),
                          rng.standard_normal((length, HKV, HD)).astype(np.float32)) for _ in range(layers)])
    refs = _refs()
    loader = open_loader(table, refs, range(layers), torch.bfloat16, torch.device("cpu"), decode="thread",
                         area=StagingArea(slots=2))
    assert isinstance(loader, StagedLoader)
    loader.start()
    taken = [loader.layer(layer) for layer in range(layers)]
    loader.close()
    for layer, (k, v) in enumerate(taken):
        want = [stored_kv(*table.get_layer_raw(r.chunk_id, layer).body()) for r in refs]
        assert torch.equal(k.float(), torch.from_numpy(np.concatenate([np.array(w.k, np.float32) for w in want])))
        assert torch.equal(v.float(), torch.from_numpy(np.concatenate([np.array(w.v, np.float32) for w in want])))
    env.close()
