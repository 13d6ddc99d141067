"""Grammar-constrained decoding: OpenAI's `response_format` (json_object, json_schema) and forced tool calls.

A Grammar is compiled once per schema (or set of tools) and shared; each sequence starts its own Constraint, which at
every step masks the logits down to the tokens that keep the output a prefix of a valid document, then is told the
token chosen. The grammars are llguidance's (docs/constrained-decoding.md says why, and what each step costs): it
reads the tokenizer straight from its tokenizer.json and computes each step's mask lazily, so a request's new schema
costs milliseconds, not a pass over the whole vocabulary before its first token.

The model's end-of-turn tokens are the grammar's end: the mask allows them exactly where the document may end, and
once nothing else can follow (a closed top-level object) only them, so the turn ends with the document.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from copy import copy

import llguidance
import numpy as np
import torch

from kvrag.errors import KvragError

# One way to lay out JSON: with free whitespace a small model can fill max_tokens with newlines inside an unfinished
# object. ", " and ": " are what json.dumps and OpenAI's models write.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without `parameters`
CHOICE_FORMS = '"auto", "required" or {"type": "function", "function": {"name": ...}}'
AUTO_TEXT = "text: /[^{ ][^\\x00]*/"  # tool_choice auto's other branch: any text whose first character opens no call


class Grammars:
    """The grammars of one tokenizer: its token table as llguidance compiles it (0.25-0.45 s: build this once per
    model) and a small cache of compiled grammars keyed by their source. Safe to share between threads.

    stop_ids: the tokens that end a turn (model/sampling.py's stop_ids(tokenizer): <|im_end|> and the EOS); default
    the tokenizer's eos_token_id."""

    def __init__(self, tokenizer, stop_ids: Iterable[int] | None = None, cache_size: int = 64):
        stops = sorted(set(stop_ids)) if stop_ids is not None else [tokenizer.eos_token_id]
        if not stops or None in stops:
            raise KvragError("constrained decoding needs the model's end-of-turn token ids (stop_ids)")
        backend = copy(tokenizer.backend_tokenizer)  # ours or a fast HF tokenizer's: the Rust one, as JSON
        backend.no_padding()
        backend.no_truncation()
        try:
            self._tokens = llguidance.LLTokenizer(backend.to_str(), eos_token=stops)
        except Exception as exc:  # an id outside the vocabulary, a tokenizer llguidance cannot read
            raise KvragError(f"constrained decoding cannot use this tokenizer: {_one_line(str(exc))}") from None
        self.stop_ids = frozenset(stops)
        self.vocab_size = self._tokens.vocab_size  # the tokenizer's; a model's logits may be longer
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def json_object(self) -> Grammar:
        """Any JSON object (response_format {"type": "json_object"})."""
        return self.json_schema(ANY_OBJECT)

    def json_schema(self, schema: dict) -> Grammar:
        """A JSON document that validates against `schema`; KvragError, in one line, for a schema that is not one."""
        if not isinstance(schema, dict):
            raise KvragError(f"a JSON schema must be a JSON object, not {type(schema).__name__}")
        text = _json_text(schema, "the JSON schema")
        return self._cached("schema " + text, lambda: self._build(
            llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_STYLE), "bad JSON schema"))

    def tool_call(self, tools: list[dict], choice="required") -> Grammar:
        """One call, {"name": <a tool's name>, "arguments": {...its parameters...}}, for OpenAI's `tools` and a
        tool_choice that forces a call: "required" (any of them) or {"type": "function", "function": {"name": ...}};
        "auto": either such a call or text that does not start like one (the model chooses)."""
        functions = _functions(tools)
        if choice not in ("required", "auto"):
            name = _chosen(choice)
            if name not in functions:
                raise KvragError(f"tool_choice names the function {name!r}, which is not among the tools")
            functions = {name: functions[name]}
        lark = "start: " + " | ".join(_call_rule(name, params) for name, params in functions.items())
        if choice == "auto":
            lark += " | text\n" + AUTO_TEXT
        return self._cached("tools " + lark, lambda: self._tool_grammar(lark, functions))

    def _cached(self, key: str, build: Callable[[], Grammar]) -> Grammar:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = build()  # outside the lock: one request's new schema holds up no other request
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # the least recently used
        return grammar

    def _build(self, source: str, what: str) -> Grammar:
        # log_level=0: llguidance's errors come back to us (is_error) rather than onto stderr
        matcher = llguidance.LLMatcher(self._tokens, source, log_level=0)
        if matcher.is_error():
            raise KvragError(f"{what}: {_one_line(matcher.get_error())}")
        return Grammar(matcher, self.vocab_size)

    def _tool_grammar(self, lark: str, functions: dict[str, dict]) -> Grammar:
        try:
            return self._build(lark, "bad tools")
        except KvragError:
            for name, params in functions.items():  # only on failure: find the tool to name in the message
                source = llguidance.LLMatcher.grammar_from_json_schema(_json_text(params, name), overrides=JSON_STYLE)
                problem = llguidance.LLMatcher.validate_grammar(source, self._tokens)
                if problem:
                    raise KvragError(f"tool {name!r}: bad parameters schema: {_one_line(problem)}") from None
            raise


