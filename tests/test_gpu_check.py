"""The GPU check (issues 47, 59) rehearsed without a GPU: tools/gpu_check.sh --cpu-smoke over the folder `make
gpu-check` fills (CI makes it before the suite; elsewhere a folder without wheels is made here), every part's JSON,
what a device call brings back, the call's time budget as the script plans it, the folder's size bound and manifest,
and the summary of a run cut short."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrag.bench import gpu_check, gpu_kernels
from kvrag.bench.gpu_check_tests import junit_counts

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / ".gpu-check"
SCRIPT = ROOT / "tools" / "gpu_check.sh"
DEVICE_CALL_S = 300  # one call, its setup included, leaves a second within a session's 15 minutes of device time


def _plan() -> dict:
    """The budget as the script itself sets it (its assignments, not a copy kept here)."""
    values = dict(re.findall(r'^([A-Z_]+)=("[^"]*"|\d+)', SCRIPT.read_text(), re.M))
    numbers = {k: int(values[k]) for k in ("CALL_S", "SETUP_CAP", "GRACE", "SUMMARY_CAP")}
    caps = {name: int(cap) for name, cap in (spec.split(":") for spec in values["PLAN"].strip('"').split())}
    return {**numbers, "caps": caps}


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder(tmp_path_factory, musique_path, smol) -> Path:
    """`make gpu-check`'s folder where it was made (CI), else one without wheels, made here from the same parts."""
    if (FOLDER / "manifest.json").exists():
        return FOLDER
    out = tmp_path_factory.mktemp("gpu-check") / ".gpu-check"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "pack", "--no-wheels", "--out", str(out),
                    "--dataset", str(musique_path)], check=True, capture_output=True, text=True)
    return out


def test_the_rehearsal_runs_every_part_and_writes_what_a_device_call_returns(folder, tmp_path, smol):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_FOLDER": str(folder), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the call's budget: setup, every part's cap and kill grace, and the summary, within one call of 300 s
    plan = _plan()
    total = plan["SETUP_CAP"] + sum(cap + plan["GRACE"] for cap in plan["caps"].values()) + plan["SUMMARY_CAP"]
    assert total <= plan["CALL_S"] <= DEVICE_CALL_S, plan
    assert f": {total} s of the call's {plan['CALL_S']}" in proc.stdout.splitlines()[0]  # the plan it ran
    assert tuple(plan["caps"]) == gpu_check.PARTS  # most valuable first, the order the summary lists them in
    assert proc.stdout.index("gpu_check: tests exit") < proc.stdout.index("gpu_check: e2e-smol exit")
    for part in gpu_check.PARTS:
        assert re.search(rf"gpu_check: {part} exit 0 in \d+ s", proc.stdout), proc.stdout
    # a device call brings back at most 8 files, named in letters, digits, '.', '_' and '-'
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in gpu_check.PARTS}
    assert all(r["done"] and r["smoke"] for r in parts.values())
    assert all(parts["peaks"]["peaks"][k] > 0 for k in ("matmul_tflops", "copy_gbps", "h2d_gbps"))
    kernels = [k["kernel"] for k in parts["kernels"]["kernels"]]
    sizes = gpu_kernels.SMOKE_KERNELS
    assert kernels.count("decode_attention") == len(sizes.batches) * len(sizes.contexts)
    assert kernels.count("load_layers") == 2 and parts["kernels"]["flashinfer"] == "not installed"
    graphs = parts["graphs"]["cases"]
    assert len(graphs) == len(gpu_check.SMOKE_GRAPH_CASES)
    assert all(c["max_abs_diff"] < 1e-4 and c["graph_stats"] for c in graphs), graphs
    for part, role_targets in (("e2e-8b", 3), ("e2e-smol", 1)):
        model = parts[part]["model"]
        assert model["items"] == gpu_check.SMOKE_ITEMS and len(parts[part]["targets"]) == role_targets
        for r in model["records"]:  # the folder's MuSiQue items, cut short, through the carried tokenizer
            assert 0 < r["recomputed"] < r["chunk_rows"] < r["prompt_tokens"] and r["bytes_loaded"] > 0
        assert model["tier_ms"] > 0 and model["launches"]["blend"]["ops"] > 0
    tests = parts["tests"]
    assert (tests["passed"], tests["failed"], tests["errors"]) == (1, 0, 0), tests
    assert tests["skipped"] == 3 and all("gpu" in c["test"] for c in tests["cases"] if c["outcome"] == "skipped")
    # the summary table comes last, one row a part
    assert all(f"| {p} | done |" in proc.stdout for p in gpu_check.PARTS)


