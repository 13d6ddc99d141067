"""What the layer loader (load/loader.py) works on: the prompt's chunk refs, one read layer's decoding items, the
pause that turns the idle-priority decoder off when it starves, and the checks a stored layer must pass."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrag.errors import KvragError
from kvrag.model import rotary
from kvrag.model.prefill import LayerKV
from kvrag.store.codec import DECODED_DTYPES, CorruptValue, stored_positions
from kvrag.store.kv import RawLayer

# The idle-priority decoder starves when other processes keep every core busy; then a consumer waiting on a chunk
# it has begun (or on the GIL it holds) would wait for it too. A wait this long turns it off for a while.
STARVED_WAIT_S = 0.02
STARVED_PAUSE_S = 60.0


class DecoderPause:
    """Until when loaders decode at hand-over instead of at idle priority: shared by an engine's loaders, so a
    decoder that starved in one load stays off in the next ones for STARVED_PAUSE_S."""

    def __init__(self):
        self.until = 0.0  # time.monotonic()

    def start(self) -> None:
        self.until = time.monotonic() + STARVED_PAUSE_S

    def active(self) -> bool:
        return time.monotonic() < self.until


class CorruptChunk(KvragError):
    def __init__(self, chunk_id: str, reason: str):
        super().__init__(f"chunk {chunk_id[:12]}: {reason}")
        self.chunk_id = chunk_id


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of the prompt: its id and token ids, and its KV when it is already in memory. A reduced
    (Keyformer) chunk holds the rows of the tokens `kept` alone (indices into token_ids, rising; None: every token)."""

    chunk_id: str
    token_ids: Sequence[int]
    in_memory: LayerKV | None = None
    kept: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return len(self.token_ids) if self.kept is None else len(self.kept)


class LayerWork:
    """One read layer's decoding: an item per stored chunk, each done by whichever worker claims it first,
    into the layer's buffers k, v [C, Hkv, hd]."""

    def __init__(self, fetched: list, stored: list[int], k: torch.Tensor, v: torch.Tensor, put: Callable[[int], None],
                 rotates: bool = False):
        self.fetched, self.k, self.v, self.put = fetched, k, v, put
        self.rotates = rotates  # `put` writes keys rotated (and in-memory chunks are rotated as they are copied in)
        self._items = stored  # chunk indices still to claim
        self._left = len(stored)  # items not finished
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        if not stored:
            self.done.set()

    def claim(self) -> int | None:
        with self._lock:
            return self._items.pop(0) if self._items else None

    def work(self) -> bool:
        """Claim and decode items until none is left; whether this worker decoded any."""
        did = False
        while (i := self.claim()) is not None:
            did = True
            try:
                self.put(i)
            except BaseException as exc:  # handed to the consumer, which decides
                self.error = self.error or exc
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.done.set()
        return did

    @property
    def unclaimed(self) -> int:
        with self._lock:
            return len(self._items)


def check_kept(ref: ChunkRef, positions: np.ndarray | None) -> None:
    """A stored layer must hold the rows the prompt was laid out for: all of them, or the same kept tokens."""
    if positions is None and ref.kept is None:
        return
    if positions is None or ref.kept is None or not np.array_equal(positions, ref.kept):
        raise CorruptChunk(ref.chunk_id, "its stored layers do not keep the same tokens")


def check_rows(ref: ChunkRef, kv_shape, rows: int, shape) -> None:
    """A stored layer must hold one row per prompt row of its chunk, of the layer's (Hkv, hd)."""
    if kv_shape[0] != rows or tuple(kv_shape[1:]) != tuple(shape):
        raise CorruptChunk(ref.chunk_id, f"holds KV of shape {tuple(kv_shape)}, not one row per token")


def checked_body(ref: ChunkRef, raw: RawLayer, rows: int, shape):
    """A stored layer's header and checked, decompressed payload, once its kept tokens and shape hold."""
    try:
        head, body = raw.body()
    except CorruptValue as exc:
        raise CorruptChunk(ref.chunk_id, str(exc)) from None
    check_kept(ref, stored_positions(head, body))
    check_rows(ref, head.shape, rows, shape)
    return head, body


def decoded(ref: ChunkRef, raw: RawLayer) -> tuple[np.ndarray, np.ndarray]:
    """A stored layer's (k, v) decoded, as arrays [T, Hkv, hd] (views of the value when stored uncompressed)."""
    try:
        kv = raw.decode(copy=False)  # the caller copies them into the layer buffer
    except CorruptValue as exc:
        raise CorruptChunk(ref.chunk_id, str(exc)) from None
    check_kept(ref, kv.positions)
    return kv.k, kv.v


def row_starts(chunks: Sequence[ChunkRef]) -> list[int]:
    """Chunk i's rows of every layer are starts[i] .. starts[i + 1] - 1: the chunks' rows one after another."""
    starts = [0]
    for ref in chunks:
        starts.append(starts[-1] + ref.n_rows)
    return starts


def rotation(positions: torch.Tensor | None, inv_freq: torch.Tensor | None,
             rope: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype, device: torch.device):
    """A loader's (rope, positions, inv_freq): the rows' positions [C] and inv_freq [hd/2] on the device, and their
    cos, sin [C, 1, hd] in the model's dtype (as model.positions_cos_sin) unless `rope` gives them."""
    if positions is not None:
        positions, inv_freq = positions.to(device).contiguous(), inv_freq.to(device)
        if rope is None:
            rope = rotary.cos_sin(inv_freq, positions, dtype)
    return rope, positions, inv_freq


def place_rows(ref: ChunkRef, rows: slice, mk: torch.Tensor, mv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """An in-memory chunk's K, V [T, Hkv, hd] into its rows of the layer k, v; its keys rotated by rope's rows when
    the layer's are (`rope` given), else copied as they are."""
    check_rows(ref, mk.shape, rows.stop - rows.start, k.shape[1:])
    if rope is not None:
        rotary.rotate(mk.to(k.device, k.dtype), rope[0][rows], rope[1][rows], out=k[rows])
    else:
        k[rows] = mk
    v[rows] = mv


def idle_priority_available() -> bool:
    """Whether a thread can lower itself to idle priority here (Linux SCHED_IDLE)."""
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


def layer_shape(fetched: list) -> tuple[int, int]:
    """(Hkv, hd) of a layer's chunks: the first chunk's, which `check_rows` holds every other chunk to."""
    return next(tuple(item.shape[1:]) if isinstance(item, RawLayer) else tuple(item[0].shape[1:]) for item in fetched)


def array_dtype(item) -> np.dtype:
    """The numpy dtype that holds a chunk's KV exactly: what its codec decodes to, or its in-memory dtype."""
    if isinstance(item, RawLayer):
        return DECODED_DTYPES[item.codec]
    return np.dtype(np.float16 if item[0].dtype == torch.float16 else np.float32)
