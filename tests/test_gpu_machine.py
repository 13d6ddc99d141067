"""tools/gpu_machine.py, the part that needs no GPU: a bundle cut into parts that come in separate calls is joined
and checked, and nothing is unpacked until every part is there."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
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
