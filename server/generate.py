"""One request's run through the engine, as an asyncio handler sees it.

The question is submitted off the event loop (retrieval embeds and searches); then the engine's thread wakes the
loop after each token (`listener`), so no handler ever blocks a thread waiting for one, however many stream at
once. Text comes out piece by piece, incomplete UTF-8 held back, and cut at the first stop string (OpenAI's
`stop`), which the server matches itself: the engine stops on the model's own stop tokens.
"""

from __future__ import annotations

import asyncio
import functools
import queue
from collections.abc import AsyncIterator

import anyio

from kvrag.api import DONE, Generation, KVRag


class GenerationFailed(Exception):
    """The engine ended the sequence with an error (status 500), or cancelled it in a shutdown (503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Run:
    def __init__(self, rag: KVRag, gen: Generation, ready: asyncio.Event, stops: tuple[str, ...], arrival: float):
        self.rag, self.gen, self._ready, self.arrival = rag, gen, ready, arrival
        self._stops = StopMatcher(stops)
        self.finish_reason: str | None = None  # OpenAI's: stop or length, once the text has all come

    @classmethod
    async def start(cls, rag: KVRag, question: str, options: dict, stops: tuple[str, ...], arrival: float) -> Run:
        """Submit the question (KVRag.submit's errors propagate: KvragError, QueueFull, PromptTooLong)."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # on the engine's thread: must never raise there
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the event loop has closed: nobody reads this sequence any more

        submit = functools.partial(rag.submit, question, listener=wake, **options)
        return cls(rag, await anyio.to_thread.run_sync(submit), ready, stops, arrival)

    @property
    def seq(self):
        return self.gen.seq

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text as it is generated (no empty pieces). GenerationFailed if the engine ended it."""
        detokenizer = Detokenizer(self.rag.runtime.tokenizer)
        async for token in self._tokens():
            piece, stopped = self._stops.push(detokenizer.push(token))
            if piece:
                yield piece
            if stopped:
                self.gen.cancel()  # the rest is not wanted: its blocks go back at the engine's next step
                self.finish_reason = "stop"
                return
        if tail := self._stops.flush():
            yield tail
        self.finish_reason = self._engine_reason()

    async def text(self) -> str:
        """The whole answer, stripped as KVRag.ask's `text` is."""
        return "".join([piece async for piece in self.pieces()]).strip()

    def close(self) -> bool:
        """Cancel the sequence if it has not finished (the client went away); True if it had to."""
        if self.finish_reason is None and self.seq.finish_reason is None:  # set before the engine's last event
            self.gen.cancel()
            return True
        return False

    async def _tokens(self) -> AsyncIterator[int]:
        events = self.seq.events
        while True:
            self._ready.clear()  # before draining: a token put after the drain sets it again
            while True:
                try:
                    token = events.get_nowait()
                except queue.Empty:
                    break
                if token is DONE:
                    return
                yield token
            await self._ready.wait()

    def _engine_reason(self) -> str:
        reason = self.seq.finish_reason
        if reason in ("stop", "length"):
            return reason
        if reason == "error":
            raise GenerationFailed(self.seq.error or "the request failed", 500)
        raise GenerationFailed("the server is shutting down: the answer was cut off", 503)

    def sources(self) -> list[dict]:
        """The chunks the answer was given, each with where its KV came from (tier) once prefilled."""
        tiers = self.seq.prefill_info.get("chunk_tiers", [])
        return [{**source, "tier": tiers[i] if i < len(tiers) else None}
                for i, source in enumerate(self.seq.request.sources)]

    def timings(self) -> dict:
        """Seconds, as `kvrag ask --json` reports them: retrieval, waiting for a prefill, submission to the first
        token (the engine's TTFT), first to last token. The server's own time is the client's total less these."""
        times = {"retrieve": self.gen.retrieve_s, **self.seq.times()}
        return {name: round(value, 4) for name, value in times.items()}

    def logprobs(self, text: str) -> dict | None:
        """OpenAI's chat `logprobs` for the tokens of the returned `text` (a token cut by a stop string counts), or
        None where none were asked for."""
        seq, tokenizer = self.seq, self.rag.runtime.tokenizer
        if seq.request.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            piece = tokenizer.decode([token])
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

        whole = len(tokenizer.decode(seq.output, skip_special_tokens=True).strip()) <= len(text)
        content = []
        for i, (logprob, top) in enumerate(seq.logprobs):
            if not whole and i and len(tokenizer.decode(seq.output[:i], skip_special_tokens=True).strip()) >= len(text):
                break  # a stop string cut the text: the tokens after its end
            content.append({**entry(seq.output[i], logprob), "top_logprobs": [entry(t, lp) for t, lp in top]})
        return {"content": content}

    def usage(self) -> dict:
        seq = self.seq
        return {"prompt_tokens": seq.prompt_tokens, "completion_tokens": len(seq.output),
                "total_tokens": seq.prompt_tokens + len(seq.output),
                "prompt_tokens_details": {"cached_tokens": seq.reused_tokens,
                                          "blended_cached_tokens": seq.blended_cached_tokens}}


class Detokenizer:
    """Token ids to text pieces in constant time a token: each new piece is the text of a few tokens before it
    and the new ones, less the text of those few alone (as vLLM does), so a tokenizer that spells a word's
    leading space from its context spells it as a whole decode would. Incomplete UTF-8 is held back."""

    def __init__(self, tokenizer, context: int = 6):
        self.tokenizer, self.context = tokenizer, context
        self.ids: list[int] = []
        self.start = 0  # the first token of the context decoded before the new ones
        self.done = 0  # tokens whose text has been handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.start:self.done], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[self.start:], skip_special_tokens=True)
        if text.endswith("\ufffd") or len(text) <= len(before):  # a multi-byte character still incomplete
            return ""
        self.start, self.done = max(self.start, len(self.ids) - self.context), len(self.ids)
        return text[len(before):]


class StopMatcher:
    """Cuts text at the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was met)."""
        text = self.held + piece
        found = [at for at in (text.find(s) for s in self.stops) if at >= 0]
        if found:
            self.held = ""
            return text[:min(found)], True
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
