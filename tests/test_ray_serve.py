"""`kvrag serve --ray-serve`: two engine replicas on a local Ray cluster behind Ray Serve's proxy on 127.0.0.1, with
the chunk-aware router and two API keys, sharing a store on a SeaweedFS on 127.0.0.1. A real OpenAI client and httpx
against it: answers as a single server gives them, a bad key refused at the front as the single server refuses it, a
hot chunk set spread within the load bound (the policy itself, in any arrival order: tests/test_routing.py), a killed
replica losing no request that had not started streaming, and /metrics with every replica's samples."""

from __future__ import annotations

import math
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve")

from kvrag.api import MIN_SCORE, KVRag, KVRagConfig  # noqa: E402
from kvrag.cluster.routing import BALANCE, WINDOW  # noqa: E402
from kvrag.cluster.serve import REPLICA_HEADER, ClusterServer, ClusterSettings  # noqa: E402
from kvrag.server.app import ServerSettings  # noqa: E402
from kvrag.tests.conftest import run_kvrag  # noqa: E402
from kvrag.tests.test_remote_store import s3  # noqa: E402, F401  (the SeaweedFS fixture, one per module)

pytestmark = pytest.mark.slow
MODEL = "tiny"
KEY = "key-a"
QUESTIONS = ["How deep is Lake Baikal?", "Which river is the longest in Africa?", "How high is Mount Everest?",
             "Where is the lowest land on Earth?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(s3, indexed_store, tiny_llama_dir, tmp_path_factory) -> str:  # noqa: F811
    """The test corpus on the SeaweedFS, every chunk's KV precomputed there: the store the replicas share."""
    url = s3.url("ray-serve")
    env = {**s3.env, "KVRAG_MIRROR_DIR": str(tmp_path_factory.mktemp("writer-mirror"))}
    run_kvrag("index", str(indexed_store.parent / "docs"), "--store", url, env=env)
    run_kvrag("precompute", "--store", url, "--model", str(tiny_llama_dir), env=env)
    return url


@pytest.fixture(scope="module")
def config(s3, tiny_llama_dir, tmp_path_factory) -> KVRagConfig:  # noqa: F811
    """The replicas' settings: one mirror directory on this machine, which they share as processes of one host do."""
    return KVRagConfig.resolve(model=str(tiny_llama_dir), host_cache="64MiB", threads=1, aws=dict(s3.env),
                               mirror_dir=str(tmp_path_factory.mktemp("replica-mirror")))


@pytest.fixture(scope="module")
def cluster(store, config):
    settings = ClusterSettings(replicas=2, stats_period_s=0.5)
    with ClusterServer(store, config, ServerSettings(MODEL, api_key=f"{KEY},key-b"), settings,
                       port=free_port()) as server:
        yield server


def chat(url: str, question: str, key: str | None = KEY, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8, **extra}
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_answers_are_a_single_servers(cluster, store, config):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}],
                                         max_tokens=8, extra_body={"mode": "full"})
    with KVRag(store, config) as rag:
        chunk_ids = [s["chunk_id"] for s in rag.retrieve(QUESTIONS[1], min_score=MIN_SCORE)]
        expected = rag.ask(QUESTIONS[1], chunk_ids=chunk_ids, mode="full", max_tokens=8)
    assert chunk_ids and [s["chunk_id"] for s in got.model_extra["sources"]] == chunk_ids  # retrieved at the front
    assert got.choices[0].message.content == expected.text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=8, stream=True,
        extra_body={"mode": "full"}) if c.choices)
    assert streamed.strip() == expected.text  # a stream keeps the first piece's space, as `kvrag serve` does


@pytest.mark.parametrize("key, message", [("nope", "incorrect API key provided"),
                                          (None, "an API key is required: Authorization: Bearer <key>")])
def test_a_bad_key_is_refused_at_the_front_as_the_server_refuses_it(cluster, key, message):
    got = chat(cluster.url, QUESTIONS[0], key=key)
    assert (got.status_code, got.headers["www-authenticate"]) == (401, "Bearer")
    assert REPLICA_HEADER not in got.headers  # the front answered: no replica saw it
    assert got.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                    "code": "invalid_api_key"}}


def test_a_hot_chunk_set_spreads_within_the_bound(cluster):
    """WINDOW + 1 requests of one chunk set, in whatever order they arrive: none of the replicas takes more than
    ceil(BALANCE x (WINDOW + 1) / 2) of them (cluster/routing.py's cap over the recent routings), so both answer."""
    n = WINDOW + 1
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: chat(cluster.url, QUESTIONS[2], max_tokens=16), range(n)))
    assert all(r.status_code == 200 for r in responses)
    counts = Counter(r.headers[REPLICA_HEADER] for r in responses)
    assert len(counts) == 2 and max(counts.values()) <= math.ceil(BALANCE * n / 2), counts


def test_metrics_carry_every_replica(cluster):
    chat(cluster.url, QUESTIONS[3])
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("kvrag_requests_total{") and 'replica="' in line}
        if "kvrag_cluster_replicas 2.0" in text and len(replicas) >= 1:
            break
        assert time.monotonic() < deadline, text[:2000]
        time.sleep(0.5)
    assert "kvrag_replica_held_chunks{" in text


def test_a_killed_replica_loses_no_request(cluster):
    import ray

    target = chat(cluster.url, QUESTIONS[0]).headers[REPLICA_HEADER]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, cluster.url, QUESTIONS[0], max_tokens=64) for _ in range(6)]
        time.sleep(0.2)
        ray.kill(_replica_actor(target), no_restart=False)
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    after = chat(cluster.url, QUESTIONS[0])
    assert after.status_code == 200


def _replica_actor(unique_id: str):
    import ray
    from ray.util import list_named_actors

    for entry in list_named_actors(all_namespaces=True):
        if entry["name"].endswith(unique_id):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no actor for replica {unique_id}")


@pytest.mark.parametrize("args, message", [
    (["--ray-serve", "2", "--port", "0"], "error: --ray-serve needs a fixed --port: Ray Serve's proxy binds it itself"),
    (["--ray-serve", "2", "--ray-router", "nearest"],
     "error: --ray-serve takes at least 1 replica and a router in chunk, round-robin"),
])
def test_bad_cluster_options_are_one_line(monkeypatch, capsys, indexed_store, args, message):
    from kvrag.tests.conftest import run_cli_in_process

    code, out, err = run_cli_in_process(monkeypatch, capsys, "serve_cmd", "serve", "--store", str(indexed_store),
                                        *args)
    assert (code, out, err) == (1, "", message + "\n")
