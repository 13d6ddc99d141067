"""The staged layer loader: each layer's stored chunks gathered into one of an engine's host slots, then (on a
device) one copy there and, fused, one load-kernel launch (issue 38's load path; load/staging.py has the slots).

A reader thread walks the layers ahead of the compute (at most `lookahead` ahead, and no further than the slots
allow): it reads a layer's values as views of LMDB's map in one read transaction, has the staging pool check,
decompress and copy them into a slot, and then
  on a device: copies the slot there in one copy on a side stream (layer i+1's copy runs under layer i's
           compute), and either launches kernels/triton_load once for the whole layer (dequantise, rotate the keys
           to their places, cast) or casts it with torch; the slot is free again once the copy is done;
  on a CPU: hands the slot to the consumer, which makes it into the layer it takes the same way (fused under
           Triton's interpreter: one copy and one launch) or by a cast, and frees the slot.
Chunks already in memory (a memory tier's) are never staged: they are copied into their rows afterwards.
A value that fails a check is never handed out: the consumer gets `CorruptChunk` naming the chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from kvrag.load.layer_work import ChunkRef, CorruptChunk, check_kept, place_rows, rotation, row_starts
from kvrag.load.staging import STORED_TORCH, LayerPlan, StagedLayer, StageFailed, StagingArea
from kvrag.model import rotary
from kvrag.store.codec import FLAG_K_PER_CHANNEL, CorruptValue, read_header, stored_positions
from kvrag.store.kv import KVTable, MissingChunk


class StagedLoader:
    """Loads layers `layers` of `chunks` through `area` (the engine's StagingArea); the interface of LayerLoader.
    `positions` [C] and `inv_freq` [hd/2] float32: the chunk rows' positions, to which keys are handed out rotated
    (fused: by the kernel; else with torch as the consumer takes them). `fused`: the Triton load kernel."""

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int], dtype: torch.dtype,
                 device: torch.device, area: StagingArea, lookahead: int = 4, delay_s: float = 0.0,
                 positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None, fused: bool = False,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.table, self.chunks, self.layers, self.area = table, list(chunks), list(layers), area
        self.dtype, self.device, self.delay_s, self.fused = dtype, device, delay_s, fused
        self.rope, self.positions, self.inv_freq = rotation(positions, inv_freq, rope, dtype, device)
        self._starts = row_starts(self.chunks)
        self._stored = [i for i, ref in enumerate(self.chunks) if ref.in_memory is None]
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._results: dict[int, tuple | BaseException] = {}
        self._lookahead = threading.Semaphore(lookahead)
        self._stop = False
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None
        if self._stream is not None:  # its work reads what the caller's stream made (rope, in-memory chunks)
            self._stream.wait_stream(torch.cuda.current_stream())
        self._plan: LayerPlan | None = None
        self._records: dict = {}  # the stored chunks' records, read with the first layer
        self._scale_chunk: torch.Tensor | None = None  # int8 per-channel K scales: each row's chunk [C]
        # ("load", layer, start, end): a layer read and staged (and sent, and loaded)
        self.spans: list[tuple[str, int, float, float]] = []
        self.bytes_read = 0
        self.copies = 0  # copies to the device: one a layer
        self.launches = 0  # load-kernel launches: one a fused layer
        self.reader_cpu_s = 0.0  # the reader thread's own CPU time: the host side's Python, GIL held or not
        self._thread = threading.Thread(target=self._run, name="kvrag-loader", daemon=True)

    def start(self) -> StagedLoader:
        self._thread.start()
        return self

    @property
    def rotated(self) -> bool:
        return self.rope is not None

    @property
    def busy_s(self) -> float:
        return sum(e - s for _, _, s, e in self.spans)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of every chunk row for layer `index`, each [C, Hkv, hd] in the model's dtype, keys rotated when
        `rotated`."""
        self._ready[index].wait()
        result = self._results.pop(index)
        self._lookahead.release()
        if isinstance(result, BaseException):
            raise result
        if result[0] == "host":  # a CPU slot: made into the layer here, which frees the slot
            result = ("done", *self._on_host(*result[1:], index))
        _, k, v, rotated = result
        if self._stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._stream)
            for x in (k, v):  # made on the side stream, used (and freed) on this one
                x.record_stream(current)
        if self.rope is not None and not rotated:
            k = rotary.rotate(k, *self.rope)
        return k, v

    def close(self) -> None:
        """Stop reading and give back every slot still held (the engine's next loader needs them)."""
        self._stop = True
        for _ in self.layers:
            self._lookahead.release()
        if self._thread.ident is not None:
            self._thread.join(timeout=30)
        for result in self._results.values():
            if isinstance(result, tuple) and result[0] == "host":
                self.area.release(result[1])
        self._results.clear()

    # ---- the reader thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        failure: BaseException | None = None
        for index, layer in enumerate(self.layers):
            self._lookahead.acquire()
            if self._stop:
                return
            if failure is None:
                try:
                    cpu, start = time.thread_time(), time.perf_counter()
                    self._results[layer] = self._load(index, layer)
                    self.spans.append(("load", layer, start, time.perf_counter()))
                    self.reader_cpu_s += time.thread_time() - cpu
                except BaseException as exc:  # handed to the consumer, which decides
                    failure = exc
            if failure is not None:
                self._results[layer] = failure
            self._ready[layer].set()

    def _load(self, index: int, layer: int) -> tuple:
        """One layer staged, then sent (device or fused) or handed over (a CPU slot)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if not self._stored:  # every chunk in memory
            k, v = self._empty_layer(self.chunks[0].in_memory.k[layer].shape[1:])
            self._copy_in_memory(k, v, layer, rotated=False)
            return ("done", k, v, False)
        slot = self.area.acquire(index)
        try:
            staged = self._stage(slot, layer)
            if self.device.type == "cpu":
                return ("host", slot, staged)
            with self._side_stream():
                return ("done", *self._send(slot, staged, layer))
        except BaseException:
            self.area.release(slot)
            raise

    def _stage(self, slot: int, layer: int) -> StagedLayer:
        values: list = [None] * len(self.chunks)
        with self._views(layer) as raws:
            for i, raw in zip(self._stored, raws, strict=True):
                if not hasattr(raw, "value"):  # MissingChunk or CorruptValue for this chunk
                    why = "missing from the store" if isinstance(raw, MissingChunk) else str(raw)
                    raise CorruptChunk(self.chunks[i].chunk_id, why)
                values[i] = raw.value
                self.bytes_read += len(raw.value)
            plan = self._plan_of(values)
            try:
                return self.area.stage(slot, plan, values, self._check)
            except StageFailed as exc:
                raise CorruptChunk(self.chunks[exc.index].chunk_id, exc.reason) from None

    def _views(self, layer: int):
        """The stored chunks' values for `layer`: views of the map (a local store), else read (a remote one)."""
        pairs = [(self.chunks[i].chunk_id, self.chunks[i].token_ids) for i in self._stored]
        if isinstance(self.table, KVTable):
            return self.table.layer_views(pairs, layer, self._records)
        out = []
        for chunk_id, ids in pairs:
            try:
                out.append(self.table.get_layer_raw(chunk_id, layer, expect_token_ids=ids))
            except (MissingChunk, CorruptValue) as exc:
                out.append(exc)
        return nullcontext(out)

    def _plan_of(self, values: list) -> LayerPlan:
        """The slot's layout, from the first stored value's header (every layer of a load has it)."""
        if self._plan is None:
            first = values[self._stored[0]]
            try:
                head = read_header(first)
            except CorruptValue as exc:
                raise CorruptChunk(self.chunks[self._stored[0]].chunk_id, str(exc)) from None
            per_channel = head.codec == "int8" and bool(head.flags & FLAG_K_PER_CHANNEL)
            self._plan = LayerPlan(head.codec, self._starts[-1], head.shape[1], head.shape[2], tuple(self._starts),
                                   per_channel)
            if per_channel:
                owner = [i for i, ref in enumerate(self.chunks) for _ in range(ref.n_rows)]
                self._scale_chunk = torch.tensor(owner, dtype=torch.int32, device=self.device)  # [C]
        return self._plan

    def _check(self, i: int, head, body) -> None:
        """A staged value must keep the tokens its chunk was laid out for (the staging checks the rest)."""
        check_kept(self.chunks[i], stored_positions(head, body))

    def _on_host(self, slot: int, staged: StagedLayer, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A CPU slot made into the layer in the consumer's thread: fused (Triton's interpreter, which is not
        thread-safe, so its launches stay in the thread that runs the model's), or cast."""
        if self.fused:
            return self._send(slot, staged, layer)
        try:
            k, v = self._dequantised(staged)
        finally:
            self.area.release(slot)
        self._copy_in_memory(k, v, layer, rotated=False)
        return k, v, False

    def _send(self, slot: int, staged: StagedLayer, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The slot to the device in one copy, then the layer in the model's dtype: one fused launch, or a cast."""
        plan = self._plan
        on_device = self.area.upload(slot, staged, plan, self.device)
        self.copies += 1
        done = torch.cuda.Event() if self._stream is not None else None
        if done is not None:
            done.record()
        self.area.release(slot, after=done.synchronize if done is not None else None)
        if not self.fused:
            k, v = self._dequantised(on_device)
            self._copy_in_memory(k, v, layer, rotated=False)
            return k, v, False
        from kvrag.kernels import triton_load  # imports Triton: only where it runs

        k, v = self._empty_layer((plan.heads, plan.head_dim))
        one_block = torch.zeros(1, dtype=torch.int32, device=self.device)
        triton_load.load_chunk(on_device.k, on_device.v, on_device.k_scale, on_device.v_scale, self.positions,
                               self.inv_freq, k[None], v[None], one_block, 0, plan.rows,
                               k_per_channel=False if plan.codec == "int8" and not plan.k_per_channel else None,
                               scale_chunk=self._scale_chunk)
        self.launches += 1
        self._copy_in_memory(k, v, layer, rotated=True)
        return k, v, True

    # ---- layers -------------------------------------------------------------------------------------------

    def _empty_layer(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.empty((self._starts[-1], *shape), dtype=self.dtype, device=self.device)  # [C, Hkv, hd]
        return k, torch.empty_like(k)

    def _dequantised(self, staged: StagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """A staged layer (on the host or the device) in the model's dtype: 16-bit values cast, int8 scaled."""
        if self._plan.codec != "int8":
            return staged.k.to(self.dtype), staged.v.to(self.dtype)
        if self._plan.k_per_channel:
            k_scale = staged.k_scale[self._scale_chunk.long().to(staged.k.device)]  # [C, Hkv, hd]
        else:
            k_scale = staged.k_scale[..., None]  # [C, Hkv, 1]
        k = staged.k.to(torch.float32) * k_scale
        v = staged.v.to(torch.float32) * staged.v_scale[..., None]
        return k.to(self.dtype), v.to(self.dtype)

    def _copy_in_memory(self, k: torch.Tensor, v: torch.Tensor, layer: int, rotated: bool) -> None:
        """The in-memory chunks into their rows of the layer, keys rotated where the layer's are."""
        for i, ref in enumerate(self.chunks):
            if ref.in_memory is not None:
                place_rows(ref, slice(self._starts[i], self._starts[i + 1]), ref.in_memory.k[layer],
                           ref.in_memory.v[layer], k, v, self.rope if rotated else None)

    def _side_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()


__all__ = ["STORED_TORCH", "StagedLoader"]
