"""A request and the sequence that carries it through the engine: waiting, running, finished.

A sequence's KV lives in the engine's block pool (positions 0 .. length-1 through its block table). The token it
feeds next is the last one it generated: its KV is written by the decode step that reads it.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrag.blend.config import BlendConfig
from kvrag.blend.ratio import RatioPolicy
from kvrag.config import KV_RULE
from kvrag.engine.answer import Answer
from kvrag.engine.prompt_reuse import PromptFound
from kvrag.kvcache.allocator import BlockTable
from kvrag.model.sampling import SamplingConfig


@dataclass(frozen=True)
class Request:
    """What to prefill and how to sample: a question over chunks given as (chunk id, token ids), in prompt order."""

    question: str
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    mode: str = "blend"  # blend, full, prefix or reuse (config.MODES)
    blend: BlendConfig = field(default_factory=BlendConfig)
    ratio: RatioPolicy = field(default_factory=RatioPolicy)  # blend: auto (chosen per prompt from blend) or fixed
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sources: tuple[dict, ...] = ()  # what the caller wants back with the answer (retrieval hits)
    keep_first_logits: bool = False  # keep the prefill's next-token logits on the sequence (benchmarks' fidelity)
    # a decode-time KV budget (Keyformer): past this many rows (and a block more), the lowest-scoring are dropped
    # down to it and their blocks freed (0: none)
    kv_tokens: int = 0
    kv_rule: str = KV_RULE  # how the budget scores rows (engine/kv_budget.py): keyformer, h2o or window
    # each generated token's log-probability under the model, with this many of the most likely alternatives
    # (OpenAI's logprobs / top_logprobs); None: none are kept
    logprobs: int | None = None
    # a conversation (engine/conversations.py): the earlier turns as (role, text), system first; whether the
    # question is answered over the chunks (False: plain chat, no passages or RAG instruction); whether to keep
    # this turn's KV for a follow-up
    history: tuple[tuple[str, str], ...] = ()
    rag: bool = True
    keep_turn: bool = False
    # the answer's grammar (model/constrain.Grammar: a JSON schema, a tool call), each token chosen within it; None:
    # free text
    grammar: object | None = None
    last_role: str = "user"  # the question's role: "tool" for a tool's result (plain chat)
    # teacher forcing (benchmarks): these tokens are the answer, fed whatever the model would choose, and
    # Sequence.agreed counts the steps where its greedy choice was the forced token
    forced: tuple[int, ...] = ()
    # whose cache this request's prompt reads and adds to (a tenant: vLLM's cache_salt, or its API key): the prefix
    # cache's blocks, kept turns and the passages its prompts leave in the store; "" is the shared default
    salt: str = ""
    # a plain prompt's ids and stored spans as request_chunks.py found them: planned from, not found again (None:
    # the engine renders and probes it)
    prompt: PromptFound | None = None
    # False: the chunks are the request's own passages (salted ids): their KV is computed for it and may stay in the
    # memory tiers, but is never written to the shared store, which only the corpus and kept passages fill
    store_chunks: bool = True


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


DONE = None  # put on a sequence's event queue after its last token


class Sequence:
    def __init__(self, seq_id: int, request: Request, prompt_tokens: int, prompt_rows: int | None = None):
        self.id = seq_id
        self.request = request
        self.prompt_tokens = prompt_tokens  # preamble + chunks + question suffix
        # the prompt's rows in the pool: fewer than its tokens where reduced chunks (Keyformer) keep a subset
        self.prompt_rows = prompt_tokens if prompt_rows is None else prompt_rows
        self.status = Status.WAITING
        self.table: BlockTable | None = None  # its KV in the pool, while running
        self.length = 0  # tokens whose KV is in the pool
        self.offset = 0  # positions without KV before the newest row (dropped tokens): its position less its row
        self.attention = None  # kv_budget.AttentionScore of its rows, under a decode-time budget
        self.agreed = 0  # with request.forced: the steps whose greedy token was the forced one
        self.output: list[int] = []  # generated tokens
        # with request.logprobs: per generated token, (its log-probability, [(token, log-probability)] of the
        # request.logprobs most likely); `chosen` holds the next one until its token is kept
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.chosen: tuple[float, list[tuple[int, float]]] | None = None
        self.replay = 0  # generated tokens fed again after a recompute preemption, before new ones come
        self.finish_reason: str | None = None  # stop, length, cancelled, error
        self.error: str | None = None
        self.cancelled = False  # set by any thread; the engine finishes it at its next step
        self.passed_over = 0  # admissions that went to a later request while this one waited
        self.preemptions = 0
        self.prefill_info: dict = {}  # the first prefill's costs: Prefilled's timings, tokens, tiers
        self.plan = None  # its prompt (engine/plans.Plan), set when it is made
        self.head_rows = 0  # rows before the chunks that a KV budget never drops (the preamble, or the plan's head)
        self.head_reused = 0  # of a plan's head, the rows reused from a kept turn or head (not computed)
        self.exact_rows = 0  # the prompt's leading rows computed as a full prefill would (engine/prefill_info.py)
        self.head_exact = 0  # of a plan's head KV, the leading rows that are exact
        self.hit: list[int] = []  # prefix-cache blocks its head matched, referenced until its table takes them
        self.first_logits: torch.Tensor | None = None  # [V], with request.keep_first_logits
        self.arrival = time.perf_counter()
        self.prefill_started: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.generator = request.sampling.generator()  # its own: a sample is the same whatever runs beside it
        self.constraint = request.grammar.start() if request.grammar is not None else None  # the grammar's state
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # token ids, then DONE: for streaming readers
        self.done = threading.Event()  # set once finished, for readers that wait for the whole answer
        self.listener: Callable[[], None] | None = None  # called after each event (wakes an asyncio reader)

    def push(self, event: int | None) -> None:
        """Hand a token (or DONE) to the reader, from the engine's thread."""
        self.events.put(event)
        listener = self.listener
        if listener is not None:
            try:
                listener()
            except BaseException:
                self.listener = None  # the request ends with this error (llm_engine's _failed): no second call
                raise

    @property
    def feed_token(self) -> int:
        """The token the next decode step feeds: the last generated, or during replay the next one to re-feed."""
        return self.output[len(self.output) - self.replay - 1] if self.replay else self.output[-1]

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV was reused (stored, or in a memory tier) rather than computed: 0 until prefilled."""
        return self.prefill_info.get("reused_tokens", 0)

    @property
    def blended_cached_tokens(self) -> int:
        """Of the reused tokens, those whose KV an earlier blend made (a kept turn, a blended prompt's cached blocks):
        reused as they stood, not as a full prefill would have computed them."""
        return self.prefill_info.get("blended_cached_tokens", 0)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens whose KV was computed: recomputed by the blend, or prefilled (0 until prefilled). A reduced
        chunk's dropped tokens are neither computed nor reused."""
        return self.prompt_rows - self.reused_tokens if self.prefill_info else 0

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def times(self) -> dict[str, float]:
        """Seconds: arrival to the first token, first to last token so far, arrival to the first prefill (queued)
        ({} before the first token, or an end without one)."""
        end = self.finished_at or self.first_token_at
        first = self.first_token_at or end
        if first is None:
            return {}
        return {"ttft": first - self.arrival, "decode": end - first,
                "queued": (self.prefill_started or time.perf_counter()) - self.arrival}

    def ran(self) -> dict:
        """What produced the answer: the mode that ran (a blend the model's check failed, or one `auto` found dearer
        than a full prefill, runs `full`), the share of chunk rows it recomputed and the selection rule (a blend's)."""
        info, req = self.prefill_info, self.request
        ratio = req.ratio.report(info.get("ratio"), info.get("chunk_tokens", 0), info.get("recomputed_chunk_tokens", 0))
        return {"mode": req.mode, "ratio": ratio, "rule": req.blend.rule if req.mode == "blend" else None}

    def answer(self, tokenizer, retrieve_s: float = 0.0) -> Answer:
        """The finished sequence as `kvrag ask --json`'s record: text, tokens, sources, costs and timings."""
        info, req = self.prefill_info, self.request
        text = tokenizer.decode(self.output, skip_special_tokens=True).strip()
        times = self.times()
        rate = (len(self.output) - 1) / times["decode"] if len(self.output) > 1 and times["decode"] else 0.0
        timings = {**info.get("timings", {}), "retrieve": retrieve_s, **times, "decode_tokens_per_s": rate}
        ran = self.ran()
        return Answer(req.question, text, list(self.output), req.mode, ran["ratio"], self.prompt_tokens,
                      info.get("chunk_tokens", 0), info.get("recomputed_chunk_tokens", 0), info.get("bytes_loaded", 0),
                      timings, list(req.sources), info.get("chunk_tiers", []),
                      "interrupted" if self.finish_reason == "cancelled" else self.finish_reason, ran["rule"])

    def __repr__(self) -> str:
        return f"Sequence({self.id}, {self.status.value}, length={self.length}, out={len(self.output)})"

