"""`--model` by short name or by GGUF path (model/names.py, model/files.py), `kvrag model list`, and the one-line
refusals of what cannot run: each through the real CLI, with nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag.model import files as model_files
from kvrag.model.files import resolve_model
from kvrag.model.names import KNOWN_MODELS, KnownModel, gguf_header, gguf_location, known_gguf
from kvrag.tests.conftest import FAMILIES, _tiny_model_dir, run_cli_in_process


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli_in_process(monkeypatch, capsys, "model_cmd", "model", *args)


def _no_conversion(*args) -> None:
    raise AssertionError("converted again although these GGUF bytes are in the cache")


def _write_gguf(path: Path, arch: str, name: str | None = None) -> Path:
    """A GGUF file with a header and no tensors: what the checks before any conversion read."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_short_name_and_gguf_path_resolve_to_the_default(smol, tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "_convert_gguf", _no_conversion)
    gguf = gguf_location(KNOWN_MODELS["smollm2"])
    by_name, by_path = resolve_model("smollm2"), resolve_model(str(gguf))
    assert by_name.fingerprint == by_path.fingerprint == smol.fingerprint
    assert by_name.path == by_path.path == smol.path
    assert by_name.name == by_path.name == smol.name == "SmolLM2-135M-Instruct"
    # the same bytes at a path never seen: found by their digest, not converted again
    link = tmp_path / "elsewhere.gguf"
    link.symlink_to(gguf)
    assert resolve_model(str(link)).path == smol.path


