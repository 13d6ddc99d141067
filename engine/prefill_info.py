"""What a sequence's prefill reused and how exact its rows are: the engine reports the first (usage's cached tokens,
each chunk's tier) and keeps the second with the KV it caches (engine/conversations.py)."""

from __future__ import annotations

from kvrag.engine.prefiller import Framing, Prefilled
from kvrag.engine.prompt_reuse import PROMPT_TIER
from kvrag.engine.sequence import Request, Sequence


def wants_exact(request: Request) -> bool:
    """A request whose prompt KV must be what a full prefill computes: `mode: full`, or a blend at a fixed ratio of 1.
    It reuses exact cached rows alone."""
    fixed = request.ratio.fixed
    return request.mode == "full" or (request.mode == "blend" and fixed is not None and fixed >= 1.0)


def exact_rows(seq: Sequence, chunks, config, framing: Framing | None, preamble_rows: int) -> int:
    """The leading prompt rows a prefill computes as a full prefill would: all of them where the rows it starts from
    are exact and it computes every other row in full (`mode: full`, ratio 1, or no chunks to blend), else those it
    starts from that are exact (the preamble, a conversation head)."""
    req = seq.request
    given = preamble_rows if framing is None else len(framing.head)
    exact_given = preamble_rows if framing is None else framing.exact_rows
    if exact_given < given:
        return exact_given
    computed_whole = req.mode == "full" or not chunks or (req.mode == "blend" and config.ratio >= 1.0)
    return seq.prompt_tokens if computed_whole else given


def reused_tokens(seq: Sequence, pre: Prefilled, preamble_rows: int) -> int:
    """Prompt tokens whose KV came from the store, a memory tier, a kept conversation turn or the prefix cache and was
    not recomputed: the preamble (or a conversation head's reused rows) and the chunk tokens the blend kept (a chunk
    computed now, missing or damaged in the store, counts as computed). A lower bound: a computed chunk's rows the
    blend also selected are counted once. A full prefill reuses its head's cached rows alone."""
    if seq.request.mode == "full":
        return seq.head_reused
    # a plain prompt's pieces have a tier each (a span whose chunk had no KV: computed now); prefix mode has one for
    # its first chunk alone
    tiers = zip(seq.plan.chunks, pre.chunk_tiers, strict=seq.plan.pieces is not None)
    computed = sum(len(ids) for (_, ids), tier in tiers if tier == "computed")
    kept = max(0, pre.chunk_tokens - pre.recomputed_chunk_tokens - computed)
    return (seq.head_reused if seq.plan.framed else preamble_rows) + kept


def chunk_tiers(seq: Sequence, pre: Prefilled) -> list[str]:
    """Per chunk of the request, where its KV came from; "context" for a chunk a conversation's kept turn already
    holds (not sent again)."""
    if not seq.plan.framed:
        return pre.chunk_tiers
    if seq.plan.pieces is not None:  # a plain prompt's stored spans, where each one's KV came from
        return [tier for tier in pre.chunk_tiers if tier != PROMPT_TIER]
    tiers = dict(zip((c for c, _ in seq.plan.chunks), pre.chunk_tiers, strict=False))
    return [tiers.get(c, "context") for c, _ in seq.request.chunks]
