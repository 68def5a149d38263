"""kvshard as the data plane of SGLang 0.5.23's page-interleaved KV pool.

SGLang's sharded pool (``sglang/srt/mem_cache/page_interleave_pool.py``,
``PageInterleaveKVPoolMixin`` under ``PageInterleaveDSATokenToKVPool``) keeps its per-layer
tensors; ``PageInterleaveAdapter`` wraps them (and its MTP draft pool's) without a copy, once,
as one kvshard ``DevicePool`` (one memory, one usage record: every kvshard launch on it is
ordered), and runs the pool's hot paths on it with kvshard's kernels and plans, on torch's
current stream, waiting for nothing:

- ``set_kv_buffer(layer, loc, cache_k)``: the owned-row write of a chunk's packed latent rows
  (SGLang's ``set_kv_buffer``: its owner filter ``_get_write_plan``, ``index_select`` and the
  base pool's store), by kvshard's ``OwnedRowWrite`` (that layer's latent rows only) from a
  ``ChunkStaging`` the rows are copied into.
- ``begin_shard_extend(requests)``: the batch's gather plan (SGLang's ``begin_shard_extend``:
  ``_page_pos``, ``_block_pages``, ``_send_pages``) by ``kvshard.shard.GatherPlan`` from the pages the
  scheduler already holds on the host (no device work, no synchronization), its scratch page
  table written into ``page_pos`` in one copy; ``translate_loc_to_scratch`` as SGLang's.
- ``land(layer, slot)``: this rank's prefix pages of one layer (latent rows and indexer pages)
  onto their scratch pages of a slot (SGLang's send-block pack, ``index_select`` into
  ``scratch[rank * block:]``), by a ``kvshard.copy.PageCopy`` planned once per batch and slot and run
  layer by layer. Into this rank's own slot it is the pack an all-gather then spreads; into every
  rank's slot (ranks of one process, or slots mapped from peers) it is the all-gather's landing.
- ``host_pool(kv_host, indexer_host)``: SGLang's HiCache host pools (``MLATokenToKVPoolHost``,
  ``DSAIndexerPoolHost``, behind ``PageInterleaveHostPool`` or not) wrapped without a copy as a
  ``kvshard.sglang.MLAHostPool`` bound to this rank's pool: ``load_to_device_per_layer``,
  ``backup_from_device_all_layer`` take SGLang's logical (host, device) token indices and move
  this rank's pages (``TransferPlan.from_slots``, SGLang's ``owned_rows``) in SGLang's host
  layouts.

The P/D connector's index preparation is ``kvshard.sglang.pd``. What stays SGLang's: the
quantization of rows (its writers hand the adapter packed rows, as they hand its pool), the DSA
indexer's own write (``store_quantized``: keys and scales in, SGLang's kernel packs them), the
chunk's copy into the scratch slot (``_scratch_kv(slot)[rows] = ...``, a torch copy onto the
slot's views), and the NCCL all-gather between processes. Scratch slots are kvshard's memory
(``ScratchSlot``): SGLang's slot tensors are views of them behind one padding page, which
kvshard's spaces keep as their page 0 (it is never written).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

import kvshard
from kvshard.sglang import MLAHostPool

PAGE = kvshard.geometry.PAGE_SIZE
INDEXER_PAGE_BYTES = kvshard.geometry.INDEXER_PAGE_BYTES

__all__ = ["PageInterleaveAdapter", "ScratchSlot"]

_LATENT_BY_ROW_BYTES = {
    576: kvshard.geometry.LatentLayout.FP8_TRTLLM,
    656: kvshard.geometry.LatentLayout.FP8_SCALED,
    1152: kvshard.geometry.LatentLayout.BF16,
}


def _torch() -> Any:
    # Imported when an adapter is made (SGLang's pools are torch tensors), never at module import.
    return importlib.import_module("torch")


#: One kvshard device per torch device of the process: the adapters of ranks one process holds
#: (and their scratch slots) must share it to copy between each other's memory.
_DEVICES: dict[tuple[str, int], "kvshard.Device"] = {}


def _device_of(tensor: Any) -> "kvshard.Device":
    key = ("cuda", tensor.device.index or 0) if tensor.is_cuda else ("cpu", 0)
    if key not in _DEVICES:
        _DEVICES[key] = kvshard.Device.cuda(key[1]) if tensor.is_cuda else kvshard.Device.cpu()
    return _DEVICES[key]


def _one_layer(latent: "kvshard.geometry.LatentLayout", indexer: bool) -> "kvshard.geometry.CacheGeometry":
    return kvshard.geometry.CacheGeometry(kvshard.geometry.PoolGeometry(latent, indexer_layers=[indexer]))


class ScratchSlot:
    """One scratch slot of SGLang's double buffer (one layer's ``[prefix | chunk | trash]``) in
    kvshard's memory: ``kv`` (``[rows, 1, row]``) and ``index_k`` (``[rows / 64, 8448]``, DSA)
    are the views SGLang's pool holds as the slot's tensors. Behind them is one padding page, so
    scratch page ``s`` is page ``s + 1`` of the slot's kvshard space, which has the pool's
    geometry with every layer on this slot (the landing of any layer lands here)."""

    def __init__(self, adapter: "PageInterleaveAdapter", rows: int):
        t = _torch()
        if rows % PAGE or rows <= 0:
            raise kvshard.error.InvalidArgumentError(f"a scratch slot of {rows} rows: not whole pages")
        pages = rows // PAGE + 1
        self.pages = pages
        C = kvshard.geometry.Component
        self.pool = kvshard.pool.DevicePool.allocate(
            adapter.device, _one_layer(adapter.latent, adapter.dsa), kvshard.shard.Placement(1), 0, pages
        )
        latent = t.from_dlpack(self.pool.layer_view(C.TARGET_LATENT, 0, raw=True))
        self.kv = latent.view(pages * PAGE, 1, adapter.row_bytes)[PAGE:]
        self.index_k = None
        bases = {False: self.pool.block_addr(C.TARGET_LATENT, 0, 0)}
        if adapter.dsa:
            index = t.from_dlpack(self.pool.layer_view(C.TARGET_INDEXER, 0, raw=True))
            self.index_k = index.view(pages, INDEXER_PAGE_BYTES)[1:]
            bases[True] = self.pool.block_addr(C.TARGET_INDEXER, 0, 0)
        # Every stored layer of every component of the adapter's pool on this slot's memory.
        self.space = kvshard.copy.RemoteSpace.from_addresses(
            adapter.device,
            adapter.geometry,
            pages,
            [[bases[c.component.is_indexer]] * c.layers for c in adapter.geometry.components()],
            keep=self.pool,
        )


class PageInterleaveAdapter:
    """One shard rank's SGLang page-interleave pool on kvshard.

    ``PageInterleaveAdapter(kv_buffers, index_buffers, shard_rank, shard_size,
    max_prefix_tokens, chunk_tokens, *, draft_kv=None, draft_index=None)``:
    ``kv_buffers`` are SGLang's per-layer latent tensors (``kv_buffer``: ``[size + 64, 1, row]``,
    row 576, 656 or 1,152 bytes), ``index_buffers`` its per-layer indexer tensors
    (``index_k_with_scale_buffer``: ``[pages, 8448]``, 0 rows for a layer sharing another's
    top-k; None for a model without), ``draft_kv``/``draft_index`` the MTP draft pool's one layer
    (it is layer ``len(kv_buffers)`` here); the shard spec's rank, size, prefix and chunk tokens.
    ``of_pool(pool, draft_pool=None)`` reads them from SGLang's pool. Everything is enqueued on
    torch's current stream at each call (where SGLang's pool runs its own), and nothing waits.
    """

    def __init__(
        self,
        kv_buffers: Sequence[Any],
        index_buffers: Optional[Sequence[Any]],
        shard_rank: int,
        shard_size: int,
        max_prefix_tokens: int,
        chunk_tokens: int,
        *,
        draft_kv: Any = None,
        draft_index: Any = None,
    ):
        t = _torch()
        if not kv_buffers:
            raise kvshard.error.InvalidArgumentError("no latent buffers")
        first = kv_buffers[0]
        self.tensor_device = first.device
        self.device = _device_of(first)
        self.row_bytes = int(first.shape[-1]) * first.element_size()
        latent = _LATENT_BY_ROW_BYTES.get(self.row_bytes)
        if latent is None:
            raise kvshard.error.InvalidArgumentError(f"latent rows of {self.row_bytes} B: no kvshard latent layout")
        self.latent = latent
        if int(first.shape[0]) % PAGE:
            raise kvshard.error.InvalidArgumentError(f"{first.shape[0]} latent rows: not whole pages")
        self.pages = int(first.shape[0]) // PAGE
        self.placement = kvshard.shard.Placement(shard_size)
        self.shard_rank = shard_rank
        self.shard_size = shard_size
        self.max_prefix_tokens = max_prefix_tokens
        self.chunk_tokens = chunk_tokens
        self.dsa = index_buffers is not None
        if draft_index is not None and not self.dsa:
            raise kvshard.error.InvalidArgumentError("a draft indexer buffer for a model without indexer")
        kv = [self._bytes(b) for b in kv_buffers]
        index = [self._bytes(b) for b in index_buffers] if index_buffers is not None else [None] * len(kv)
        if len(index) != len(kv):
            raise kvshard.error.InvalidArgumentError(f"{len(index)} indexer buffers for {len(kv)} layers")
        # Per layer (the draft's last): its latent tensor and its indexer tensor (None: none).
        layers = [(k, i if i is not None and i.shape[0] else None) for k, i in zip(kv, index)]
        if draft_kv is not None:
            layers.append((self._bytes(draft_kv), self._bytes(draft_index) if draft_index is not None else None))
        self.layers = layers
        self.target_layers = len(kv)

        dev, pl, rank, pages = self.device, self.placement, shard_rank, self.pages
        # The one kvshard pool over SGLang's tensors (every layer and component, the draft's
        # too): each memory wrapped once, so every kvshard launch on it is ordered by its one
        # usage record. Writes, landings and HiCache transfers all run on it.
        target = kvshard.geometry.PoolGeometry(latent, indexer_layers=[i is not None for _, i in layers[: len(kv)]])
        draft = None
        if draft_kv is not None:
            draft = kvshard.geometry.PoolGeometry(latent, indexer_layers=[layers[-1][1] is not None])
        self.geometry = kvshard.geometry.CacheGeometry(target, draft)
        self.pool = kvshard.pool.DevicePool.wrap(
            dev,
            self.geometry,
            pl,
            rank,
            pages,
            [k for k, _ in layers[: len(kv)]],
            [i for _, i in layers[: len(kv)] if i is not None] or None,
            [layers[-1][0]] if draft_kv is not None else None,
            [layers[-1][1]] if draft_kv is not None and layers[-1][1] is not None else None,
        )
        # The chunk staging (shaped like the pool: every layer's rows) and per layer the write
        # of its latent rows only (SGLang writes the indexer keys with its own kernel).
        C = kvshard.geometry.Component
        self._staging = kvshard.pool.ChunkStaging(self.pool, chunk_tokens)
        self._latent = [(C.TARGET_LATENT, n) for n in range(len(kv))] + ([(C.DRAFT_LATENT, 0)] if draft_kv is not None else [])
        self._staged = [t.from_dlpack(self._staging.layer_view(c, n, raw=True)) for c, n in self._latent]
        self._writes = [
            kvshard.pool.OwnedRowWrite(self._staging, self.pool, layers=[m], components=[c])
            for m, (c, _) in enumerate(self._latent)
        ]
        # SGLang's `_page_pos`: the scratch page of every logical page, trash when unplanned.
        self.trash_page = (max_prefix_tokens + chunk_tokens) // PAGE
        self.page_pos = t.full((shard_size * (pages + 1),), self.trash_page, dtype=t.int32, device=self.tensor_device)
        self.plan: Optional[kvshard.shard.GatherPlan] = None
        self.block_pages = 0
        # This rank's prefix pages of the batch (local pages) and their slot pages; the landing
        # copy of each slot, made at its first landing of the batch.
        self._land: tuple[list[int], list[int]] = ([], [])
        self._copies: dict[int, tuple[ScratchSlot, kvshard.copy.PageCopy]] = {}
        self.shard_extend_active = False

    @classmethod
    def of_pool(cls, pool: Any, draft_pool: Any = None) -> "PageInterleaveAdapter":
        """The adapter of SGLang's ``PageInterleave*TokenToKVPool`` ``pool`` (its ``kv_buffer``,
        ``index_k_with_scale_buffer`` when DSA, and ``shard_spec``) and its MTP draft pool's."""
        spec = pool.shard_spec
        index = getattr(pool, "index_k_with_scale_buffer", None)
        draft_kv = draft_pool.kv_buffer[0] if draft_pool is not None else None
        draft_index = getattr(draft_pool, "index_k_with_scale_buffer", None) if draft_pool is not None else None
        return cls(
            pool.kv_buffer,
            index,
            spec.shard_rank,
            spec.shard_size,
            spec.max_prefix_tokens,
            spec.chunk_tokens,
            draft_kv=draft_kv,
            draft_index=draft_index[0] if draft_index else None,
        )

    @staticmethod
    def _bytes(tensor: Any) -> Any:
        """The tensor's bytes (FP8 and bf16 tensors as uint8, the same memory)."""
        t = _torch()
        return tensor if tensor.dtype == t.uint8 else tensor.view(t.uint8)

    # --- the owned-row write -----------------------------------------------------------------

    def set_kv_buffer(self, layer: int, loc: Any, cache_k: Any) -> None:
        """Writes a chunk's packed latent rows ``cache_k`` (``[n, 1, row]`` or ``[n, row]``, any
        dtype of the row's bytes) whose logical token slots are ``loc`` (int64; a CUDA tensor is
        read in place, keep it alive until the stream has run): the rows this rank owns, into
        layer ``layer`` of its pool (the draft's is the last)."""
        n = int(loc.shape[0])
        self._check_layer(layer)
        if n > self.chunk_tokens:
            raise kvshard.error.InvalidArgumentError(f"a chunk of {n} tokens for a staging of {self.chunk_tokens}")
        rows = self._bytes(cache_k).reshape(n, self.row_bytes)
        if self.device.kind == "cuda":
            # On torch's current stream, which the write below runs on too: the next chunk's
            # copy is ordered after this write has read the staging.
            self._staged[layer][:n].copy_(rows)
        else:
            # The CPU backend runs kvshard's work when something waits for it: the rows enter
            # its stream order, so later rows never overwrite ones not yet written.
            component, stored = self._latent[layer]
            self._staging.write(component, stored, rows.contiguous().numpy().tobytes())
        loc = loc if loc.dtype == _torch().int64 else loc.long()
        self._writes[layer].run(loc, n=n)

    # --- the gather plan and the scratch table -----------------------------------------------

    def begin_shard_extend(self, requests: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> "kvshard.shard.GatherPlan":
        """Plans a batch: ``requests`` are ``(start_owner, prefix_pages, chunk_pages)`` (logical
        pages in chain order, as the scheduler allocated them). Writes the scratch page table
        into ``page_pos`` (one host-to-device copy on the stream) and returns the plan
        (``block``: SGLang's ``_block_pages``; ``send_list(rank)``: its ``_send_pages``). A batch
        that overflows the scratch, a page not owned along its chain's rotation or named twice
        raises before anything changes."""
        t = _torch()
        plan = kvshard.shard.GatherPlan(
            self.placement, self.max_prefix_tokens, self.chunk_tokens, self.shard_size * self.pages, requests
        )
        entries = plan.page_table()
        table = t.tensor(entries, dtype=t.int32)
        if self.page_pos.is_cuda:
            table = table.pin_memory()
        self.page_pos[: table.shape[0]].copy_(table, non_blocking=True)
        n, rank = self.shard_size, self.shard_rank
        # This rank's prefix pages (a page shared by requests once), owner-major order as the
        # all-gather's blocks: local page, and slot page (scratch page + the padding page).
        mine = sorted({p for _, pages, _ in requests for p in pages if p % n == rank})
        self._land = ([p // n for p in mine], [entries[p] + 1 for p in mine])
        self._copies = {}
        self.plan = plan
        self.block_pages = plan.block
        self.shard_extend_active = True
        return plan

    def end_shard_extend(self) -> None:
        """No sharded extend in flight."""
        self.shard_extend_active = False
        self._copies = {}

    def translate_loc_to_scratch(self, loc: Any) -> Any:
        """Logical token slots to rows of the batch's scratch slots (SGLang's
        ``translate_loc_to_scratch``), on the device of ``loc``."""
        loc = loc.long()
        return self.page_pos[loc // PAGE].long() * PAGE + loc % PAGE

    def land(self, layer: int, slot: ScratchSlot) -> None:
        """Enqueues this rank's prefix pages of layer ``layer`` (latent rows, and indexer pages
        where the layer has them) onto their scratch pages of ``slot``."""
        self._check_layer(layer)
        local, dst = self._land
        if not local:
            return
        kept = self._copies.get(id(slot))
        if kept is None:
            # Planned and uploaded once per batch and slot, on torch's current stream.
            kept = (slot, kvshard.copy.PageCopy(self.pool, local, slot.space, dst))
            self._copies[id(slot)] = kept
        kept[1].run_layer(layer)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.layers):
            raise kvshard.error.InvalidArgumentError(f"layer {layer} of a pool of {len(self.layers)} layers")

    def scratch_slot(self, rows: Optional[int] = None) -> ScratchSlot:
        """A scratch slot of ``rows`` rows (default: prefix + chunk + the trash page)."""
        return ScratchSlot(self, rows or self.max_prefix_tokens + self.chunk_tokens + PAGE)

    # --- HiCache host transfers ----------------------------------------------------------------

    def host_pool(self, kv_host: Any, indexer_host: Any = None, io_backend: Optional[str] = None) -> MLAHostPool:
        """SGLang's host pools (``MLATokenToKVPoolHost`` and, DSA, ``DSAIndexerPoolHost``; or
        ``PageInterleaveHostPool`` over the former) as a ``kvshard.sglang.MLAHostPool`` over
        their buffers, no copy; its transfers take ``self.pool`` as ``device_pool`` (or pass
        this adapter: it carries ``kvshard_pool``)."""
        from kvshard.sglang_storage import adopt_sglang_pools

        native = getattr(kv_host, "host_pool", kv_host)
        host = adopt_sglang_pools(native, indexer_host, self.device)
        if io_backend is not None:
            host.io_backend = io_backend
        return host

    @property
    def kvshard_pool(self) -> "kvshard.pool.DevicePool":
        """The whole pool as kvshard's ``DevicePool`` (what ``MLAHostPool``'s transfers take)."""
        return self.pool