def test_model_list_shows_smollm2_installed_and_converted(smol, monkeypatch, capsys):
    code, out, err = _cli(monkeypatch, capsys, "list", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(KNOWN_MODELS) <= set(rows)
    smollm2 = rows["smollm2"]
    assert smollm2["installed"] is True and smollm2["converted"] is True
    assert smollm2["path"] == str(smol.path) and smollm2["fingerprint"] == smol.fingerprint
    assert smollm2["bytes"] == sum(f.stat().st_size for f in smol.path.iterdir())
    monkeypatch.setenv("COLUMNS", "200")  # the table on one line a model
    code, table, err = _cli(monkeypatch, capsys, "list")
    line = next(line for line in table.splitlines() if "smollm2" in line)
    assert code == 0 and str(smol.path) in line and "yes" in line and "gemma3-270m" in table
    assert err == ""  # the table is the result: stdout alone


def test_model_list_shows_other_converted_models(tmp_path, monkeypatch, capsys):
    """A conversion of a GGUF that is no known model's is listed with its name and source."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    converted = tmp_path / "models" / "0123abcd"
    converted.mkdir(parents=True)
    record = {"name": "My Model 1B", "source": "/data/my-model.gguf", "fingerprint": "0123abcd", "files": {}}
    (converted / model_files.RECORD_NAME).write_text(json.dumps(record))
    code, out, err = _cli(monkeypatch, capsys, "list", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["smollm2"]["converted"] is False and rows["smollm2"]["installed"] is True
    mine = rows["My Model 1B"]
    assert mine["known"] is False and mine["converted"] is True and mine["path"] == str(converted)
    assert mine["gguf"] == "/data/my-model.gguf"


def test_a_package_of_parts_is_assembled_once_under_kvrag_home(session_home):
    """gemma3-270m ships its GGUF in four part packages: assembled into $KVRAG_HOME/models/gguf/, not ~/.cache."""
    path = known_gguf("gemma3-270m")
    assert path == session_home / "models" / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    assert gguf_header(path) == {"general.architecture": "gemma3", "general.name": "Gemma 3 270m"}
    mtime = path.stat().st_mtime_ns
    assert known_gguf("gemma3-270m") == path and path.stat().st_mtime_ns == mtime  # not written again
    assert not list(path.parent.glob(".*"))  # no temporary file left beside it


@pytest.mark.parametrize("family, attention", [
    ("gemma3_text", "SDPA (float32, scale 24^-1/2, sliding window 64 on 2 of 4 layers)"),
    ("gemma2", "float32 matmuls, soft-capped at 1.5 (scale 24^-1/2, sliding window 64 on 2 of 4 layers)"),
    ("mistral_window", "SDPA (float32, sliding window 64 on 3 of 3 layers)"),
])
def test_model_info_names_the_attention_a_family_runs(family, attention, smol, tmp_path, monkeypatch, capsys):
    """Gemma's attention (model/gemma.py) and sliding windows never reach the row kernel, even at a head dim it
    takes (64)."""
    arch, overrides = FAMILIES[family]
    path = _tiny_model_dir(tmp_path, smol, arch, **{**overrides, "head_dim": 64})
    code, out, err = _cli(monkeypatch, capsys, "info", "--json", "--model", str(path), "--dtype", "float32",
                          "--device", "cpu")
    assert code == 0, err
    assert json.loads(out)["attention"] == attention


def _one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_missing_file_is_one_line(tmp_path, monkeypatch, capsys):
    code, _, err = _cli(monkeypatch, capsys, "info", "--model", str(tmp_path / "nope.gguf"))
    _one_line_error(code, err, "does not exist")


def test_an_unknown_name_lists_the_known_ones(monkeypatch, capsys):
    code, _, err = _cli(monkeypatch, capsys, "info", "--model", "llama-7b")
    _one_line_error(code, err, "unknown model 'llama-7b'", ", ".join(KNOWN_MODELS))


def test_a_known_name_without_its_package_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(KNOWN_MODELS, "absent-1b", KnownModel("kvrag_absent_model_pkg", "absent.gguf", False,
                                                              "pip install kvrag-absent-model-pkg", "absent", "absent"))
    code, _, err = _cli(monkeypatch, capsys, "info", "--model", "absent-1b")
    _one_line_error(code, err, "not installed", "pip install kvrag-absent-model-pkg")


def test_a_file_that_is_not_gguf_is_refused_without_touching_the_cache(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("KVRAG_HOME", str(home))
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model, whatever its name says")
    code, _, err = _cli(monkeypatch, capsys, "info", "--model", str(fake))
    _one_line_error(code, err, "is not a GGUF file")
    assert not home.exists()


@pytest.mark.parametrize("arch", ["rwkv6", "bert"])
def test_an_architecture_kvrag_cannot_convert_and_run_is_refused_before_converting(arch, tmp_path, monkeypatch,
                                                                                   capsys):
    """rwkv6: transformers has no GGUF loader for it; bert: transformers has, kvrag runs no encoder."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVRAG_HOME", str(home))
    gguf = _write_gguf(tmp_path / f"{arch}.gguf", arch, name=f"some {arch}")
    code, _, err = _cli(monkeypatch, capsys, "info", "--model", str(gguf))
    _one_line_error(code, err, f"'{arch}'", "kvrag does not run")
    assert not home.exists()


@pytest.mark.slow  # a subprocess that imports transformers
def test_a_gguf_transformers_cannot_load_is_one_line_and_leaves_no_partial_conversion(tmp_path, kvrag):
    """A Llama header with no tensors and no tokenizer: the conversion starts, transformers refuses it, and nothing
    of it stays in the cache. In a subprocess: transformers' own warnings would reach the real stderr."""
    home = tmp_path / "home"
    gguf = _write_gguf(tmp_path / "empty-llama.gguf", "llama")
    proc = kvrag("model", "info", "--model", str(gguf), env={"KVRAG_HOME": str(home)}, check=False)
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("kvrag: converting"))
    _one_line_error(proc.returncode, err, "transformers cannot load empty-llama.gguf")
    models = home / "models"
    assert not list(models.glob("gguf-*.json")) and not list(models.glob(".converting-*"))
    assert not list(models.glob(f"*/{model_files.RECORD_NAME}"))
