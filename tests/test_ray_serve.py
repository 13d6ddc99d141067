"""`kvrag serve --ray-serve`: four engine replicas on a Ray cluster of two nodes on 127.0.0.1 (cluster/loopback.py),
behind Ray Serve's proxy, with the chunk-aware router and two API keys, sharing a store on a SeaweedFS on 127.0.0.1. A
real OpenAI client and httpx against it: answers as a single server gives them, a bad key refused at the front as the
single server refuses it, a hot chunk set spread within the load bound (the policy itself, in any arrival order:
tests/test_routing.py), /metrics with every replica's samples, an engine on a mirror of its own taking a chat's
history from the bucket, and last a node killed under load: no request hangs, those that had not started streaming
are answered elsewhere, and the chats that lived there go on with their histories from the store's prefix table."""

from __future__ import annotations

import math
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

pytest.importorskip("ray.serve")

from kvrag.api import MIN_SCORE, KVRag, KVRagConfig  # noqa: E402
from kvrag.cluster.loopback import LoopbackCluster  # noqa: E402
from kvrag.cluster.routing import BALANCE, WINDOW  # noqa: E402
from kvrag.cluster.serve import NODE_HEADER, REPLICA_HEADER, ClusterServer, ClusterSettings  # noqa: E402
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
    """The replicas' settings: one mirror directory on this machine, which they share as processes of one host do;
    float32, so that a restored history's first token can be held to a full prefill's within float32's rounding."""
    return KVRagConfig.resolve(model=str(tiny_llama_dir), dtype="float32", host_cache="64MiB", threads=1,
                               aws=dict(s3.env),
                               mirror_dir=str(tmp_path_factory.mktemp("replica-mirror")))


REPLICAS = 4


@pytest.fixture(scope="module")
def nodes():
    """The head and a worker node, two CPUs each: two replicas on each."""
    with LoopbackCluster(nodes=2, cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster(nodes, store, config):
    settings = ClusterSettings(replicas=REPLICAS, address=nodes.address, stats_period_s=0.5)
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


def test_a_hot_chunk_set_spreads_within_the_bound(cluster, nodes):
    """WINDOW + 1 requests of one chunk set, in whatever order they arrive: none of the replicas takes more than
    ceil(BALANCE x (WINDOW + 1) / REPLICAS) of them (cluster/routing.py's cap over the recent routings), so that enough
    replicas answer, on both nodes."""
    n = WINDOW + 1
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: chat(cluster.url, QUESTIONS[2], max_tokens=16), range(n)))
    assert all(r.status_code == 200 for r in responses)
    counts = Counter(r.headers[REPLICA_HEADER] for r in responses)
    cap = math.ceil(BALANCE * n / REPLICAS)
    assert max(counts.values()) <= cap and len(counts) >= math.ceil(n / cap), counts
    assert {r.headers[NODE_HEADER] for r in responses} == {nodes.node_id(0), nodes.node_id(1)}


def test_metrics_carry_every_replica(cluster):
    chat(cluster.url, QUESTIONS[3])
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("kvrag_requests_total{") and 'replica="' in line}
        if f"kvrag_cluster_replicas {REPLICAS:.1f}" in text and len(replicas) >= 1:
            break
        assert time.monotonic() < deadline, text[:2000]
        time.sleep(0.5)
    assert "kvrag_replica_held_chunks{" in text


def test_engines_on_two_mirrors_share_a_chat_through_the_bucket(store, config, tmp_path):
    """Two engines on the bucket, each with a mirror of its own (as replicas on two machines have): a chat's turns on
    one, its next turn on the other takes the whole history from the bucket (store/remote/prefix_objects.py), with the
    first token's log-probabilities the first engine gives the same turn from its pool."""
    turns = ("Tell me about lighthouses.", "And about their keepers?", "Which was the tallest?")
    ask = dict(rag=False, keep_turn=True, max_tokens=8, salt="a tenant", logprobs=5)
    with KVRag(store, replace(config, mirror_dir=str(tmp_path / "a"))) as a, \
            KVRag(store, replace(config, mirror_dir=str(tmp_path / "b"))) as b:
        history: tuple = ()
        for turn in turns[:2]:
            history += (("user", turn), ("assistant", a.ask(turn, history=history, **ask).text))
        while (stats := a.stats()).writes_done + stats.writes_failed < stats.writes_given:
            time.sleep(0.05)
        assert stats.writes_failed == 0 and stats.prefix_saved > 0
        moved = b.submit(turns[2], history=history, **ask)
        moved.result()
        warm = a.submit(turns[2], history=history, **ask)
        warm.result()
        restored = b.stats().prefix_restored
    assert moved.prompt_counts["reused"] == warm.prompt_counts["reused"] == restored * 16 > 0
    (got, got_top), (home, home_top) = moved.logprobs[0], warm.logprobs[0]
    assert got == pytest.approx(home, abs=1e-4)
    assert [t for t, _ in got_top] == [t for t, _ in home_top]
    assert [p for _, p in got_top] == pytest.approx([p for _, p in home_top], abs=1e-4)


