"""Fill the folder the GPU check carries to a lent GPU machine (issue 47, docs/gpu.md, "The GPU check").

    here   python tools/gpu_check.py pack [--out .gpu-check]      (or `make gpu-check`; PyPI must be reachable)
    there  bash tools/gpu_check.sh                                 (`device run`, carry [".gpu-check"], timeout_s 300)

The folder holds, in at most 40 MiB (a call carries 64 MiB, the tree included):
- wheels/: what kvrag, its bench and the cuda tests need on the GPU machine's Python (3.12) that its image lacks
  (tools/gpu_image.txt lists what the image holds), no dependencies resolved there (`pip --no-deps`);
- smollm2/: SmolLM2's config and tokenizer files, no weights (the speed runs draw random weights of its shape);
- minilm/: all-MiniLM-L6-v2's config and tokenizer files, no weights (the cuda tests index with a random BERT of
  its layout);
- musique.json: the MuSiQue report items the end-to-end parts time (50-59);
- manifest.json: every file's bytes and sha256, checked by `verify` and tests/test_gpu_check.py.

`--no-wheels` leaves the wheels out: the CPU rehearsal (`bash tools/gpu_check.sh --cpu-smoke`) needs the rest only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_machine import MODEL_PACKAGES, RUN_ROOTS, _download, _norm, closure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 40 << 20  # bytes: the whole folder
IMAGE_LIST = Path(__file__).resolve().parent / "gpu_image.txt"
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_s.json"
REPORT_ITEMS = range(50, 60)  # of the report split (50-99): the end-to-end parts' 10 items
SMOL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "special_tokens_map.json")
NO_WEIGHTS = {"model.safetensors", "pytorch_model.bin", "README.md"}
PYTHON = "3.12"  # the image's
# what this venv's newer releases of the image's packages require and the image's own do not: transformers 5.25's
# `kernels` (Hugging Face's hub kernels, 2.7 MB: over the limit); the image's transformers runs there, kvrag loads none
NOT_CARRIED = {"kernels"}


def image_has() -> set[str]:
    lines = IMAGE_LIST.read_text().splitlines()
    return {_norm(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def wanted() -> dict[str, str]:
    """{name: version as this venv has it} of what the GPU machine needs and its image lacks."""
    skip = image_has() | {"kvrag", *MODEL_PACKAGES} | NOT_CARRIED
    return {n: v for n, v in closure(RUN_ROOTS).items() if n not in skip and not n.startswith("nvidia-")}


def _wheel_name(path: Path) -> str:
    return _norm(str(parse_wheel_filename(path.name)[0]))


def fill_wheels(folder: Path) -> None:
    """wheels/ holds exactly one wheel of each wanted distribution at this venv's version (kept ones not fetched
    again)."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    want = wanted()
    have = {}
    for f in wheels.glob("*.whl"):
        name, version = _wheel_name(f), str(parse_wheel_filename(f.name)[1])
        if want.get(name) == version and name not in have:
            have[name] = f
        else:
            f.unlink()  # another version, or no longer needed
    _download([f"{n}=={v}" for n, v in sorted(want.items()) if n not in have], wheels, PYTHON)


def copy_models(folder: Path) -> None:
    """smollm2/ and minilm/: the config and tokenizer files of the default model and the embedder."""
    from kvrag.corpus.embedder import model_dir
    from kvrag.model.files import resolve_model

    smol = resolve_model(None).path
    _fresh(folder / "smollm2")
    for name in SMOL_FILES:
        if (smol / name).exists():
            shutil.copy(smol / name, folder / "smollm2" / name)
    minilm = model_dir()
    _fresh(folder / "minilm")
    for f in minilm.rglob("*"):
        if f.is_file() and f.name not in NO_WEIGHTS:
            dest = folder / "minilm" / f.relative_to(minilm)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)


def _fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def copy_items(folder: Path, dataset: Path) -> None:
    if not dataset.is_file():
        sys.exit(f"gpu_check: {dataset} is missing: the end-to-end parts time MuSiQue's report items "
                 "(pass --dataset FILE)")
    items = json.loads(dataset.read_text())
    (folder / "musique.json").write_text(json.dumps([items[i] for i in REPORT_ITEMS if i < len(items)]))


def files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.name != "manifest.json")


