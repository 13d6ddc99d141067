"""Passages kept from clients' prompts (engine/kept_passages.py), end to end on a store: a real `kvrag serve` killed with
SIGKILL while it stores them leaves whole KV values and no record naming missing KV, keeps what it stored before, and
serves a kept passage's third sighting from the store after a restart; `kvrag store stats` counts them and
`kvrag store gc --client-passages` drops them (records and KV), the corpus's KV staying."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from kvrag.store.chunks import CLIENT_DOC, ChunkRecord, ChunkTable
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify
from kvrag.store.manifest import read_manifests
from kvrag.tests.client_templates import open_webui_prompt
from kvrag.tests.conftest import run_kvrag

QUERY = "Which ledger names the keeper of the northern light?"
SALT, OTHER_SALT = "tenant-a", "tenant-b"
MIN_PASSAGE_TOKENS = 60
WORDS = ("harbour lamp keeper granite tower winter reef ledger ship storm tide beacon island cliff rope lantern "
         "northern southern old new brother sister nephew village mill bridge river valley road chapel market "
         "fisher weaver smith carpenter captain pilot signal mist fog gale calm summer autumn spring copper iron "
         "salt grain timber wool barrel crate anchor mast sail oar dock pier quay wharf customs toll gate").split()


def invented_passage(rng: random.Random, tag: str) -> str:
    """One line of invented prose, >= MIN_PASSAGE_TOKENS tokens, unique to `tag` (no store holds it)."""
    sentences = []
    for _ in range(6):
        words = [rng.choice(WORDS) for _ in range(rng.randint(9, 13))]
        sentences.append(f"In {rng.randint(1700, 1950)} the {' '.join(words)}.")
    return f"Ledger {tag} records that " + " ".join(sentences)


def chat_body(model: str, content: str, salt: str, system: str | None = None, **fields) -> dict:
    """A chat request; with a system message, the prompt's head differs from one without (the prefix cache serves
    none of it, so its passages are computed, and counted, again)."""
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": model, "max_tokens": 2, "temperature": 0, "cache_salt": salt, "messages": messages, **fields}


SECOND_SYSTEM = "You answer from the sources the user gives."  # a second sighting in another application's prompt


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- a real server process ------------------------------------------------------------------------------------------


class Server:
    """`kvrag serve` on a free port with the tiny model; stderr drained by a thread (a full pipe would stall it)."""

    def __init__(self, store, model_dir, *args: str):
        env = {**os.environ, "KVRAG_THREADS": "1", "KVRAG_MODEL_CHECK": "0"}
        env.pop("KVRAG_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrag", "serve", "--store", str(store), "--model", str(model_dir),
             "--dtype", "float32", "--port", "0", "--host-cache", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.err: list[str] = []
        self.url = None
        for line in self.proc.stderr:
            self.err.append(line)
            if found := re.search(r"on (http://\S+)/v1", line):
                self.url = found.group(1)
                break
        if self.url is None:
            self.proc.wait()
            raise AssertionError(f"the server did not start (status {self.proc.returncode}):\n{''.join(self.err)}")
        self._drain = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)
        self._drain.start()
        self.model = httpx.get(self.url + "/v1/models", timeout=60).json()["data"][0]["id"]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._drain.join(10)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self._drain.join(10)
        return code


def write_back_jobs(url: str) -> dict[str, float]:
    """The server's write-back jobs, given and done, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {state: float(value) for state, value in
            re.findall(r'^kvrag_write_back_jobs_total\{state="(\w+)"\} (\S+)$', text, re.M)}


# ---- the store after a kill -----------------------------------------------------------------------------------------


def model_fingerprint(env: StoreEnv) -> str:
    fps = list(read_manifests(env))
    assert len(fps) == 1, fps  # the tiny model's, recorded when the server first loaded on this store
    return fps[0]


def check_store(path) -> dict[str, str]:
    """Whole values, and every client record's KV complete: {client chunk id: its text}."""
    with StoreEnv.open(str(path)) as env:
        report = verify(env)
        assert report.ok, report.problems  # no half-written value
        kept = {r.chunk_id: r for r in ChunkTable(env).client_records()}
        # the salt the server keys them by: "<API key's tenant>:<cache_salt>" (no key here)
        assert {r.doc_id for r in kept.values()} <= {f"{CLIENT_DOC}:{SALT}"}
        missing = LocalKVTable(env, model_fingerprint(env), "fp16").missing(sorted(kept))
        assert missing == [], f"client records naming KV that is not there: {missing}"
        return {chunk_id: r.text for chunk_id, r in kept.items()}


