"""Response bodies in OpenAI's shapes: chat completions and text completions, whole or as stream chunks.

Each carries kvrag's `sources` (extra field: the chunks the answer was given, with the tier their KV came from),
`timings` (extra field: retrieval, queue, the engine's TTFT and decode, in seconds; a stream's last chunk), and `usage` with `prompt_tokens_details.cached_tokens`: prompt tokens whose KV was reused rather than computed.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid

import numpy as np

from kvrag.server.choice import Choice


class Ids:
    """One response's id, creation time and endpoint (chat or completions), the same on every chunk of a stream."""

    def __init__(self, endpoint: str, model: str):
        self.chat, self.created, self.model = endpoint == "chat", int(time.time()), model
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def head(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def whole_response(ids: Ids, runs: list[Choice], texts: list[str], tools: bool = False) -> dict:
    """Either endpoint's whole answer, `texts` as generated (unstripped); with `tools`, a chat answer that is a call
    comes back as tool_calls."""
    choices = []
    for i, (run, text) in enumerate(zip(runs, texts, strict=True)):
        if ids.chat:
            message, reason = assistant_message(text, run.finish_reason, tools)
            choices.append({"index": i, "message": message, "logprobs": run.logprobs(text.strip()),
                            "finish_reason": reason})
        else:
            choices.append({"index": i, "text": text.strip(), "finish_reason": run.finish_reason, "logprobs": None})
    return {**ids.head(), "choices": choices, "usage": usage(runs), "sources": runs[0].gen.sources,
            "timings": runs[0].timings()}


def stream_chunk(ids: Ids, piece: str, *, first: bool = False, finish_reason: str | None = None, index: int = 0,
                 delta: dict | None = None, **extra) -> dict:
    """A stream's chunk of either endpoint: the first says the role (chat), the last has no text but the reason; a
    chat chunk may be given its whole `delta` instead."""
    if not ids.chat:
        choice = {"text": piece}
    elif delta is not None:
        choice = {"delta": delta}
    else:
        choice = {"delta": {} if finish_reason else {"role": "assistant", "content": piece} if first else
                  {"content": piece}}
    return {**ids.head(chunk=True), "choices": [{"index": index, **choice, "finish_reason": finish_reason,
                                                  "logprobs": None}], **extra}


def usage(runs: list[Choice]) -> dict:
    """One prompt (the first choice's), every choice's completion tokens."""
    first = runs[0].usage()
    completion_tokens = sum(run.usage()["completion_tokens"] for run in runs)
    return {**first, "completion_tokens": completion_tokens,
            "total_tokens": first["prompt_tokens"] + completion_tokens}


def usage_chunk(ids: Ids, runs: list[Choice]) -> dict:
    """stream_options.include_usage's last chunk: no choices, the usage."""
    return {**ids.head(chunk=True), "choices": [], "usage": usage(runs)}


# a call as model/constrain.tool_call's grammar writes it, up to its arguments: {"name": "<name>", "arguments": {...}}
CALL_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def assistant_message(text: str, finish_reason: str, tools: bool) -> tuple[dict, str]:
    """A chat answer (as generated) as OpenAI's assistant message, with its choice's finish reason. With `tools`,
    an answer that opens with "{" is a call (the grammar opens text with any other character): whole, it is the
    message's tool_calls (finish_reason tool_calls); cut short (max_tokens), it is what OpenAI returns for a cut
    call: the call as far as it got (once its name is whole), never content, and the reason that cut it."""
    if not (tools and text.startswith("{")):
        return {"role": "assistant", "content": text.strip()}, finish_reason
    head = CALL_HEAD.match(text)
    if head is None:  # cut before its name was whole: no call to show
        return {"role": "assistant", "content": None}, finish_reason
    try:
        json.loads(text)
        whole, arguments = True, text.rstrip()[head.end():-1]  # less the call's closing brace
    except json.JSONDecodeError:
        whole, arguments = False, text[head.end():]
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": json.loads(head.group(1)), "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls" if whole else finish_reason


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` (or the closing `data: [DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def embedding_response(vectors: np.ndarray, model: str, tokens: int, encoding: str) -> dict:
    """vectors [N, D] float32 as OpenAI's list of embeddings, in input order; base64 (what the `openai` client asks
    for unless told otherwise): each vector's little-endian float32 bytes."""
    def one(v: np.ndarray):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()

    return {"object": "list", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"object": "embedding", "index": i, "embedding": one(v)} for i, v in enumerate(vectors)]}
