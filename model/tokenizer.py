"""The part of a Hugging Face tokenizer kvrag uses, read straight from `tokenizer.json` with `tokenizers`.

transformers' AutoTokenizer costs about 2 s on a cold start (imports, then its loading machinery) for what is,
underneath, this same Rust tokenizer; a cold `kvrag ask` pays for it before its first token. A directory without
a `tokenizer.json` (a slow tokenizer only) still loads through transformers. tests/test_tokenizer.py holds this
against AutoTokenizer: ids, decoded text, the chat template's rendering and the special tokens.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from kvrag.errors import KvragError

# transformers' clean_up_tokenization: only applied where tokenizer_config.json asks for it
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def load_tokenizer(path: Path):
    """Our light tokenizer where the directory has a tokenizer.json, else transformers' AutoTokenizer."""
    if (path / "tokenizer.json").is_file():
        return Tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Encode, decode, special tokens and chat template, as a fast HF tokenizer gives them."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tk = RustTokenizer.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            self.config = json.loads(config_file.read_text()) if config_file.exists() else {}
        except Exception as exc:  # OSError, bad JSON, or the plain Exception tokenizers raises
            raise KvragError(f"cannot read the tokenizer in {path}: {exc}") from None
        self._tk.no_truncation()
        self._tk.no_padding()
        template_file = path / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else self._config_template()
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self._clean_up = bool(self.config.get("clean_up_tokenization_spaces", False))

    def _config_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one is the chat template
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tk.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    @property
    def backend_tokenizer(self):
        """The Rust tokenizer underneath, as transformers' fast tokenizers name it (model/constrain.py reads it)."""
        return self._tk

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str | list[int]:
        """The template rendered as transformers renders it (sandboxed jinja2, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise KvragError("this tokenizer has no chat template")
        text = self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **self._special_tokens())
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def _special_tokens(self) -> dict[str, str]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        return {n: _token_text(self.config[n]) for n in names if self.config.get(n) is not None}

    @functools.cached_property
    def _compiled(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise KvragError(f"the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)