class Driver:
    """Threads sending Open WebUI prompts (2 new passages each), each prompt twice in a row (the second time behind a
    system message), until the server dies.
    `acked`: prompts whose second sighting was answered in full (2 tokens): their passages were handed to the
    write-back before."""

    def __init__(self, url: str, model: str, prompts: list[list[list[str]]]):
        self.url, self.model = url, model
        self.acked: list[list[str]] = []
        self.sent = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()

    def _run(self, prompts: list[list[str]]) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            for texts in prompts:
                for sighting in (1, 2):
                    try:
                        system = SECOND_SYSTEM if sighting == 2 else None
                        reply = http.post("/v1/chat/completions",
                                          json=chat_body(self.model, open_webui_prompt(texts, QUERY), SALT, system))
                    except httpx.TransportError:
                        return  # killed
                    if reply.status_code != 200:
                        self.errors.append(f"{reply.status_code}: {reply.text}")
                        return
                    body = reply.json()
                    with self.lock:
                        self.sent += 1
                        # the passages go to the write-back right after the first token, before the second
                        if sighting == 2 and body["choices"][0]["finish_reason"] == "length":
                            self.acked.append(texts)

    def join(self) -> None:
        for t in self.threads:
            t.join(60)
            assert not t.is_alive()
        assert not self.errors, self.errors