class Grammar:
    """A compiled grammar, shared by every request that asks for it: start() gives each sequence its own state."""

    def __init__(self, matcher, vocab_size: int):
        self._initial = matcher  # never advanced: the state each sequence starts from
        self._vocab_size = vocab_size

    def start(self) -> Constraint:
        return Constraint(self._initial.deep_copy(), self._vocab_size)  # a copy is ~10 µs, a new matcher ~1 ms


class Constraint:
    """One sequence's place in its grammar. Each step: mask(logits), choose a token, accept(token); done() once the
    document is closed. Not thread-safe: one sequence, one thread at a time."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32 * 4, dtype=np.uint8)  # llguidance writes a bit per token

    def allowed(self) -> torch.Tensor:
        """bool [the tokenizer's vocab size]: the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():  # e.g. a grammar past llguidance's per-step limits
            raise KvragError(f"constrained decoding failed: {_one_line(self._matcher.get_error())}")
        bits = np.unpackbits(self._bits, bitorder="little")[: self._vocab_size]  # little-endian u32 words: token order
        return torch.from_numpy(bits.view(np.bool_))

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [..., V] of every token the grammar does not allow next to -inf, in place. Ids past the
        tokenizer's vocabulary (an embedding padded to a round size) are never allowed."""
        allowed = self.allowed()
        if allowed.shape[0] != logits.shape[-1]:
            n = min(logits.shape[-1], allowed.shape[0])
            allowed = torch.cat([allowed[:n], torch.zeros(logits.shape[-1] - n, dtype=torch.bool)])
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """The token chosen; KvragError if the grammar does not allow it (a token that mask() had removed)."""
        if not self._matcher.consume_token(int(token)):
            raise KvragError(f"token {int(token)} breaks the grammar: {_one_line(self._matcher.get_error())}")

    def done(self) -> bool:
        """True once nothing but a stop token can follow (the document is closed), or a stop token was accepted."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


def _one_line(message: str) -> str:
    """llguidance's message without the parser state it appends (<state>...), on one line."""
    return " ".join(message.split("<state>")[0].split())[:300] or "unknown error"


def _json_text(value, what: str) -> str:
    """Key order kept: a schema's properties are written in the order it lists them."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise KvragError(f"{what} is not JSON: {exc}") from None


def _functions(tools) -> dict[str, dict]:
    """name -> parameters schema, in order, from OpenAI's `tools` list; KvragError for anything else."""
    if not isinstance(tools, list) or not tools:
        raise KvragError('tools must be a non-empty list of {"type": "function", "function": {"name": ...}}')
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn, name = _function(tool)
        if not isinstance(name, str) or not name:
            raise KvragError(f'tools[{i}] is not {{"type": "function", "function": {{"name": ...}}}}')
        params = fn.get("parameters") or NO_ARGUMENTS  # none, or {}: a call with no arguments
        if not isinstance(params, dict):
            raise KvragError(f"tool {name!r}: parameters must be a JSON schema object")
        if name in functions:
            raise KvragError(f"two tools are named {name!r}")
        functions[name] = params
    return functions


def _function(obj) -> tuple[dict | None, object]:
    """The function object of {"type": "function", "function": {...}} (a tool or a tool_choice), and its name."""
    fn = obj.get("function") if isinstance(obj, dict) and obj.get("type") == "function" else None
    return fn, fn.get("name") if isinstance(fn, dict) else None


def _chosen(choice) -> str:
    """The function a tool_choice object names."""
    name = _function(choice)[1]
    if not isinstance(name, str):
        raise KvragError(f"tool_choice must be {CHOICE_FORMS} to force a call, not {str(choice)[:80]}")
    return name


def _call_rule(name: str, params: dict) -> str:
    """One tool's call as a Lark alternative: the fixed text up to its arguments, then the arguments as a JSON schema
    of their own (%json: each tool's $refs resolve against its own parameters, as the client wrote them)."""
    head = json.dumps('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ', ensure_ascii=False)
    return f'{head} %json {_json_text({**params, "x-guidance": JSON_STYLE}, name)} "}}"'