def write_manifest(folder: Path) -> dict:
    entries = {str(f.relative_to(folder)): {"bytes": f.stat().st_size,
                                            "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
               for f in files(folder)}
    manifest = {"python": PYTHON, "limit_bytes": LIMIT, "total_bytes": sum(e["bytes"] for e in entries.values()),
                "files": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def verify(folder: Path, wheels: bool = True) -> list[str]:
    """What is wrong with the folder, one line each (nothing: ready to carry)."""
    if not (folder / "manifest.json").is_file():
        return [f"{folder} has no manifest.json: run `make gpu-check`"]
    manifest = json.loads((folder / "manifest.json").read_text())
    problems = []
    listed = manifest["files"]
    on_disk = {str(f.relative_to(folder)): f for f in files(folder)}
    if set(listed) != set(on_disk):
        problems.append(f"files differ from the manifest: {sorted(set(listed) ^ set(on_disk))}")
    total = sum(f.stat().st_size for f in on_disk.values()) + (folder / "manifest.json").stat().st_size
    if total > LIMIT:
        problems.append(f"{total / 2**20:.1f} MiB, over the {LIMIT >> 20} MiB a check may carry")
    for rel, f in on_disk.items():
        if rel in listed and hashlib.sha256(f.read_bytes()).hexdigest() != listed[rel]["sha256"]:
            problems.append(f"{rel} differs from its checksum")
    for need in ("smollm2/config.json", "smollm2/tokenizer.json", "minilm/vocab.txt", "musique.json"):
        if need not in on_disk:
            problems.append(f"{need} is missing")
    return problems + (_wheel_problems(folder) if wheels else [])


def _wheel_problems(folder: Path) -> list[str]:
    """Each wanted distribution once, each wheel installable on the image's CPython 3.12 (manylinux x86_64)."""
    found = [_wheel_name(f) for f in (folder / "wheels").glob("*.whl")]
    problems = [f"no wheel for {n}" for n in sorted(set(wanted()) - set(found))]
    problems += [f"{n} is the image's own: not carried" for n in sorted(set(found) & image_has())]
    problems += [f"two wheels of {n}" for n in sorted({n for n in found if found.count(n) > 1})]
    for f in (folder / "wheels").glob("*.whl"):
        if not any(_fits_image(tag) for tag in parse_wheel_filename(f.name)[3]):
            problems.append(f"{f.name} does not install on CPython {PYTHON} manylinux x86_64")
    return problems


def _image_tags() -> set[Tag]:
    """Every tag pip accepts on the image's CPython 3.12 with glibc 2.39 (Ubuntu 24.04) on x86_64."""
    platforms = [*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64",
                 "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return {*cpython_tags((3, 12), platforms=platforms), *compatible_tags((3, 12), "cp312", platforms)}


def _fits_image(tag: Tag) -> bool:
    return tag in _image_tags()


def pack(args: argparse.Namespace) -> None:
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    if args.no_wheels:
        shutil.rmtree(folder / "wheels", ignore_errors=True)
    else:
        fill_wheels(folder)
    copy_models(folder)
    copy_items(folder, Path(args.dataset))
    manifest = write_manifest(folder)
    problems = verify(folder, wheels=not args.no_wheels)
    if problems:
        sys.exit("gpu_check: " + "; ".join(problems))
    n = sum(k.startswith("wheels/") for k in manifest["files"])
    print(f"gpu_check: {folder} ready: {n} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB of "
          f"{LIMIT >> 20}; run `bash tools/gpu_check.sh` there (device run, carry ['{folder.name}'], timeout_s 300)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="fill the folder (downloads wheels from PyPI)")
    p.add_argument("--out", default=str(ROOT / ".gpu-check"))
    p.add_argument("--dataset", default=str(MUSIQUE))
    p.add_argument("--no-wheels", action="store_true", help="the rest only: what the CPU rehearsal needs")
    v = sub.add_parser("verify", help="check a filled folder against its manifest and the size limit")
    v.add_argument("folder", nargs="?", default=str(ROOT / ".gpu-check"))
    args = parser.parse_args()
    if args.command == "pack":
        pack(args)
    elif problems := verify(Path(args.folder)):
        sys.exit("gpu_check: " + "; ".join(problems))
    else:
        print(f"gpu_check: {args.folder} is ready")


if __name__ == "__main__":
    if importlib.util.find_spec("kvrag") is None:
        sys.exit("gpu_check: run it with the venv's Python (.venv/bin/python), where kvrag is installed")
    main()
