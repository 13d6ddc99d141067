"""The request bodies the server takes: OpenAI's fields that matter here, and kvrag's own as extra fields.

Known fields are checked strictly (a string where a number belongs is a 400, not a coercion); fields this server
does not know are ignored, as clients send many (`user`, `metadata`, ...), but none that changes the answer is:
`logit_bias`, `frequency_penalty` and `presence_penalty` are served as OpenAI defines them; image, audio or file
content parts (a text-only model), completions' `echo`, `suffix` and `best_of` > n, and chat's deprecated
`functions` / `function_call` are each a 400 naming the field. kvrag's extra fields (`_Generate`'s last ones, each
with its meaning) are sent by the `openai` client with `extra_body={...}`.

`POST /v1/embeddings` takes OpenAI's body (EmbeddingRequest): texts, embedded by the store's own embedder.
Chat's `logprobs` / `top_logprobs` are served with whole answers; the legacy completions `logprobs` is a 400 naming
the chat endpoint: no field that changes the answer's shape is ignored.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrag.api import KV_RULE, MIN_SCORE, KvragError, RatioPolicy

MAX_CHOICES = 16  # n's bound: each choice is a sequence of its own in the engine's batch


class BadField(ValueError):
    """A field whose value this server cannot serve, though well-typed: a 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Passage(_Body):
    title: str = ""
    text: str


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    # OpenAI's roles (its deprecated `function` aside: functions are refused); any other is a 400 wherever it stands
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, as this server returned them

    def text(self) -> str:
        """The message's text: the string, or its text parts joined (images and the like have none); an assistant's
        call is the text the model wrote for it (model/constrain.tool_call), so a kept turn still matches."""
        if self.tool_calls:
            return " ".join(_call_text(call) for call in self.tool_calls)
        if isinstance(self.content, list):
            return "".join(_part_text(part) for part in self.content)
        return self.content or ""