def test_a_plan_over_the_call_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "tools").mkdir()
    over = _plan()["CALL_S"] + 1
    (tmp_path / "tools" / "gpu_check.sh").write_text(SCRIPT.read_text().replace('PLAN="', f'PLAN="late:{over} ', 1))
    proc = subprocess.run(["bash", str(tmp_path / "tools" / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path / "out")}, timeout=60)
    assert proc.returncode == 2 and "over the call's" in proc.stdout.splitlines()[-1], proc.stdout


def test_the_folder_fits_its_bound_and_matches_its_manifest(folder):
    if folder != FOLDER and os.environ.get("CI"):
        pytest.fail("CI runs `make gpu-check` before the suite: .gpu-check is missing")
    tool = _tool()
    assert tool.verify(folder, wheels=folder == FOLDER) == []
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["total_bytes"] <= tool.LIMIT == 40 << 20
    assert {"smollm2/tokenizer.json", "smollm2/config.json", "minilm/vocab.txt", "musique.json"} <= set(manifest["files"])
    assert not any(name.endswith(("model.safetensors", ".gguf")) for name in manifest["files"])  # no weights travel
    assert len(json.loads((folder / "musique.json").read_text())) == len(tool.REPORT_ITEMS)
    # a call carries the tree's tracked files and the folder: 64 MiB at most
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if (ROOT / name).is_file())
    assert tree + manifest["total_bytes"] <= 64 << 20, (tree, manifest["total_bytes"])


def test_verify_names_a_damaged_file_an_extra_one_and_an_oversized_folder(folder, tmp_path):
    tool = _tool()
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("wheels"))
    tool.write_manifest(copy)
    assert tool.verify(copy, wheels=False) == []
    (copy / "musique.json").write_text("[]")
    (copy / "stray.bin").write_bytes(b"\0" * (tool.LIMIT + 1))
    problems = " | ".join(tool.verify(copy, wheels=False))
    assert "musique.json differs from its checksum" in problems
    assert "stray.bin" in problems and "over the 40 MiB" in problems


def test_wheel_tags_are_judged_for_the_image_python():
    tool = _tool()
    from packaging.utils import parse_wheel_filename

    def fits(name: str) -> bool:
        return any(tool._fits_image(t) for t in parse_wheel_filename(name)[3])

    assert fits("lmdb-3.0.0-cp312-cp312-manylinux2014_x86_64.whl")
    assert fits("llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl")
    assert fits("fastapi-0.165.0-py3-none-any.whl")
    assert not fits("lmdb-3.0.0-cp311-cp311-manylinux2014_x86_64.whl")  # this machine's Python, not the image's
    assert not fits("zstandard-0.25.0-cp312-cp312-manylinux2014_aarch64.whl")
    assert not fits("selectolax-1.0.2-cp312-cp312-manylinux_2_41_x86_64.whl")  # a newer glibc than Ubuntu 24.04's


def test_junit_counts_on_a_hand_written_report(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="a" time="1.5"/>'
                   '<testcase classname="t" name="b"><failure message="boom"/></testcase>'
                   '<testcase classname="t" name="c"><skipped message="needs a CUDA GPU"/></testcase>'
                   '<testcase classname="t" name="d"><error message="fixture"/></testcase></testsuite></testsuites>')
    got = junit_counts(xml)
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (1, 1, 1, 1)
    assert got["cases"][0] == {"test": "t::a", "outcome": "passed", "seconds": 1.5, "message": ""}
    assert got["cases"][1]["message"] == "boom"


def test_the_summary_says_which_part_was_cut_and_which_never_ran(tmp_path):
    check = gpu_check.Check(tmp_path, tmp_path)
    check.write("peaks", {"device": "H100", "peaks": {"matmul_tflops": 700.0, "copy_gbps": 3000.0, "h2d_gbps": 50.0}},
                done=True)
    check.write("tests", {"passed": 2, "failed": 0, "errors": 0, "skipped": 0, "cases": []}, done=False)
    table = gpu_check.summary(check)
    assert "| peaks | done | H100: 700 TFLOP/s, copy 3000 GB/s, H2D 50.0 GB/s |" in table
    assert "| tests | cut short | 2 passed, 0 failed, 0 errors, 0 skipped |" in table
    assert "| kernels | no result | |" in table and "| e2e-8b | no result | |" in table


def test_flashinfer_page_tables_on_a_hand_computed_case():
    """kvrag's padded block tables as FlashInfer's CSR ones (bench/gpu_flashinfer.py; FlashInfer itself runs only
    where its wheel is installed): two sequences of 20 tokens in blocks of 16, 4 rows in each last block."""
    import torch

    from kvrag.bench.gpu_flashinfer import csr_tables

    indptr, indices, last = csr_tables(torch.tensor([[3, 5], [7, 1]], dtype=torch.int32), 20, 16)
    assert indptr.tolist() == [0, 2, 4] and indices.tolist() == [3, 5, 7, 1] and last.tolist() == [4, 4]
