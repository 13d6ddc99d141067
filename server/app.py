"""The OpenAI-compatible app over one KVRag: every request goes through its one engine (one model, one KV pool,
the memory tiers shared by all).

    GET  /v1/models             the one model this server serves
    POST /v1/chat/completions   the last user message is the question; streamed as server-sent events or not
    POST /v1/completions        the prompt is the question
    GET  /health                liveness, with the queue's length
    GET  /metrics               Prometheus text (server/metrics.py)

`create_app(rag, settings)` builds it for any ASGI server: `kvrag serve` runs it under uvicorn (server/run.py),
a benchmark or a test may run it in-process. The app never closes the KVRag it was given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvrag.api import KVRag, PromptTooLong, QueueFull
from kvrag.errors import KvragError
from kvrag.server.auth import check_key, tenant_salt
from kvrag.server.choice import Choice, GenerationFailed
from kvrag.server.errors import ApiError, error_body, install_handlers
from kvrag.server.metrics import Metrics
from kvrag.server.protocol import BadField, ChatRequest, CompletionRequest, EmbeddingRequest
from kvrag.server.responses import (
    Ids,
    assistant_message,
    embedding_response,
    sse,
    stream_chunk,
    usage_chunk,
    whole_response,
)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the id /v1/models lists and every request must name
    api_key: str | None = None  # when set, /v1/* wants `Authorization: Bearer <key>`; several: comma-separated
    max_tokens: int = 256  # a request's longest answer when it names none
    retry_after_s: int = 1  # what a 429 (full queue) tells the client to wait


def create_app(rag: KVRag, settings: ServerSettings) -> FastAPI:
    server = Server(rag, settings)
    app = FastAPI(title="kvrag", summary="OpenAI-compatible RAG over precomputed KV caches", docs_url=None,
                  redoc_url=None)
    app.state.server = server
    install_handlers(app)
    auth = [Depends(server.check_key)] if settings.api_key else []
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/models/{model_id}", server.model, methods=["GET"])
    v1.add_api_route("/chat/completions", server.chat, methods=["POST"])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    v1.add_api_route("/embeddings", server.embeddings, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    return app


class Server:
    def __init__(self, rag: KVRag, settings: ServerSettings):
        self.rag, self.settings = rag, settings
        self.metrics = Metrics(rag)
        self.started = int(time.time())
        self.runs: set[Choice] = set()  # requests in the engine, for cancel_all

    def cancel_all(self) -> None:
        """Cancel every request in the engine: each ends at once, a stream with an error event, a whole answer with
        a 503 (the end of a shutdown's grace period)."""
        for run in list(self.runs):
            run.gen.cancel()

    # ---- endpoints ------------------------------------------------------------------------------

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._model_card()

    async def chat(self, body: ChatRequest, request: Request):
        return await self._serve("chat", body, request)

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve("completions", body, request)

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        """The store's embedder, batched; its name (or the served model's) is the model asked for."""
        if body.model not in (self.rag.embedder_name, self.settings.model_name):
            raise ApiError(404, f"the model '{body.model}' does not exist; this server embeds with "
                           f"'{self.rag.embedder_name}'", param="model", code="model_not_found")
        try:
            vectors, tokens = await asyncio.to_thread(self.rag.embed, body.texts())
        except (BadField, KvragError) as exc:
            raise _refusal(exc) from None
        if body.dimensions is not None and body.dimensions != vectors.shape[1]:
            raise ApiError(400, f"dimensions: {self.rag.embedder_name} gives {vectors.shape[1]}-dimensional vectors",
                           param="dimensions")
        return embedding_response(vectors, body.model, tokens, body.encoding_format)

    async def health(self) -> dict:
        stats = self.rag.stats()
        return {"status": "ok", "model": self.settings.model_name, "waiting": stats.waiting,
                "running": stats.running, "blend": self.rag.verdict}  # the model check's: what a blend request runs

    async def metrics_text(self) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    # ---- a generation -----------------------------------------------------------------------------

    async def _serve(self, endpoint: str, body: ChatRequest | CompletionRequest, request: Request):
        salt = tenant_salt(self.settings.api_key, request.headers.get("authorization"), body.cache_salt)
        body = body.model_copy(update={"cache_salt": salt})
        runs = await self._start(endpoint, body, time.perf_counter())
        ids = Ids(endpoint, body.model)
        tools = endpoint == "chat" and body.calls_tools()
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._events(endpoint, runs, ids, usage, tools, body.answer_record),
                                     media_type="text/event-stream")
        try:
            texts = await _unless_gone(asyncio.gather(*(run.text() for run in runs)), request)
        except GenerationFailed as exc:
            raise ApiError(exc.status, str(exc)) from None
        finally:
            for run in runs:
                self._record(endpoint, run)
        whole = whole_response(ids, runs, texts, tools)
        return {**whole, "answers": [_answer_record(run) for run in runs]} if body.answer_record else whole

    async def _start(self, endpoint: str, body: ChatRequest | CompletionRequest, arrival: float) -> list[Choice]:
        """Check the request and submit its n choices (the first retrieves; the others take its chunks), every
        refusal as an ApiError (the choices already submitted are cancelled)."""
        self._check_model(body.model)
        question_field = "messages" if endpoint == "chat" else "prompt"
        runs: list[Choice] = []
        try:
            question = body.question()
            body.bias(self.rag.runtime.model.cfg.vocab_size)  # a token id the model has not: a 400, not a 500
            options = body.options(self.settings.max_tokens, lambda: self.rag.grammars)
            for i in range(body.n or 1):
                choice = _next_choice(options, runs[0], i) if i else options
                runs.append(await Choice.start(self.rag, question, choice, body.stops(), arrival))
                self.runs.add(runs[-1])
            return runs
        except BaseException as exc:
            for run in runs:
                run.gen.cancel()
                self.runs.discard(run)
            if isinstance(exc, QueueFull):
                self.metrics.requests.labels(endpoint, "rejected").inc()
            raise _refusal(exc, question_field, self.settings.retry_after_s) from None

    async def _events(self, endpoint: str, runs: list[Choice], ids: Ids, include_usage: bool, tools: bool = False,
                      record: bool = False):
        """The stream's server-sent events, the choices' pieces as they come (each chunk names its choice); a client
        that goes away cancels every choice (finally). With `tools` each choice's answer is held to its end: a call
        comes as one tool_calls delta, text as one content delta."""
        first, held = [True] * len(runs), [""] * len(runs)
        try:
            async for index, piece in _merged(runs):
                run = runs[index]
                if piece is None:  # this choice is done
                    reason = run.finish_reason
                    if tools:  # the whole answer's message, as one delta (a call's with its index)
                        delta, reason = assistant_message(held[index], reason, tools)
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [{"index": 0, **delta["tool_calls"][0]}]
                        yield sse(stream_chunk(ids, "", delta=delta, index=index, sources=run.gen.sources))
                    elif first[index]:  # an empty answer still says who speaks and from what
                        yield sse(stream_chunk(ids, "", first=True, index=index, sources=run.gen.sources))
                    extra = {"answer": _answer_record(run)} if record else {}
                    yield sse(stream_chunk(ids, "", finish_reason=reason, index=index, timings=run.timings(), **extra))
                    continue
                if tools:
                    held[index] += piece
                    continue
                extra = {"sources": run.gen.sources} if first[index] else {}
                yield sse(stream_chunk(ids, piece, first=first[index], index=index, **extra))
                first[index] = False
            if include_usage:
                yield sse(usage_chunk(ids, runs))
        except GenerationFailed as exc:
            yield sse(error_body(exc.status, str(exc)))
        finally:
            for run in runs:
                self._record(endpoint, run)
        yield sse("[DONE]")

    def _record(self, endpoint: str, run: Choice) -> None:
        self.runs.discard(run)
        outcome = "disconnected" if run.close() else run.finish_reason or run.gen.finish_reason or "error"
        self.metrics.finished(endpoint, outcome, run.gen, run.arrival)

    # ---- checks -----------------------------------------------------------------------------------

    async def check_key(self, authorization: str | None = Header(None)) -> None:
        """/v1's dependency: `Authorization: Bearer <key>`, one of the settings' comma-separated keys."""
        check_key(self.settings.api_key, authorization)

    def _check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.settings.model_name}'",
                           param="model", code="model_not_found")

    def _model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.started, "owned_by": "kvrag"}