def _part_text(part: ContentPart) -> str:
    """A text part's text; any other part (an image, audio, a file) a 400: a text-only model cannot read it, and
    answering without it would answer a question the client did not ask."""
    if part.type != "text":
        raise BadField("messages", f"this server serves a text-only model: content part type '{part.type}' is "
                       "not supported")
    return part.text or ""


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        raise BadField("messages", "a tool call's arguments must be a JSON object in a string") from None
    return json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Generate(_Body):
    """Fields both endpoints share: OpenAI's sampling and streaming, kvrag's retrieval and blending."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)  # vLLM's: no stop token before this many (benchmarks' fixed-length answers)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices per request, each its own sequence
    logit_bias: dict[str, float] | None = None  # {token id: bias in [-100, 100]}, added to the logits
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # kvrag's extra fields. Retrieval: the k best chunks (0: none, plain chat), less those under relative_cutoff x the
    # best score and under min_score, a cosine similarity that is not about the question (docs/retrieval-cutoff.md)
    k: int = Field(5, ge=0, le=1000)
    relative_cutoff: float = Field(0.5, ge=0, le=1)
    min_score: float = Field(MIN_SCORE, ge=0, le=1)
    rag: bool = True  # false: plain chat, no passages or RAG instruction (true: retrieval decides)
    chunk_ids: list[str] | None = None  # chunks of the store to answer from, instead of retrieval
    passages: list[Passage | str] | None = None  # the client's own, {"title", "text"} or plain strings, instead of both
    mode: Literal["blend", "full", "prefix", "reuse"] = "blend"
    ratio: float | Literal["auto"] = "auto"  # the share of chunk tokens a blend recomputes, 0..1, or "auto"
    kv_tokens: int = Field(0, ge=0)  # a decode-time KV budget (Keyformer), in tokens; 0: none
    kv_rule: Literal["keyformer", "h2o", "window"] = KV_RULE
    # vLLM's field: what this request's prompts leave cached (prefix blocks, kept passages) is seen by requests with
    # the same salt (and API key) alone
    cache_salt: str | None = Field(None, max_length=256)
    # the answer as `kvrag ask --json` records it (engine/answer.py), on each choice's last stream chunk (or beside
    # the whole response's choices): what `kvrag ask` reads when it asks a running server (cli/ask_server.py)
    answer_record: bool = False

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stop if s)

    def options(self, default_max_tokens: int, grammars=None) -> dict:
        """Keyword arguments for KVRag.submit (the question aside); `grammars` serves a chat's constrained answer.
        Unset sampling fields take kvrag's defaults: greedy (temperature 0), which answers the same every time, unlike
        OpenAI's default of 1."""
        self.refuse_unserved()
        try:
            ratio = RatioPolicy.parse(self.ratio, "ratio")
        except KvragError as exc:
            raise BadField("ratio", str(exc)) from None
        passages = None if self.passages is None else \
            [("", p) if isinstance(p, str) else (p.title, p.text) for p in self.passages]
        return {"k": self.k, "rag": self.rag, "relative_cutoff": self.relative_cutoff, "min_score": self.min_score,
                "chunk_ids": self.chunk_ids, "passages": passages, "mode": self.mode, "ratio": ratio,
                "max_tokens": self.max_tokens or default_max_tokens, "min_tokens": self.min_tokens,
                "temperature": self.temperature or 0.0,
                "top_p": self.top_p or 1.0, "seed": self.seed, "kv_tokens": self.kv_tokens, "kv_rule": self.kv_rule,
                "logprobs": self.top_alternatives(), "logit_bias": self.bias(), "salt": self.cache_salt or "",
                "frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0}

    def top_alternatives(self) -> int | None:
        """How many alternatives each token's logprobs lists; None: no logprobs asked."""
        return None

    def refuse_unserved(self) -> None:
        """BadField for a field set to a value this server does not serve and that would change the answer."""

    def bias(self, vocab_size: int | None = None) -> dict[int, float] | None:
        """logit_bias as {token id: bias}; BadField naming it for an id that is no integer (or, given `vocab_size`,
        not in the vocabulary) or a bias out of [-100, 100]."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            token = int(key) if key.strip().isdigit() else -1
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise BadField("logit_bias", f"logit_bias: '{key}' is not a token id of this model's vocabulary"
                               + (f" (0..{vocab_size - 1})" if vocab_size else ""))
            if not -100 <= value <= 100:
                raise BadField("logit_bias", f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}")
            bias[token] = value
        return bias


class ChatRequest(_Generate):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def question(self) -> str:
        """The last message: the user's question the server retrieves for and answers, or a tool's result (the
        model answers it as plain chat)."""
        last = self.messages[-1]
        if last.role not in ("user", "tool"):
            raise BadField("messages", f"the last message must be the user's or a tool's, got role '{last.role}'")
        return last.text()

    def history(self) -> list[tuple[str, str]]:
        """The messages before the last, as (role, text): the conversation the question continues, in the model's
        chat template (OpenAI's `developer` role is a system message)."""
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages[:-1]]

    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # constrained decoding (model/constrain.py): a JSON answer, or a tool call
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None  # deprecated for tools: refused, never ignored
    function_call: str | dict | None = None

    def refuse_unserved(self) -> None:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise BadField(name, f"{name} is deprecated and not served: send tools")

    def calls_tools(self) -> bool:
        """Whether the answer may be a tool call (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def grammar(self, grammars):
        """The Grammar the answer is decoded within (from `grammars()`, the model's Grammars, built at first use), or
        None for free text; BadField naming the field that cannot be served."""
        if self.tool_choice is not None and not self.tools:
            raise BadField("tool_choice", "tool_choice needs tools")
        fmt = self.response_format
        wants_json = fmt is not None and fmt.type != "text"
        try:
            if self.calls_tools():
                if wants_json:
                    raise BadField("response_format", "response_format and tools in one request: send one of them")
                return grammars().tool_call(self.tools, self.tool_choice or "auto")
            if not wants_json:
                return None
            if fmt.type == "json_object":
                return grammars().json_object()
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise BadField("response_format", "response_format json_schema needs json_schema.schema")
            return grammars().json_schema(fmt.json_schema.schema_)
        except KvragError as exc:
            raise BadField("tools" if self.calls_tools() else "response_format", str(exc)) from None

    def options(self, default_max_tokens: int, grammars=None) -> dict:
        """Keep each turn's KV for its follow-up (engine/conversations.py); `grammars` (KVRag.grammars) builds the
        answer's grammar, where the request asks for one."""
        tool = self.messages[-1].role == "tool"
        return {**super().options(default_max_tokens), "history": self.history(), "keep_turn": True,
                **({"rag": False, "last_role": "tool"} if tool else {}),
                "grammar": self.grammar(grammars) if grammars is not None else None,
                "max_tokens": self.max_completion_tokens or self.max_tokens or default_max_tokens}

    def top_alternatives(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        if self.stream:
            raise BadField("logprobs", "this server returns logprobs with whole answers (stream: false)")
        return self.top_logprobs or 0


class CompletionRequest(_Generate):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def refuse_unserved(self) -> None:
        if self.echo:
            raise BadField("echo", "echo is not served: the answer comes without its prompt")
        if self.suffix:
            raise BadField("suffix", "suffix is not served: this server completes after the prompt, not between")
        if self.best_of is not None and self.best_of not in (1, self.n or 1):
            raise BadField("best_of", f"best_of is not served: ask for n choices (best_of must equal n, got "
                           f"{self.best_of} with n {self.n or 1})")

    def top_alternatives(self) -> int | None:
        if self.logprobs is not None:
            raise BadField("logprobs", "this server returns logprobs on /v1/chat/completions (logprobs: true)")
        return None

    def question(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) > 1:
            raise BadField("prompt", f"one prompt per request, got {len(self.prompt)}")
        return self.prompt[0]


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    def texts(self) -> list[str]:
        """The texts to embed; a 400 naming `input` for token ids (this server embeds text) or empty text."""
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not texts:
            raise BadField("input", "input must hold at least one text")
        if not all(isinstance(t, str) for t in texts):
            raise BadField("input", "this server embeds text: send strings, not token ids")
        if not all(t.strip() for t in texts):
            raise BadField("input", "input must not hold an empty text")
        return texts
