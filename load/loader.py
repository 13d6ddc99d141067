"""The layer loaders: chunk KV read, checked, decoded and placed one layer ahead of the compute.

`open_loader` picks one. The staged loader (load/staged_loader.py: one host slot, one copy and one launch a layer)
serves a GPU, the fused load and `decode="thread"`. On a CPU otherwise, LayerLoader below decodes where the cores
allow: a reader thread reads each layer's values from LMDB ahead of the compute (the part that waits on the disk);
decoding (checksum, zstd, byte planes, the cast) is split into one item per stored chunk, which either of two
workers may claim. The compute keeps every core busy, and a thread decoding beside it at normal priority stalls the
compute's OpenMP regions whenever it takes a core (docs/design.md, "The layer loader"). So a decoder thread at idle
priority (Linux SCHED_IDLE: it runs only on a core nothing else wants) decodes ahead in the gaps between the
compute's ops ("idle"), and the consumer claims whatever items are left when it asks for the layer, spread over a
small pool (zstd and numpy release the GIL); where idle priority is unavailable, everything is decoded at hand-over
("hand-over"). A decoder that starves (other processes keep every core busy) is turned off for a while
(layer_work.DecoderPause).
The decoded buffer is left in the stored dtype and the consumer's copy casts, except for a bf16 model over fp16
values: a native pass (kernels/fp16_to_bf16.cpp) writes them as bf16 straight from the payload. Given the chunk
rows' positions (or their rotary angles, `rope`), the loader hands out keys rotated to their places in the prompt:
that native pass rotates them on the way (the same bits as torch's rotary), elsewhere the consumer rotates the
layer with torch as it takes it.
A value that fails its checksum is never handed out: the consumer gets `CorruptChunk` naming the chunk, and
recomputes it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvrag.kernels import fp16_to_bf16, triton_mode
from kvrag.load.layer_work import (
    STARVED_WAIT_S,
    ChunkRef,
    CorruptChunk,
    DecoderPause,
    LayerReader,
    LayerWork,
    check_kept,
    check_rows,
)
from kvrag.load.staged_loader import StagedLoader
from kvrag.load.staging import StagingArea, spare_cores
from kvrag.model.device import triton_available
from kvrag.store.codec import DECODED_DTYPES, FLAG_SHUFFLED, CorruptValue, stored_positions
from kvrag.store.table import KVTable, MissingChunk, RawLayer


def open_loader(table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int], dtype: torch.dtype,
                device: torch.device, *, area: StagingArea | None = None, decode: str | None = None,
                fused: bool | None = None, positions: torch.Tensor | None = None,
                inv_freq: torch.Tensor | None = None, pause: DecoderPause | None = None, native: bool = True,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The loader for this load: the staged one on a GPU, for the fused load or for decode="thread" (through
    `area`, the engine's staging slots; a fresh one if None), else a LayerLoader decoding on the CPU."""
    is_fused = wants_fused(fused, device, positions, inv_freq)
    if device.type == "cuda" or is_fused or decode == "thread":
        area = area if area is not None else StagingArea(pinned=device.type == "cuda", threads=spare_cores(device.type))
        return StagedLoader(table, chunks, layers, dtype, device, area, positions=positions, inv_freq=inv_freq,
                            fused=is_fused, rope=rope)
    return LayerLoader(table, chunks, layers, dtype, device, decode=decode, positions=positions, inv_freq=inv_freq,
                       pause=pause, native=native, rope=rope)


