"""tools/gpu_machine.py, the part that needs no GPU: a bundle cut into parts that come in separate calls is joined
and checked, and nothing is unpacked until every part is there."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_machine.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_machine", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts(root: Path, size: int) -> list[Path]:
    """A bundle of one wheel-named file cut into parts of `size` bytes, as `pack` lays them out."""
    payload = bytes(range(256)) * 40
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("wheels/demo-1.0-py3-none-any.whl")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    data = out.getvalue()
    n = -(-len(data) // size)
    parts = []
    for i in range(n):
        part = root / f"part-{i + 1}"
        part.mkdir(parents=True)
        (part / f"bundle.tar.{i + 1:03d}").write_bytes(data[i * size:(i + 1) * size])
        (part / "bundle.json").write_text(json.dumps({"parts": n, "sha256": hashlib.sha256(data).hexdigest(),
                                                      "wheels": ["demo-1.0-py3-none-any.whl"]}))
        parts.append(part)
    return parts


def test_parts_in_separate_calls_are_joined_once_all_are_there(tmp_path):
    tool, spool = _tool(), tmp_path / "spool"
    parts = _parts(tmp_path / "bundle", 4096)
    assert len(parts) >= 3
    wheels, missing = tool.gather(parts[:1], spool)
    assert wheels is None and missing == list(range(2, len(parts) + 1))
    wheels, missing = tool.gather(parts[1:], spool)
    assert missing == [] and (wheels / "demo-1.0-py3-none-any.whl").read_bytes() == bytes(range(256)) * 40


def test_a_damaged_part_is_refused(tmp_path):
    tool, parts = _tool(), _parts(tmp_path / "bundle", 4096)
    damaged = parts[1] / "bundle.tar.002"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit, match="checksum"):
        tool.gather(parts, tmp_path / "spool")


def test_the_bundle_is_kvrag_and_its_bench_less_what_the_image_has():
    """Checked against pyproject.toml by hand: the core and `bench` requirements are in the closure, the dev-only
    clients and the cluster/object-store extras are not, and nothing the image brings is bundled."""
    tool = _tool()
    have = tool.closure(list(tool.RUN_ROOTS))
    assert {"fastapi", "uvicorn", "lmdb", "llguidance", "matplotlib", "openai", "torch", "transformers"} <= set(have)
    assert not {"ray", "obstore", "langchain-openai", "ruff", "import-linter"} & set(have)
    bundled = {r.split("==")[0] for r in tool.bundle_requirements(set())}
    assert {"fastapi", "lmdb", "llguidance", "pytest"} <= bundled
    assert not bundled & {tool._norm(n) for n in tool.IMAGE_HAS} and not bundled & set(tool.MODEL_PACKAGES)


def _wheel(folder: Path, name: str) -> Path:
    """The smallest installable wheel: one module `name` that says hello."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "HELLO = 'hello'\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in files.items():
            zf.writestr(arc, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{arc},,\n" for arc in [*files, f"{info}/RECORD"]))
    return path


@pytest.mark.slow
def test_setup_makes_a_venv_that_sees_the_images_torch_and_runs_kvrag(tmp_path):
    """The interpreter running the tool stands in for the GPU image, and like the image's python3 it is itself a
    venv: the new venv must see its torch (which `venv --system-site-packages` would not) and its own wheels
    first, and run kvrag from this tree; no network is needed (--no-index)."""
    tool = _tool()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "kvrag_probe")
    venv = tmp_path / ".venv"
    tool.install(wheels, [p.name for p in wheels.iterdir()], venv)
    code = "import torch, kvrag_probe, kvrag.config; print(torch.__file__, kvrag_probe.HELLO, kvrag.config.__file__)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    torch_file, hello, config_file = out.stdout.split()
    import torch

    assert torch_file == torch.__file__ and hello == "hello"
    assert Path(config_file).resolve() == TOOL.parents[1] / "config.py"
    assert (venv / ".installed").exists() and (venv / "bin" / "kvrag").exists()
