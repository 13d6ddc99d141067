"""precompute --ray: a local Ray cluster's actors store byte for byte what the single-process precompute stores,
in a local store and on object storage (a real SeaweedFS on 127.0.0.1), encoded by the workers, never the driver;
reruns, an interrupted driver and a worker killed mid-batch still end with every chunk stored once."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvrag.model.runtime import Runtime
from kvrag.precompute import on_ray
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.on_ray import precompute_ray
from kvrag.precompute.plain import PrecomputeInterrupted, precompute
from kvrag.store import table as table_module
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify
from kvrag.store.open import RemoteOptions
from kvrag.store.remote.object_store import ObjectStore
from kvrag.tests.conftest import DOCS, run_cli_in_process, run_kvrag
from kvrag.tests.test_remote_store import s3  # noqa: F401  (s3: the SeaweedFS fixture, one per module)

ray = pytest.importorskip("ray")

VARIANTS = {"fp16": KeepConfig(), "keep0.5": KeepConfig(0.5)}


@pytest.fixture(scope="module")
def ray_cluster(session_home):
    """A local cluster of 2 CPUs for the module (its workers inherit KVRAG_HOME and the offline settings)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir) -> Runtime:
    return Runtime.load(str(tiny_llama_dir), "float32")


@contextmanager
def one_thread():
    """The single-process precompute on one thread, as a Ray worker of one CPU computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(indexed_store, runtime, tmp_path_factory) -> dict[str, dict[bytes, bytes]]:
    """Per variant, every entry of the kv database after the single-process precompute."""
    out = {}
    with one_thread():
        for name, keep in VARIANTS.items():
            store = tmp_path_factory.mktemp("reference") / "store"
            shutil.copytree(indexed_store, store)
            with StoreEnv.open(store) as env:
                precompute(env, runtime, "fp16", keep=keep)
            out[name] = kv_entries(store)
    return out


def kv_entries(store: Path) -> dict[bytes, bytes]:
    with StoreEnv.open(store) as env, env.reader() as txn:
        return {bytes(k): bytes(v) for k, v in txn.cursor(db=env.db("kv"))}


def _run(store: Path, model: Path, **kwargs):
    with StoreEnv.open(store) as env:
        return precompute_ray(env, str(model), "float32", workers=2, batch=2, **kwargs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_store_as_single_process_and_rerun_stores_nothing(ray_cluster, reference, store_copy, tiny_llama_dir,
                                                               variant):
    progress = []
    summary = _run(store_copy, tiny_llama_dir, keep=VARIANTS[variant],
                   on_progress=lambda *args: progress.append(args))
    assert (summary.indexed_chunks, summary.computed, summary.already_stored) == (5, 5, 0)
    assert summary.variant == VARIANTS[variant].variant and summary.skipped_by_others == 0
    assert [done for done, _, _ in progress] == [1, 2, 3, 4, 5] and progress[-1][1:] == (summary.tokens, 5)
    if variant != "fp16":
        assert 0 < summary.kept_tokens < summary.tokens
    assert kv_entries(store_copy) == reference[variant]  # every layer value and record, byte for byte

    again = _run(store_copy, tiny_llama_dir, keep=VARIANTS[variant])
    assert (again.computed, again.already_stored) == (0, 5)
    assert kv_entries(store_copy) == reference[variant]


def test_interrupted_driver_resumes_with_every_chunk_once(ray_cluster, reference, store_copy, tiny_llama_dir):
    def interrupt(done, tokens, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(PrecomputeInterrupted) as interrupted:
        _run(store_copy, tiny_llama_dir, on_progress=interrupt)
    assert interrupted.value.stored == 2
    with StoreEnv.open(store_copy) as env:
        assert verify(env).ok
    # the claims of the batches in flight were freed: the rerun (same process) takes every chunk left. Workers
    # commit a local store themselves, so a batch in flight at the interrupt may still land after the driver's
    # count: each chunk is then found stored or computed, exactly once, and never lost
    rest = _run(store_copy, tiny_llama_dir)
    assert rest.already_stored >= interrupted.value.stored and rest.skipped_by_others == 0
    assert rest.already_stored + rest.computed == 5
    assert kv_entries(store_copy) == reference["fp16"]


def _die_once(flag: str, chunk_ids: list[str]) -> None:
    """In a Ray worker, before a batch: the first time (while `flag` exists), end the process as a kill would."""
    try:
        os.unlink(flag)
    except FileNotFoundError:
        return
    os._exit(1)


def test_worker_killed_mid_batch_is_restarted_and_its_batch_retried(ray_cluster, reference, store_copy,
                                                                    tiny_llama_dir, tmp_path):
    flag = tmp_path / "die-once"
    flag.touch()
    summary = _run(store_copy, tiny_llama_dir, on_batch=functools.partial(_die_once, str(flag)))
    assert not flag.exists()  # a worker did die holding a batch
    assert (summary.computed, summary.skipped_by_others) == (5, 0)
    assert kv_entries(store_copy) == reference["fp16"]


def test_the_driver_encodes_and_writes_nothing(ray_cluster, reference, store_copy, tiny_llama_dir, monkeypatch):
    """Every encoder and chunk writer the driver could reach raises: the workers (other processes on its node, not
    patched) encode and commit it all."""
    def refuse(*args, **kwargs):
        raise AssertionError("the driver encoded or wrote a chunk")

    for module in (table_module, on_ray):
        monkeypatch.setattr(module, "encode_chunk", refuse)
    monkeypatch.setattr(table_module, "encode", refuse)
    monkeypatch.setattr(LocalKVTable, "put_encoded", refuse)
    summary = _run(store_copy, tiny_llama_dir)
    assert (summary.computed, summary.skipped_by_others) == (5, 0)
    assert kv_entries(store_copy) == reference["fp16"]
    assert 0 < summary.writer_busy_s < summary.wall_s


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


def _s3_store(s3, docs: Path, model: Path, prefix: str, tmp_path: Path) -> tuple[str, Path]:  # noqa: F811
    """A store on the S3 server under `prefix`, made by `kvrag index`, and the mirror directory it made."""
    url, mirror = s3.url(prefix), tmp_path / f"mirror-{prefix}"
    run_kvrag("index", str(docs), "--store", url, "--model", str(model),
              env={**s3.env, "KVRAG_MIRROR_DIR": str(mirror)})
    return url, mirror


def _kv_objects(s3, url: str) -> dict[str, bytes]:  # noqa: F811
    """Every KV object of the store (key under its prefix -> bytes), as a listing finds them."""
    objects = ObjectStore.from_url(url, s3.env)
    try:
        return {info.key: objects.get(info.key) for info in objects.list("kv")}
    finally:
        objects.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_put_on_object_storage_what_one_process_puts_despite_a_kill(s3, ray_cluster, runtime, docs,  # noqa: F811
                                                                            tiny_llama_dir, tmp_path, variant):
    keep, options = VARIANTS[variant], RemoteOptions(aws=s3.env)
    ref_url, ref_mirror = _s3_store(s3, docs, tiny_llama_dir, f"single-{variant}", tmp_path)
    with one_thread(), StoreEnv.open(ref_mirror) as env:
        precompute(env, runtime, "fp16", keep=keep, remote=options)
    url, mirror = _s3_store(s3, docs, tiny_llama_dir, f"ray-{variant}", tmp_path)
    flag = tmp_path / "die-once"
    flag.touch()
    summary = _run(mirror, tiny_llama_dir, keep=keep, remote=options, on_batch=functools.partial(_die_once, str(flag)))
    assert not flag.exists()  # a worker did die holding a batch
    assert (summary.computed, summary.skipped_by_others) == (5, 0)
    want = _kv_objects(s3, ref_url)
    assert len(want) == 6  # five chunks and the preamble
    assert _kv_objects(s3, url) == want
    assert kv_entries(mirror) == {}  # the driver kept no copy, and freed every claim


def test_cli_ray_local_end_to_end(reference, store_copy, tiny_llama_dir, kvrag):
    """`--ray local` in its own process starts (and stops) its own cluster."""
    proc = kvrag("precompute", "--store", str(store_copy), "--model", str(tiny_llama_dir), "--dtype", "float32",
                 "--ray", "local", "--ray-workers", "2", "--json")
    done = json.loads(proc.stdout)
    assert (done["computed"], done["indexed_chunks"], done["already_stored"]) == (5, 5, 0)
    assert kv_entries(store_copy) == reference["fp16"]


def test_cli_without_ray_says_how_to_install(monkeypatch, capsys, store_copy):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    code, _, err = run_cli_in_process(monkeypatch, capsys, "precompute_cmd", "precompute", "--store", str(store_copy),
                                      "--ray", "local")
    assert code == 1 and err.count("\n") == 1 and "pip install 'kvrag[ray]'" in err


def test_a_sliding_window_model_stores_both_forms_as_the_single_process_does(ray_cluster, indexed_store, tiny_family,
                                                                              tmp_path):
    """Two passes (after the preamble, after the lead-in) and the lead-in itself, byte for byte."""
    model = tiny_family("gemma3_text")
    single, on_ray_store = tmp_path / "single", tmp_path / "ray"
    for store in (single, on_ray_store):
        shutil.copytree(indexed_store, store)
    with one_thread(), StoreEnv.open(single) as env:
        precompute(env, Runtime.load(str(model), "float32", lead_in=96), "fp16")
    progress = []
    summary = _run(on_ray_store, model, lead_in=96, on_progress=lambda *args: progress.append(args))
    assert (summary.indexed_chunks, summary.computed) == (5, 10) and summary.variant.startswith("lead:")
    assert [done for done, _, _ in progress] == list(range(1, 11))
    assert kv_entries(on_ray_store) == kv_entries(single)
