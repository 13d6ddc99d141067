"""`--store s3://bucket/prefix` end to end: kvrag index, precompute (on Ray), ask and search in subprocesses
against a real S3 server (SeaweedFS, bench/local_s3.py), each "machine" a mirror directory of its own. The
reference is the same flow on a local store: the answers' token ids must be the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvrag.corpus.mirror import CURRENT
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.remote.object_store import ObjectStore
from kvrag.tests.test_remote_store import _flip, s3  # noqa: F401  (s3: the module's SeaweedFS fixture)

SAMPLE = Path(__file__).resolve().parents[1] / "corpus" / "sample"
QUESTION = "Who was the last keeper of the lighthouse?"
ASK = ("-k", "3", "--relative-cutoff", "0", "--min-score", "0", "--max-tokens", "8", "--json")


def _machine(s3, tmp_path_factory, name: str) -> dict[str, str]:  # noqa: F811
    """The environment of one machine: the AWS variables and a mirror directory of its own."""
    return {**s3.env, "KVRAG_MIRROR_DIR": str(tmp_path_factory.mktemp(name) / "mirror")}


def _ask(kvrag, store: str, model: Path, env: dict | None = None) -> dict:
    proc = kvrag("ask", QUESTION, "--store", store, "--model", str(model), "--dtype", "float32", *ASK, env=env)
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def local(tiny_llama_dir, tmp_path_factory) -> tuple[Path, dict]:
    """The flow on a local store, and its answer."""
    from kvrag.tests.conftest import run_kvrag

    store = tmp_path_factory.mktemp("local") / "store"
    run_kvrag("index", str(SAMPLE), "--store", str(store), "--model", str(tiny_llama_dir))
    run_kvrag("precompute", "--store", str(store), "--model", str(tiny_llama_dir), "--dtype", "float32")
    return store, _ask(run_kvrag, str(store), tiny_llama_dir)


@pytest.fixture(scope="module")
def remote(s3, tiny_llama_dir, tmp_path_factory) -> tuple[str, dict]:  # noqa: F811
    """The corpus indexed and published from machine A, its KV precomputed there by Ray actors."""
    from kvrag.tests.conftest import run_kvrag

    url, env = s3.url("p"), _machine(s3, tmp_path_factory, "a")
    index = json.loads(run_kvrag("index", str(SAMPLE), "--store", url, "--model", str(tiny_llama_dir), "--json",
                                 env=env).stdout)
    assert index["published"].startswith(f"{url}/corpus/") and index["chunks"] > 3
    run_kvrag("precompute", "--store", url, "--model", str(tiny_llama_dir), "--dtype", "float32", "--ray", "local",
              "--ray-workers", "1", env=env)
    return url, env


@pytest.fixture(scope="module")
def machine_b(s3, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """A second machine: asks first, and is shown the re-indexed corpus last."""
    return _machine(s3, tmp_path_factory, "b")


def _kv_objects(s3, url: str) -> dict[str, str]:  # noqa: F811
    """chunk id -> its object's key, for the store's full fp16 chunks."""
    objects = ObjectStore.from_url(url, s3.env)
    return {info.key.rsplit("/", 1)[1]: info.key for info in objects.list("kv") if "/fp16/" in info.key}


def test_the_remote_flow_answers_as_the_local_one(kvrag, local, remote, tiny_llama_dir):
    url, env = remote
    answer = _ask(kvrag, url, tiny_llama_dir, env)
    assert answer["token_ids"] == local[1]["token_ids"]
    assert answer["computed_chunks"] == [] and answer["sources"] == local[1]["sources"]


def test_a_second_machine_computes_nothing(s3, kvrag, local, remote, tiny_llama_dir, machine_b):  # noqa: F811
    url, env = remote[0], machine_b
    answer = _ask(kvrag, url, tiny_llama_dir, env)
    assert answer["token_ids"] == local[1]["token_ids"] and answer["computed_chunks"] == []
    with StoreEnv.open(env["KVRAG_MIRROR_DIR"], readonly=True) as mirror:  # the chunks it read are cached
        cached = {c for c, _ in LocalKVTable(mirror, _fingerprint(s3, url)).iter_chunks()}
    assert {s["chunk_id"] for s in answer["sources"]} <= cached


def test_a_store_without_a_corpus_is_one_line(s3, kvrag, tiny_llama_dir, tmp_path_factory):  # noqa: F811
    url = s3.url("empty")
    proc = kvrag("ask", QUESTION, "--store", url, "--model", str(tiny_llama_dir), check=False,
                 env=_machine(s3, tmp_path_factory, "empty"))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [f"error: {url} holds no corpus: run kvrag index --store {url} first"]


def test_a_corrupted_kv_object_is_recomputed_and_repaired(s3, kvrag, local, remote, tiny_llama_dir,  # noqa: F811
                                                          tmp_path_factory):
    url, _ = remote
    victim = local[1]["sources"][0]["chunk_id"]
    objects = ObjectStore.from_url(url, s3.env)
    key = _kv_objects(s3, url)[victim]
    _flip(objects, key, objects.head(key).size - 10)  # inside the last layer's value
    # the reference: the local store without that chunk's KV, so it is computed there too
    store = tmp_path_factory.mktemp("local-cold") / "store"
    shutil.copytree(local[0], store)
    with StoreEnv.open(store) as env:
        assert LocalKVTable(env, _fingerprint(s3, url)).delete_chunk(victim)
    want = _ask(kvrag, str(store), tiny_llama_dir)
    answer = _ask(kvrag, url, tiny_llama_dir, _machine(s3, tmp_path_factory, "c"))
    assert answer["computed_chunks"] == [victim] and answer["token_ids"] == want["token_ids"]
    again = _ask(kvrag, url, tiny_llama_dir, _machine(s3, tmp_path_factory, "d"))  # the object was replaced
    assert again["computed_chunks"] == [] and again["token_ids"] == local[1]["token_ids"]


def test_the_python_api_opens_an_s3_store(s3, local, remote, tiny_llama_dir, tmp_path_factory,  # noqa: F811
                                          monkeypatch):
    from kvrag.api import KVRag

    for name, value in _machine(s3, tmp_path_factory, "api").items():
        monkeypatch.setenv(name, value)
    with KVRag(remote[0], model=str(tiny_llama_dir), dtype="float32") as rag:
        answer = rag.ask(QUESTION, k=3, relative_cutoff=0, min_score=0, max_tokens=8)
    assert answer.token_ids == local[1]["token_ids"] and answer.computed_chunks == []


def test_reindexing_publishes_a_generation_the_other_mirror_picks_up(s3, kvrag, remote, machine_b,  # noqa: F811
                                                                     tiny_llama_dir, tmp_path_factory):
    url, env_a = remote
    search = ("search", "Who painted the harbour murals of Kilbrae?", "-k", "1", "--store", url, "--json")
    first = ObjectStore.from_url(url, s3.env).get(CURRENT)
    docs = tmp_path_factory.mktemp("docs")
    shutil.copytree(SAMPLE, docs / "sample")
    (docs / "sample" / "murals.txt").write_text("The harbour murals of Kilbrae were painted by Isobel Reid in 1972.")
    kvrag("index", str(docs / "sample"), "--store", url, "--model", str(tiny_llama_dir), env=env_a)
    assert ObjectStore.from_url(url, s3.env).get(CURRENT) != first
    found = json.loads(kvrag(*search, env=machine_b).stdout)  # its mirror held the first generation
    assert found[0]["doc_id"].endswith("murals.txt")


def _fingerprint(s3, url: str) -> str:  # noqa: F811
    """The model fingerprint the store's KV objects are under (kv/<fp>/<codec>/<chunk id>)."""
    return next(iter(_kv_objects(s3, url).values())).split("/")[-3]
