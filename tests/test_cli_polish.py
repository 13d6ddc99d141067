"""The CLI's edges, the same for every command: Ctrl-C, bad options, --help, shell completion, --json."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord, chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.maintenance import stats, verify
from kvrag.tests.conftest import run_cli_in_process

INVENTED_CHUNKS = 100  # tens of ms each with the tiny model (one commit per chunk): the run lasts seconds
POLL_S = 0.01
WAIT_S = 120.0


def _stored_chunks(store: Path) -> int:
    with StoreEnv.open(store, readonly=True) as env:
        return sum(g.chunks for g in stats(env).groups)


def _wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"kvrag exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {WAIT_S} s")
        time.sleep(POLL_S)


@pytest.fixture
def big_store(indexed_store, tmp_path) -> Path:
    """The five indexed documents plus INVENTED_CHUNKS chunks of random token ids: a precompute run long
    enough to be interrupted in the middle."""
    store = tmp_path / "store"
    shutil.copytree(indexed_store, store)
    rng = random.Random(0)
    with StoreEnv.open(store) as env:
        table = ChunkTable(env)
        fingerprint = table.read_config().tokenizer_fingerprint
        records = []
        for i in range(INVENTED_CHUNKS):
            ids = tuple(rng.randrange(100, 49000) for _ in range(64))
            records.append(ChunkRecord(chunk_id_for(ids, fingerprint), "invented", "", f"chunk {i}", 0, 1, ids))
        doc = DocRecord("invented", "invented.txt", "", "h", tuple(DocChunk(r.chunk_id, 0, 1, 64) for r in records))
        table.put_docs([(doc, records)])
    return store


@pytest.mark.slow
def test_ctrl_c_stops_precompute_with_one_line_and_the_next_run_resumes(big_store, tiny_llama_dir, kvrag):
    args = ["precompute", "--store", str(big_store), "--model", str(tiny_llama_dir), "--dtype", "float32", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "kvrag", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(lambda: _stored_chunks(big_store) >= 2, proc, "two stored chunks")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=WAIT_S)
    stored = _stored_chunks(big_store)
    total = INVENTED_CHUNKS + 5
    assert 2 <= stored < total, "the run was not interrupted in the middle"
    assert (proc.returncode, out) == (130, "")
    assert err == f"interrupted; {stored} chunks stored, run again to resume\n"

    again = json.loads(kvrag(*args).stdout)
    assert (again["already_stored"], again["computed"], again["skipped_by_others"]) == (stored, total - stored, 0)
    assert _stored_chunks(big_store) == total
    with StoreEnv.open(big_store, readonly=True) as env:
        assert verify(env).ok


def test_ctrl_c_in_any_command_is_status_130_and_one_line(tmp_path):
    """`kvrag model bench` reading its --dataset from a FIFO blocks in the read until Ctrl-C."""
    fifo = tmp_path / "dataset.json"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "kvrag", "model", "bench", "--dataset", str(fifo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = []

    def reader_is_waiting() -> bool:  # opening the write end succeeds once kvrag has the read end open
        try:
            writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return True
        except OSError:
            return False

    try:
        _wait_for(reader_is_waiting, proc, "the dataset read")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        for fd in writer:
            os.close(fd)
    assert (proc.returncode, out, err) == (130, "", "interrupted\n")


@pytest.mark.parametrize("module, args, message", [
    ("ask_cmd", ["ask", "q", "-k", "0"],
     "error: Invalid value for '-k' / '--top-k': Input should be greater than or equal to 1; see kvrag ask --help"),
    ("index_cmd", ["search", "q", "-k", "0"], "error: -k must be at least 1 (got 0)"),
    ("precompute_cmd", ["precompute", "--limit", "0"], "error: Invalid value for '--limit': Input should be "
                                                       "greater than or equal to 1; see kvrag precompute --help"),
    ("precompute_cmd", ["precompute", "--codec"],
     "error: Option '--codec' requires an argument; see kvrag precompute --help"),
    ("store_cmd", ["store", "stats", "--bogus"], "error: No such option: --bogus; see kvrag store stats --help"),
    ("store_cmd", ["store", "gc", "--dry-run=yes"],
     "error: Option '--dry-run' does not take a value; see kvrag store gc --help"),
    ("index_cmd", ["index"], "error: Missing argument 'paths'; see kvrag index --help"),
    ("store_cmd", ["store", "nosuch"], "error: No such command 'nosuch'; see kvrag store --help"),
    ("store_cmd", ["--bogus"], "error: No such option: --bogus; see kvrag --help"),
])
def test_a_bad_option_is_one_line_and_status_1(monkeypatch, capsys, module, args, message):
    code, out, err = run_cli_in_process(monkeypatch, capsys, module, *args)
    assert (code, out, err) == (1, "", message + "\n")


def _help(monkeypatch, capsys, module: str, *args: str) -> str:
    code, out, err = run_cli_in_process(monkeypatch, capsys, module, *args, "--help")
    assert (code, err) == (0, "")
    return " ".join(out.split())  # click wraps at the terminal width


@pytest.mark.parametrize("module, command, envvars", [
    ("ask_cmd", ["ask"], ["KVRAG_STORE", "KVRAG_MODEL", "KVRAG_DTYPE", "KVRAG_DEVICE"]),
    ("precompute_cmd", ["precompute"], ["KVRAG_STORE", "KVRAG_MODEL", "KVRAG_DTYPE", "KVRAG_DEVICE"]),
    ("index_cmd", ["index"], ["KVRAG_STORE", "KVRAG_MODEL"]),
    ("index_cmd", ["search"], ["KVRAG_STORE"]),
    ("store_cmd", ["store", "stats"], ["KVRAG_STORE"]),
    ("model_cmd", ["model", "info"], ["KVRAG_MODEL", "KVRAG_DTYPE", "KVRAG_DEVICE"]),
])
def test_help_lists_env_vars_and_flags_take_no_value(monkeypatch, capsys, module, command, envvars):
    text = _help(monkeypatch, capsys, module, *command)
    for name in envvars:
        assert f"[env var: {name}]" in text
    assert "<bool>" not in text
    assert re.search(r"--json Print the result as JSON", text)
    assert re.search(r"--help Show this message", text)


def test_store_env_var_is_the_default_store_with_home_expanded(monkeypatch, capsys, tmp_path):
    StoreEnv.open(tmp_path / "s", create=True).close()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVRAG_STORE", "~/s")
    code, out, err = run_cli_in_process(monkeypatch, capsys, "store_cmd", "store", "stats", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["path"] == str(tmp_path / "s")


def test_json_leaves_stderr_empty(monkeypatch, capsys, tmp_path):
    """store stats/verify/gc: the result on stdout, as JSON or as a table, and nothing on stderr."""
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        ChunkTable(env).put_docs([(DocRecord("d", "d.txt", "", "h", (DocChunk("0" * 32, 0, 1, 1),)),
                                   [ChunkRecord("0" * 32, "d", "", "t", 0, 1, (7,))])])
    for command in ("stats", "verify", "gc"):
        code, out, err = run_cli_in_process(monkeypatch, capsys, "store_cmd", "store", command,
                                            "--store", str(tmp_path / "s"), "--json")
        assert (code, err) == (0, ""), command
        assert isinstance(json.loads(out), dict)
        code, out, err = run_cli_in_process(monkeypatch, capsys, "store_cmd", "store", command,
                                            "--store", str(tmp_path / "s"))
        assert (code, err) == (0, "") and out, command


def test_model_list_pipes_into_grep(tmp_path):
    """`kvrag model list | grep gemma`, run as a shell runs it: the table is the result, so it reaches the pipe, and
    stderr holds no table."""
    env = {**os.environ, "KVRAG_HOME": str(tmp_path)}  # an empty home: the known names, none converted
    kvrag = subprocess.Popen([sys.executable, "-m", "kvrag", "model", "list"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    grep = subprocess.run(["grep", "gemma"], stdin=kvrag.stdout, capture_output=True, text=True, timeout=WAIT_S)
    kvrag.stdout.close()  # grep holds the read end now
    err = kvrag.stderr.read().decode()
    assert kvrag.wait(timeout=WAIT_S) == 0, err
    assert grep.returncode == 0 and "gemma3-270m" in grep.stdout
    assert all("gemma" in line for line in grep.stdout.splitlines())
    assert "gemma" not in err and "installed" not in err  # no row, no header


def test_shell_completion(monkeypatch, capsys):
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # take the shell as given
    code, out, _ = run_cli_in_process(monkeypatch, capsys, "store_cmd", "--show-completion", "bash")
    assert code == 0 and "complete -o default -F _kvrag_completion kvrag" in out and "_KVRAG_COMPLETE" in out
    code, out, _ = run_cli_in_process(monkeypatch, capsys, "store_cmd", "--show-completion", "zsh")
    assert code == 0 and "compdef _kvrag_completion kvrag" in out
    # the script's side: the shell sets these and runs kvrag, which answers the candidates
    monkeypatch.setenv("_KVRAG_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "kvrag store st")
    monkeypatch.setenv("COMP_CWORD", "2")
    code, out, _ = run_cli_in_process(monkeypatch, capsys, "store_cmd")
    assert (code, out.split()) == (0, ["stats"])
