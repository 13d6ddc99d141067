"""The staged layer loader: each layer's stored chunks gathered into one of an engine's host slots, then (on a
device) one copy there and, fused, one load-kernel launch (issue 38's load path; load/staging.py has the slots).

A reader thread walks the layers ahead of the compute (at most LOOKAHEAD ahead, and no further than the slots
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

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from kvrag.load.layer_work import ChunkRef, CorruptChunk, LayerReader, check_kept
from kvrag.load.staging import LayerPlan, StagedLayer, StageFailed, StagingArea
from kvrag.store.codec import FLAG_K_PER_CHANNEL, CorruptValue, read_header, stored_positions
from kvrag.store.table import KVTable, MissingChunk


class StagedLoader(LayerReader):
    """Loads layers `layers` of `chunks` through `area` (the engine's StagingArea); the interface of LayerLoader.
    Keys are rotated to `positions` by the kernel when `fused` (the Triton load kernel), else with torch as the
    consumer takes them. The rest as LayerReader."""

    def __init__(self, table: KVTable | None, chunks: Sequence[ChunkRef], layers: Sequence[int], dtype: torch.dtype,
                 device: torch.device, area: StagingArea, positions: torch.Tensor | None = None,
                 inv_freq: torch.Tensor | None = None, fused: bool = False,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(table, chunks, layers, dtype, device, positions, inv_freq, rope)
        self.area, self.fused = area, fused
        self._stored = [i for i, ref in enumerate(self.chunks) if ref.in_memory is None]
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None
        if self._stream is not None:  # its work reads what the caller's stream made (rope, in-memory chunks)
            self._stream.wait_stream(torch.cuda.current_stream())
        self._plan: LayerPlan | None = None
        self._records: dict = {}  # the stored chunks' records, read with the first layer
        self._scale_chunk: torch.Tensor | None = None  # int8 per-channel K scales: each row's chunk [C]
        self.copies = 0  # copies to the device: one a layer
        self.launches = 0  # load-kernel launches: one a fused layer

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of every chunk row for layer `index`, each [C, Hkv, hd] in the model's dtype, keys rotated when
        `rotated`."""
        result = self._take(index)
        if result[0] == "host":  # a CPU slot: made into the layer here, which frees the slot
            result = ("done", *self._on_host(*result[1:], index))
        _, k, v, rotated = result
        if self._stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._stream)
            for x in (k, v):  # made on the side stream, used (and freed) on this one
                x.record_stream(current)
        return self._handed_out(k, v, rotated)

    def close(self) -> None:
        """Stop reading and give back every slot still held (the engine's next loader needs them)."""
        super().close()
        for result in self._results.values():
            if isinstance(result, tuple) and result[0] == "host":
                self.area.release(result[1])
        self._results.clear()

    # ---- the reader thread ------------------------------------------------------------------------------

    def _read(self, index: int, layer: int) -> tuple:
        """One layer staged, then sent (device or fused) or handed over (a CPU slot)."""
        if not self._stored:  # every chunk in memory
            k, v = self._empty_layer(self.chunks[0].in_memory.k[layer].shape[1:])
            self._copy_in_memory(k, v, layer, rotated=False)
            return ("done", k, v, False)
        slot = self.area.acquire(index)
        try:
            staged = self._stage(slot, layer)
            if self.device.type == "cpu":
                return ("host", slot, staged)
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                return ("done", *self._send(slot, staged, layer))
        except BaseException:
            self.area.release(slot)
            raise

    def _stage(self, slot: int, layer: int) -> StagedLayer:
        values: list = [None] * len(self.chunks)
        pairs = [(self.chunks[i].chunk_id, self.chunks[i].token_ids) for i in self._stored]
        with self.table.layer_views(pairs, layer, self._records) as raws:  # views of the map
            for i, raw in zip(self._stored, raws, strict=True):
                if not hasattr(raw, "value"):  # MissingChunk or CorruptValue for this chunk
                    why = "missing from the store" if isinstance(raw, MissingChunk) else str(raw)
                    raise CorruptChunk(self.chunks[i].chunk_id, why)
                values[i] = raw.value
                self.bytes_read += len(raw.value)
            plan = self._plan_of(values)
            try:  # a staged value must keep the tokens its chunk was laid out for (the staging checks the rest)
                return self.area.stage(slot, plan, values, lambda i, head, body: check_kept(
                    self.chunks[i], stored_positions(head, body)))
            except StageFailed as exc:
                raise CorruptChunk(self.chunks[exc.index].chunk_id, exc.reason) from None

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

    def _on_host(self, slot: int, staged: StagedLayer, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A CPU slot made into the layer in the consumer's thread: fused (Triton's interpreter, which is not
        thread-safe, so its launches stay in the thread that runs the model's), or cast."""
        if self.fused:
            return self._send(slot, staged, layer)
        try:  # the slot goes back on return: a cast to the stored dtype itself must copy, not view it
            return self._cast(staged, layer, copy=True)
        finally:
            self.area.release(slot)

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
            return self._cast(on_device, layer)
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

    def _cast(self, staged: StagedLayer, layer: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A staged layer (on the host or the device) in the model's dtype, 16-bit values cast, int8 scaled, with
        the in-memory chunks copied in."""
        if self._plan.codec != "int8":
            k, v = staged.k.to(self.dtype, copy=copy), staged.v.to(self.dtype, copy=copy)
        else:
            if self._plan.k_per_channel:
                k_scale = staged.k_scale[self._scale_chunk.long().to(staged.k.device)]  # [C, Hkv, hd]
            else:
                k_scale = staged.k_scale[..., None]  # [C, Hkv, 1]
            k = (staged.k.to(torch.float32) * k_scale).to(self.dtype)
            v = (staged.v.to(torch.float32) * staged.v_scale[..., None]).to(self.dtype)
        self._copy_in_memory(k, v, layer, rotated=False)
        return k, v, False