class LayerLoader(LayerReader):
    """Loads layers `layers` of `chunks` (concatenated in prompt order) ahead of the consumer, decoding on the CPU.

    `decode` (see the module doc): "hand-over" (the consumer decodes), "idle" (a decoder thread at idle priority
    decodes ahead, the consumer the rest); None picks "idle" where idle priority exists and `pause` (shared by an
    engine's loaders) is not on, else "hand-over". `native`: the fp16 -> bf16 pass where it is built. The rest as
    LayerReader.
    """

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int],
                 dtype: torch.dtype, device: torch.device, decode: str | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                 pause: DecoderPause | None = None, native: bool = True):
        self.pause = pause if pause is not None else DecoderPause()
        if decode is None:  # SCHED_IDLE: Linux only
            idle = hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")
            decode = "idle" if idle and not self.pause.active() else "hand-over"
        if decode not in ("hand-over", "idle") or device.type != "cpu":
            raise ValueError(f"LayerLoader decodes on the CPU, by hand-over or idle, not {decode} on {device.type} "
                             "(open_loader picks the staged loader for the others)")
        super().__init__(table, chunks, layers, dtype, device, positions, inv_freq, rope)
        self.native, self.decode = native, decode
        # spans beside "load": "decode", decoding by the consumer, and "decode-ahead", the idle-priority
        # decoder's (wall time, mostly waiting for a free core: see busy_s)
        self._pool_threads = max(1, torch.get_num_threads())
        self._pool = None if self._pool_threads == 1 else ThreadPoolExecutor(self._pool_threads - 1,
                                                                             thread_name_prefix="kvrag-decode")
        self._ahead: queue.SimpleQueue[tuple[int, LayerWork] | None] | None = None  # read layers, to decode ahead
        self._decoder = None
        self._decoder_off = False  # set when the decoder starved: the consumer decodes the rest
        if decode == "idle":
            self._ahead = queue.SimpleQueue()
            self._decoder = threading.Thread(target=self._decode_ahead, name="kvrag-decoder", daemon=True)

    def start(self) -> LayerLoader:
        super().start()
        if self._decoder is not None:
            self._decoder.start()
        return self

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of every chunk token for layer `index`, each [C, Hkv, hd]: keys rotated when `rotated`, else
        before rotary; in the stored dtype unless rotated here (the consumer casts as it copies)."""
        work = self._take(index)
        start = time.perf_counter()  # read; decoded in part or not at all
        if self._finish(work, index):
            self.spans.append(("decode", index, start, time.perf_counter()))
        return self._handed_out(work.k, work.v, work.rotates)

    def close(self) -> None:
        super().close()
        if self._ahead is not None:
            self._ahead.put(None)
        if self._decoder is not None and self._decoder.ident is not None:
            self._decoder.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _read(self, index: int, layer: int) -> LayerWork:
        work = self._work(self._fetch(layer))
        if self._ahead is not None:
            self._ahead.put((layer, work))
        return work

    def _decode_ahead(self) -> None:
        """The decoder thread: at idle priority, the items of each read layer that nobody has claimed yet."""
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            return  # at normal priority it would slow the compute: the consumer decodes everything
        while (item := self._ahead.get()) is not None:
            layer, work = item
            if self._decoder_off:
                continue
            start, cpu = time.perf_counter(), time.thread_time()
            if work.work():
                self.ahead_cpu_s += time.thread_time() - cpu
                self.spans.append(("decode-ahead", layer, start, time.perf_counter()))

    def _finish(self, work: LayerWork, layer: int) -> bool:
        """Decode the items left (over the pool, where there is one and more than one item is left), wait for
        the ones another worker is decoding, then copy the in-memory chunks in; raises the first failure.
        Whether this call decoded anything."""
        helpers = [] if self._pool is None else [self._pool.submit(work.work)
                                                 for _ in range(min(self._pool_threads - 1, work.unclaimed - 1))]
        did = work.work()
        for helper in helpers:
            did = helper.result() or did
        start = time.perf_counter()
        work.done.wait()
        if self._decoder is not None and time.perf_counter() - start > STARVED_WAIT_S:
            # the decoder waited long for a core: hand-over for the rest of this load and, for a while, in new
            # loaders that share `pause` too
            self._decoder_off = True
            self.pause.start()
        if work.error is not None:
            raise work.error
        self._copy_in_memory(work.k, work.v, layer, work.rotates)
        return did

    def _fetch(self, layer: int) -> list:
        """Per chunk: its (k, v) tensors when in memory, else its stored value read and checked against the
        chunk's record, not decoded (CorruptChunk when missing or damaged)."""
        return [(ref.in_memory.k[layer], ref.in_memory.v[layer]) if ref.in_memory is not None else self._read_raw(ref, layer)
                for ref in self.chunks]

    def _work(self, fetched: list) -> LayerWork:
        """A read layer's decoding: its buffers, and an item per stored chunk that writes that chunk's rows.

        The buffers' dtype is the stored one where every chunk has it (float32 where they differ: exact for
        fp16, bf16 and int8), the cast to the compute dtype left to the consumer's copy; bf16 for a bf16 model
        on the CPU over fp16 values, written by the native pass. Items use numpy or the native pass, never torch:
        a torch op in a pool thread would start its own OpenMP team on busy cores."""
        stored = [i for i, item in enumerate(fetched) if isinstance(item, RawLayer)]
        # (Hkv, hd): the first chunk's, which check_rows holds every other chunk to
        shape = next(tuple(item.shape[1:]) if isinstance(item, RawLayer) else tuple(item[0].shape[1:])
                     for item in fetched)
        rows = self._starts[-1]
        if self.dtype == torch.bfloat16 and self.native and fp16_to_bf16.available() and all(
                fetched[i].codec == "fp16" for i in stored):
            k_out = torch.empty((rows, *shape), dtype=torch.bfloat16)  # [C, Hkv, hd]
            v_out = torch.empty_like(k_out)
            return LayerWork(stored, k_out, v_out, lambda i: self._put_bf16(fetched, i, k_out, v_out, shape),
                             rotates=self.rope is not None)
        # the numpy dtype that holds each chunk exactly: what its codec decodes to, or its in-memory dtype
        dtypes = {DECODED_DTYPES[item.codec] if isinstance(item, RawLayer)
                  else np.dtype(np.float16 if item[0].dtype == torch.float16 else np.float32) for item in fetched}
        dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
        k_np = np.empty((rows, *shape), dtype=dtype)  # [C, Hkv, hd]
        v_np = np.empty_like(k_np)
        return LayerWork(stored, torch.from_numpy(k_np), torch.from_numpy(v_np),
                         lambda i: self._put_numpy(fetched, i, k_np, v_np, shape))

    def _put_numpy(self, fetched: list, i: int, k_out: np.ndarray, v_out: np.ndarray, shape) -> None:
        """Stored chunk i decoded into its rows of k_out, v_out [C, Hkv, hd]."""
        k, v = decoded(self.chunks[i], fetched[i])  # [T, Hkv, hd] each
        rows = self._rows(i)
        check_rows(self.chunks[i], k.shape, rows.stop - rows.start, shape)
        k_out[rows] = k
        v_out[rows] = v

    def _put_bf16(self, fetched: list, i: int, k_out: torch.Tensor, v_out: torch.Tensor, shape) -> None:
        """Stored fp16 chunk i straight to bf16 rows of k_out, v_out [C, Hkv, hd] in one native pass (instead of a
        numpy decode and a torch cast), keys rotated on the way when `rope` is given."""
        rows = self._rows(i)
        head, body = checked_body(self.chunks[i], fetched[i], rows.stop - rows.start, shape)
        planes = bool(head.flags & FLAG_SHUFFLED)
        if self.rope is None:
            fp16_to_bf16.convert(body, planes, k_out[rows], v_out[rows])
        else:
            fp16_to_bf16.convert_rotated(body, planes, k_out[rows], v_out[rows], self.rope[0][rows], self.rope[1][rows])

    def _read_raw(self, ref: ChunkRef, layer: int) -> RawLayer:
        """One chunk's stored layer, read and checked against its record; CorruptChunk when missing or damaged."""
        try:
            raw = self.table.get_layer_raw(ref.chunk_id, layer, expect_token_ids=ref.token_ids)
        except MissingChunk:
            raise CorruptChunk(ref.chunk_id, "missing from the store") from None
        except CorruptValue as exc:
            raise CorruptChunk(ref.chunk_id, str(exc)) from None
        self.bytes_read += len(raw.value)
        return raw


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


def wants_fused(fused: bool | None, device: torch.device, positions: torch.Tensor | None,
                inv_freq: torch.Tensor | None) -> bool:
    """Whether stored chunks take the fused load: only where keys are rotated here (positions given)."""
    if positions is None:
        return False
    if inv_freq is None:
        raise ValueError("positions need the model's inv_freq to rotate keys to")
    if fused is None:
        return device.type == "cuda" and triton_available()
    if fused and device.type != "cuda" and not triton_mode.interpreting():
        raise ValueError("the fused load runs on a CPU only under TRITON_INTERPRET=1 (Triton's interpreter)")
    return fused