def _answer_record(run: Choice) -> dict | None:
    """A finished choice's answer as `kvrag ask --json` records it; None for one a stop string cut (still ending)."""
    return run.gen.result().to_json() if run.gen.finish_reason in ("stop", "length") else None


def _next_choice(options: dict, first: Choice, index: int) -> dict:
    """Choice `index` of a request: the first choice's prompt, its own seed. Given chunks or passages are given
    again; retrieved ones become chunk_ids, and none at all plain chat (an empty chunk_ids would be a RAG prompt with
    no passages)."""
    seed, same = options.get("seed"), {}
    if options.get("passages") is None and options.get("chunk_ids") is None:
        same = {"rag": False} if first.gen.chunk_ids is None else {"chunk_ids": first.gen.chunk_ids}
    return {**options, **same, "seed": None if seed is None else seed + index}


def _refusal(exc: BaseException, question_field: str = "", retry_after_s: int = 1):
    """A refusal as the ApiError the client gets (any other exception as it is)."""
    if isinstance(exc, BadField):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), code="queue_full", headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), param=question_field, code="context_length_exceeded")
    if isinstance(exc, KvragError):
        return ApiError(400, str(exc))
    if isinstance(exc, RuntimeError):  # the engine has closed: the server is shutting down
        return ApiError(503, f"the server is shutting down ({exc})")
    return exc


async def _merged(runs: list[Choice]):
    """(choice index, text piece) as each choice produces them, and (index, None) when one ends; the first
    failure (GenerationFailed) is raised once the others have been stopped."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, run: Choice) -> None:
        try:
            async for piece in run.pieces():
                await queue.put((index, piece))
            await queue.put((index, None))
        except GenerationFailed as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    ended = 0
    try:
        while ended < len(runs):
            index, item = await queue.get()
            if isinstance(item, GenerationFailed):
                raise item
            ended += item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


DISCONNECT_POLL_S = 0.25  # how often a whole answer's handler checks that its client is still there


async def _unless_gone(text: Awaitable, request: Request):
    """The whole answer, unless the client goes away first: then the generation is dropped (the handler's
    `_record` cancels the sequence, and its blocks go back to the pool) and the client is told nothing."""
    task = asyncio.ensure_future(text)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise ApiError(499, "the client closed the request")
    return task.result()
