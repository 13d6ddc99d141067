"""One choice of a request (a request of n choices runs n sequences), as an asyncio handler reads it.

The question is submitted off the event loop (retrieval embeds and searches); then the engine's thread wakes the
loop after each token (`listener`), so no handler ever blocks a thread waiting for one, however many stream at
once. Text comes out piece by piece (`Generation.new_text`), cut at the first stop string (OpenAI's `stop`), which
the server matches itself: the engine stops on the model's own stop tokens. Everything else a response says of the
choice it reads from its `Generation` (api.py) too: the server knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import functools
from bisect import bisect_left
from collections.abc import AsyncIterator

import anyio

from kvrag.api import Generation, KVRag


class GenerationFailed(Exception):
    """The engine ended the sequence with an error (status 500), or cancelled it in a shutdown (503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Choice:
    def __init__(self, rag: KVRag, gen: Generation, ready: asyncio.Event, stops: tuple[str, ...], arrival: float):
        self.rag, self.gen, self._ready, self.arrival = rag, gen, ready, arrival
        self._stops = StopMatcher(stops)
        self.finish_reason: str | None = None  # OpenAI's: stop or length, once the text has all come

    @classmethod
    async def start(cls, rag: KVRag, question: str, options: dict, stops: tuple[str, ...], arrival: float) -> Choice:
        """Submit the question (KVRag.submit's errors propagate: KvragError, QueueFull, PromptTooLong)."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # on the engine's thread: must never raise there
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the event loop has closed: nobody reads this sequence any more

        submit = functools.partial(rag.submit, question, listener=wake, **options)
        return cls(rag, await anyio.to_thread.run_sync(submit), ready, stops, arrival)

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text as it is generated (no empty pieces). GenerationFailed if the engine ended it."""
        async for text in self._texts():
            piece, stopped = self._stops.push(text)
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
        """The whole answer as generated (unstripped: a tool call is told from text by its first character)."""
        return "".join([piece async for piece in self.pieces()])

    def close(self) -> bool:
        """Cancel the sequence if it has not finished (the client went away); True if it had to."""
        if self.finish_reason is None and self.gen.finish_reason is None:  # set before the engine's last event
            self.gen.cancel()
            return True
        return False

    async def _texts(self) -> AsyncIterator[str]:
        while True:
            self._ready.clear()  # before reading: a token put after the read sets it again
            text, last = self.gen.new_text()
            if text:
                yield text
            if last:
                return
            await self._ready.wait()

    def _engine_reason(self) -> str:
        reason = self.gen.finish_reason
        if reason in ("stop", "length"):
            return reason
        if reason == "error":
            raise GenerationFailed(self.gen.error, 500)
        raise GenerationFailed("the server is shutting down: the answer was cut off", 503)

    def timings(self) -> dict:
        """Seconds, as `kvrag ask --json` reports them: retrieval, waiting for a prefill, submission to the first
        token (the engine's TTFT), first to last token. The server's own time is the client's total less these."""
        return {name: round(value, 4) for name, value in self.gen.times().items()}

    def logprobs(self, text: str) -> dict | None:
        """OpenAI's chat `logprobs` for the tokens of the returned `text` (a token cut by a stop string counts), or
        None where none were asked for."""
        gen, tokenizer = self.gen, self.rag.runtime.tokenizer
        if gen.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            piece = tokenizer.decode([token])
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

        ids, logprobs = gen.token_ids, gen.logprobs

        def said(n: int) -> int:  # the length of the first n tokens' text: it grows with n
            return len(tokenizer.decode(ids[:n], skip_special_tokens=True).strip())

        kept = len(ids)  # a stop string cut the text: up to the token its end falls in (a bisection of few decodes)
        if said(kept) > len(text):
            kept = 1 + bisect_left(range(1, len(ids)), len(text), key=said)
        return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                             for token, (logprob, top) in zip(ids[:kept], logprobs, strict=False)]}

    def usage(self) -> dict:
        prompt, completion = self.gen.prompt_counts, len(self.gen.token_ids)
        return {"prompt_tokens": prompt["all"], "completion_tokens": completion,
                "total_tokens": prompt["all"] + completion,
                "prompt_tokens_details": {"cached_tokens": prompt["reused"],
                                          "blended_cached_tokens": prompt["blended_cached"]},
                "kvrag": self.gen.ran}  # what produced the answer: mode, ratio, rule (a blend or a full prefill)


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