def converse(url: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "rag": False, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def first_top(response: httpx.Response) -> dict[str, float]:
    """The first token's top-5 alternatives, token -> logprob."""
    assert response.status_code == 200, response.text
    top = response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["token"]: t["logprob"] for t in top}


def reply(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed(url: str, question: str) -> str:
    """A streamed answer's outcome: "answered" ([DONE] after content), "error" (an error event, then [DONE]) or an
    HTTP status; a stream that stops without [DONE] (a hang cut by the timeout, a cut connection) raises."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        if response.status_code != 200:
            return str(response.status_code)
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events
    return "error" if any(e.startswith('{"error"') for e in events) else "answered"


def restored_blocks(url: str, replicas: set[str]) -> float:
    """The prefix-table blocks `replicas` have read back into their pools, by the front's federated /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "kvrag_prefix_store_blocks_total" and s.labels.get("event") == "restored"
               and s.labels.get("replica") in replicas)


def test_a_lost_node_hangs_nothing_and_its_chats_go_on_from_the_store(cluster, nodes):
    """Chats started until two live on the worker node's replicas (a conversation's turns go to its home replica);
    then streams in flight as the worker node is killed: each ends answered or with an error event, none hangs; then
    the next turn of each chat that lived there is answered on the head node, its history read from the store's prefix
    table (no replica there ever computed it), with the first token's logprobs its home replica gave the same turn
    before it died (the same ids: a full prefill of the history's text would re-tokenize the answers;
    tests/test_prefix_spill.py holds the restored rows to a full prefill of the same ids)."""
    head, worker = nodes.node_id(0), nodes.node_id(1)
    lost: list[tuple[list[dict], httpx.Response]] = []  # (a chat, its next turn answered at home)
    for i in range(40):
        if len(lost) == 2:
            break
        messages = [{"role": "user", "content": f"Chat {i}. {QUESTIONS[i % 4]}"},
                    {"role": "assistant", "content": "Let me think about it carefully before I answer you. " * 3},
                    {"role": "user", "content": "Go on, please."}]
        first = converse(cluster.url, messages)
        messages += [{"role": "assistant", "content": reply(first)}, {"role": "user", "content": "Why is that?"}]
        second = converse(cluster.url, messages)
        messages += [{"role": "assistant", "content": reply(second)}, {"role": "user", "content": "Say more."}]
        warm = converse(cluster.url, messages, logprobs=True, top_logprobs=5)
        if {r.headers[NODE_HEADER] for r in (first, second, warm)} == {worker}:
            lost.append((messages, warm))
    assert len(lost) == 2
    time.sleep(1.0)  # the write-back workers' last blocks are in the store

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(streamed, cluster.url, QUESTIONS[i % 4]) for i in range(8)]
        time.sleep(0.5)
        nodes.kill(1)
        outcomes = Counter(f.result() for f in futures)
    assert set(outcomes) <= {"answered", "error"} and outcomes["answered"] >= 1, outcomes

    answered = [converse(cluster.url, messages, logprobs=True, top_logprobs=5) for messages, _ in lost]
    on = {r.headers[REPLICA_HEADER] for r in answered}
    assert {r.headers[NODE_HEADER] for r in answered} == {head}
    assert all(cached(r) > 0 for r in answered)
    deadline = time.monotonic() + 30
    while restored_blocks(cluster.url, on) < len(lost):
        assert time.monotonic() < deadline, "no replica on the head read a history from the store"
        time.sleep(0.5)
    for got, (_, home) in zip(answered, lost, strict=True):  # the tiny model's near-even logits: not its text
        assert cached(got) == cached(home)
        got, home = first_top(got), first_top(home)
        assert max(got.values()) == pytest.approx(max(home.values()), abs=1e-4)
        assert all(got[t] == pytest.approx(home[t], abs=1e-4) for t in got.keys() & home.keys())


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