def test_sigkill_while_passages_are_kept_leaves_whole_kv_and_keeps_them(store_copy, tiny_llama_dir, smol_tokenizer):
    rng = random.Random(11)
    kept: dict[str, str] = {}  # client records seen after the previous kill
    acked: list[list[str]] = []
    counts = []
    for round_ in range(3):
        server = Server(store_copy, tiny_llama_dir, "--retrieval", "client")
        try:
            # two threads, so two requests are in flight at once; each prompt: two passages no other prompt has
            prompts = [[[invented_passage(rng, f"{round_}.{t}.{i}.{j}") for j in range(2)] for i in range(40)]
                       for t in range(2)]
            for texts in prompts[0][:2]:
                for text in texts:
                    assert len(smol_tokenizer(text, add_special_tokens=False)["input_ids"]) >= MIN_PASSAGE_TOKENS
            driver = Driver(server.url, server.model, prompts)
            deadline = time.monotonic() + 90
            while len(driver.acked) < 2:  # some passages handed to the write-back this round
                assert time.monotonic() < deadline and server.proc.poll() is None, "".join(server.err)
                time.sleep(0.01)
            # the worker stores off the engine's thread, in the order given: once it has done every job given by
            # now, these answered second sightings are stored, and no kill may lose them
            with driver.lock:
                answered = list(driver.acked)
            given = write_back_jobs(server.url)["given"]
            while write_back_jobs(server.url)["done"] < given:
                assert time.monotonic() < deadline, "the write-back fell behind"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 1.5))  # then a kill at a random moment, other passages being stored
            assert server.proc.poll() is None
            assert any(t.is_alive() for t in driver.threads)  # requests in flight
        finally:
            server.kill()
        driver.join()
        assert "Traceback" not in "".join(server.err), "".join(server.err)
        counts.append((driver.sent, len(driver.acked)))
        acked += answered
        now = check_store(store_copy)
        assert set(kept) <= set(now), "client passages stored before a kill are gone after it"
        for texts in answered:  # each passage of an answered second sighting is stored (in its line's record)
            for text in texts:
                assert any(text in record for record in now.values()), text[:60]
        kept = now
    print(f"\nrounds (requests sent, second sightings answered): {counts}; client passages kept: {len(kept)}")

    # a third sighting, after a restart: a hit for the tenant that sent it, nothing for one that never did
    server = Server(store_copy, tiny_llama_dir, "--retrieval", "client")
    try:
        texts = acked[0]
        kept_tokens = sum(len(smol_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            replies = {}
            for salt in (OTHER_SALT, SALT):
                # a fixed recompute ratio: "auto" picks the tiny model's on this machine's load/compute profile
                reply = http.post("/v1/chat/completions",
                                  json=chat_body(server.model, open_webui_prompt(texts, QUERY), salt, ratio=0.15))
                assert reply.status_code == 200, reply.text
                replies[salt] = reply.json()
        assert replies[SALT]["usage"]["prompt_tokens"] == replies[OTHER_SALT]["usage"]["prompt_tokens"]
        assert cached(replies[SALT]) > cached(replies[OTHER_SALT])
        assert cached(replies[SALT]) - cached(replies[OTHER_SALT]) >= 0.6 * kept_tokens
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert "Traceback" not in "".join(server.err), "".join(server.err)
    assert set(kept) <= set(check_store(store_copy))
    run_kvrag("store", "verify", "--store", str(store_copy))  # exit 0


# ---- stats and gc ---------------------------------------------------------------------------------------------------


def stats_json(store) -> dict:
    return json.loads(run_kvrag("store", "stats", "--store", str(store), "--json").stdout)


def chunks_of(stats: dict, fp: str) -> int:
    (group,) = [g for g in stats["groups"] if g["model_fp"] == fp and g["codec"] == "fp16" and not g["variant"]]
    return group["chunks"]


def test_store_stats_counts_kept_passages_and_gc_drops_them(store_copy, tiny_llama_dir):
    from kvrag import KVRag
    from kvrag.server.app import ServerSettings
    from kvrag.server.run import BackgroundServer

    run_kvrag("precompute", "--store", str(store_copy), "--model", str(tiny_llama_dir), "--dtype", "float32")
    rng = random.Random(5)
    prompts = {salt: [[invented_passage(rng, f"{salt}.{i}.{j}") for j in range(2)] for i in range(2)]
               for salt in (SALT, OTHER_SALT)}
    with KVRag(store_copy, model=str(tiny_llama_dir), dtype="float32", host_cache="0", retrieval="client") as rag, \
            BackgroundServer(rag, ServerSettings("tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        for salt, salted in prompts.items():
            for texts in salted:
                for system in (None, SECOND_SYSTEM):  # kept at the second sighting
                    reply = http.post("/v1/chat/completions", json=chat_body("tiny", open_webui_prompt(texts, QUERY),
                                                                              salt, system))
                    assert reply.status_code == 200, reply.text
        # one more, sent once: never kept
        once = open_webui_prompt([invented_passage(rng, "once.0"), invented_passage(rng, "once.1")], QUERY)
        assert http.post("/v1/chat/completions", json=chat_body("tiny", once, SALT)).status_code == 200

    with StoreEnv.open(str(store_copy)) as env:
        table = ChunkTable(env)
        records = table.client_records()
        client_ids = sorted(r.chunk_id for r in records)
        corpus_ids = sorted(table.ids() - set(client_ids))
        fp = model_fingerprint(env)
        kv = LocalKVTable(env, fp, "fp16")
        assert kv.missing(client_ids) == [] and kv.missing(corpus_ids) == []
    assert len(records) >= 8  # 2 tenants x 2 prompts x 2 passages, each its own line
    assert {r.doc_id for r in records} == {f"{CLIENT_DOC}:{SALT}", f"{CLIENT_DOC}:{OTHER_SALT}"}
    assert not any("once." in r.text for r in records)

    before = stats_json(store_copy)
    assert before["client_passages"] == {"passages": len(records), "tokens": sum(len(r.token_ids) for r in records),
                                         "tenants": 2}
    assert chunks_of(before, fp) == len(corpus_ids) + len(client_ids)
    text = run_kvrag("store", "stats", "--store", str(store_copy)).stdout
    assert f"passages kept from clients' prompts: {len(records)}" in text

    plain = json.loads(run_kvrag("store", "gc", "--store", str(store_copy), "--json").stdout)
    assert plain["dropped_chunks"] == 0  # kept passages are no garbage for a plain gc

    dry = json.loads(run_kvrag("store", "gc", "--store", str(store_copy), "--client-passages", "--dry-run",
                               "--json").stdout)
    assert dry["dry_run"] and dry["dropped_chunks"] == len(client_ids)
    assert stats_json(store_copy) == before  # nothing deleted

    done = json.loads(run_kvrag("store", "gc", "--store", str(store_copy), "--client-passages", "--json").stdout)
    assert not done["dry_run"] and done["dropped_chunks"] == len(client_ids)
    after = stats_json(store_copy)
    assert after["client_passages"] == {"passages": 0, "tokens": 0, "tenants": 0}
    assert chunks_of(after, fp) == chunks_of(before, fp) - len(client_ids) == len(corpus_ids)
    with StoreEnv.open(str(store_copy)) as env:
        table = ChunkTable(env)
        assert table.client_records() == [] and table.ids() == set(corpus_ids)
        kv = LocalKVTable(env, fp, "fp16")
        assert kv.missing(client_ids) == client_ids  # their KV gone
        assert kv.missing(corpus_ids) == []  # the corpus's stays
        assert verify(env).ok


def test_gc_client_passages_on_a_store_with_no_corpus_drops_their_kv_too(tmp_path):
    from kvrag.store.manifest import ensure_schema

    path = tmp_path / "store"
    chunk_id, ids = "ab" * 16, (1, 2, 3)
    with StoreEnv.open(str(path), create=True) as env:  # a store served with --retrieval client, never indexed
        ensure_schema(env)
        ChunkTable(env).put_records([ChunkRecord(chunk_id, f"{CLIENT_DOC}:{SALT}", "", "x", 0, 1, ids)])
        zeros = np.zeros((len(ids), 2, 8), np.float32)
        assert LocalKVTable(env, "model-a", "fp16").put_chunk(chunk_id, list(ids), [(zeros, zeros)] * 2)
    done = run_kvrag("store", "gc", "--store", str(path), "--client-passages", check=False)
    with StoreEnv.open(str(path)) as env:
        records, kv = ChunkTable(env).client_records(), LocalKVTable(env, "model-a", "fp16")
        # either it drops both, or it refuses and drops neither: never records gone and their KV kept
        assert (records == [] and kv.missing([chunk_id]) == [chunk_id]) or (len(records) == 1 and done.returncode)
