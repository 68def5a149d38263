"""kvshard as the data plane of SGLang 0.5.23's page-interleaved KV pool.

SGLang's sharded pool (``sglang/srt/mem_cache/page_interleave_pool.py``,
``PageInterleaveKVPoolMixin`` under ``PageInterleaveDSATokenToKVPool``) keeps its per-layer
tensors; ``PageInterleaveAdapter`` wraps them (and its MTP draft pool's) without a copy and runs
the pool's hot paths on kvshard's kernels and plans, on torch's current stream:

- ``set_kv_buffer(layer, loc, cache_k)``: the owned-row write of a chunk's packed latent rows
  (SGLang's ``set_kv_buffer``: its owner filter ``_get_write_plan``, ``index_select`` and the
  base pool's store), by kvshard's ``OwnedRowWrite`` from a ``ChunkStaging`` the rows are copied
  into; during a sharded extend also every row into the scratch slot's chunk region (SGLang's
  ``_scratch_kv(slot)[rows] = ...``), by a second ``OwnedRowWrite`` from the same staging.
- ``begin_shard_extend(requests)``: the batch's gather plan (SGLang's ``begin_shard_extend``:
  ``_page_pos``, ``_block_pages``, ``_send_pages``) by ``kvshard.GatherPlan`` from the pages the
  scheduler already holds on the host (no device work, no synchronization), its scratch page
  table written into ``page_pos`` in one copy; ``translate_loc_to_scratch`` as SGLang's.
- ``land(layer, slot)``: this rank's prefix pages of one layer (latent rows and indexer pages)
  into a scratch slot at their scratch pages (SGLang's send-block pack, ``index_select`` into
  ``scratch[rank * block:]``), by kvshard's block-copy ``Sender``. Into this rank's own slot it
  is the pack an all-gather then spreads; into every rank's slot (ranks of one process, or slots
  another rank mapped) it is the all-gather's landing itself.
- ``host_pool(kv_host, indexer_host)``: SGLang's HiCache host pools (``MLATokenToKVPoolHost``,
  ``DSAIndexerPoolHost``, behind ``PageInterleaveHostPool`` or not) wrapped without a copy as a
  ``kvshard.sglang.MLAHostPool`` bound to this rank's pool: ``load_to_device_per_layer``,
  ``backup_from_device_all_layer`` take SGLang's logical (host, device) token indices and move
  this rank's pages (``TransferPlan.from_slots``, SGLang's ``owned_rows``) in SGLang's host
  layouts.

The P/D connector's index preparation is ``kvshard.sglang.pd``. What stays SGLang's: the
quantization of rows (its writers hand the adapter packed rows, as they hand its pool), the DSA
indexer's own write (``store_quantized``: keys and scales in, SGLang's kernel packs them), and the
NCCL all-gather between processes. Scratch slots are the adapter's (``ScratchSlot``): SGLang's
slot tensors are views of them behind one padding page, which kvshard's spaces keep as their
page 0 (it is never written).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

import kvshard
from kvshard.sglang import MLAHostPool

PAGE = kvshard.PAGE_SIZE
INDEXER_PAGE_BYTES = kvshard.INDEXER_PAGE_BYTES

__all__ = ["PageInterleaveAdapter", "ScratchSlot"]

_LATENT_BY_ROW_BYTES = {
    576: kvshard.LatentLayout.FP8_TRTLLM,
    656: kvshard.LatentLayout.FP8_SCALED,
    1152: kvshard.LatentLayout.BF16,
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


def _one_layer(latent: "kvshard.LatentLayout", indexer: bool) -> "kvshard.CacheGeometry":
    return kvshard.CacheGeometry(kvshard.PoolGeometry(latent, indexer_layers=[indexer]))


class ScratchSlot:
    """One scratch slot of SGLang's double buffer (one layer's ``[prefix | chunk | trash]``),
    allocated by the adapter: ``kv`` (``[rows, 1, row]``) and ``index_k`` (``[rows / 64, 8448]``,
    DSA) are what SGLang's pool holds as the slot's tensors; behind them kvshard keeps one
    padding page, so scratch page ``s`` is page ``s + 1`` of the slot's kvshard spaces."""

    def __init__(self, adapter: "PageInterleaveAdapter", rows: int):
        t = _torch()
        if rows % PAGE or rows <= 0:
            raise kvshard.InvalidArgumentError(f"a scratch slot of {rows} rows: not whole pages")
        pages = rows // PAGE + 1
        device = adapter.tensor_device
        self.pages = pages
        self._kv = t.zeros((pages * PAGE, 1, adapter.row_bytes), dtype=t.uint8, device=device)
        self.kv = self._kv[PAGE:]
        dev, latent = adapter.device, adapter.latent
        one = kvshard.Placement(1)
        self._spaces: dict[bool, tuple[Any, Any]] = {}
        self._index = None
        self.index_k = None
        if adapter.dsa:
            self._index = t.zeros((pages, INDEXER_PAGE_BYTES), dtype=t.uint8, device=device)
            self.index_k = self._index[1:]
            pool = kvshard.DevicePool.wrap(dev, _one_layer(latent, True), one, 0, pages, [self._kv], [self._index])
            self._spaces[True] = (kvshard.RemoteSpace.of(pool), kvshard.PoolLayout.of(pool))
        rows_pool = kvshard.DevicePool.wrap(dev, _one_layer(latent, False), one, 0, pages, [self._kv])
        self._spaces[False] = (kvshard.RemoteSpace.of(rows_pool), kvshard.PoolLayout.of(rows_pool))
        # Every chunk row into the slot: the rows' pool under one owner (placement 1).
        self._stage = kvshard.OwnedRowWrite(adapter._staging, rows_pool)

    def space(self, indexer: bool) -> tuple[Any, Any]:
        """(RemoteSpace, PoolLayout) of the slot for a layer with or without indexer pages."""
        return self._spaces[indexer]


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
            raise kvshard.InvalidArgumentError("no latent buffers")
        first = kv_buffers[0]
        self.tensor_device = first.device
        self.device = _device_of(first)
        self.row_bytes = int(first.shape[-1]) * first.element_size()
        latent = _LATENT_BY_ROW_BYTES.get(self.row_bytes)
        if latent is None:
            raise kvshard.InvalidArgumentError(f"latent rows of {self.row_bytes} B: no kvshard latent layout")
        self.latent = latent
        if int(first.shape[0]) % PAGE:
            raise kvshard.InvalidArgumentError(f"{first.shape[0]} latent rows: not whole pages")
        self.pages = int(first.shape[0]) // PAGE
        self.placement = kvshard.Placement(shard_size)
        self.shard_rank = shard_rank
        self.shard_size = shard_size
        self.max_prefix_tokens = max_prefix_tokens
        self.chunk_tokens = chunk_tokens
        self.dsa = index_buffers is not None
        if draft_index is not None and not self.dsa:
            raise kvshard.InvalidArgumentError("a draft indexer buffer for a model without indexer")
        kv = [self._bytes(b) for b in kv_buffers]
        index = [self._bytes(b) for b in index_buffers] if index_buffers is not None else [None] * len(kv)
        if len(index) != len(kv):
            raise kvshard.InvalidArgumentError(f"{len(index)} indexer buffers for {len(kv)} layers")
        # Per layer (the draft's last): its latent tensor and its indexer tensor (None: none).
        layers = [(k, i if i is not None and i.shape[0] else None) for k, i in zip(kv, index)]
        if draft_kv is not None:
            layers.append((self._bytes(draft_kv), self._bytes(draft_index) if draft_index is not None else None))
        self.layers = layers
        self.target_layers = len(kv)

        dev, pl, rank, pages = self.device, self.placement, shard_rank, self.pages
        # The whole pool (every component, the draft's too): HiCache transfers.
        target = kvshard.PoolGeometry(latent, indexer_layers=[i is not None for _, i in layers[: len(kv)]])
        draft = None
        if draft_kv is not None:
            draft = kvshard.PoolGeometry(latent, indexer_layers=[layers[-1][1] is not None])
        self.geometry = kvshard.CacheGeometry(target, draft)
        self.pool = kvshard.DevicePool.wrap(
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
        # Per layer, one-layer views of the same tensors: its latent rows (the owned-row write)
        # and its latent rows with its indexer pages (the gather).
        rows_geometry = _one_layer(latent, False)
        self._rows = [kvshard.DevicePool.wrap(dev, rows_geometry, pl, rank, pages, [k]) for k, _ in layers]
        self._views = [
            kvshard.DevicePool.wrap(dev, _one_layer(latent, True), pl, rank, pages, [k], [i])
            if i is not None
            else self._rows[n]
            for n, (k, i) in enumerate(layers)
        ]
        self._senders = [kvshard.Sender(v) for v in self._views]
        # The chunk staging every layer's write copies its rows into (one layer's rows).
        self._staging = kvshard.ChunkStaging(self._rows[0], chunk_tokens)
        self._staged = t.from_dlpack(self._staging.layer_view(kvshard.Component.TARGET_LATENT, 0, raw=True))
        self._writes = [kvshard.OwnedRowWrite(self._staging, r) for r in self._rows]
        # SGLang's `_page_pos`: the scratch page of every logical page, trash when unplanned.
        self.trash_page = (max_prefix_tokens + chunk_tokens) // PAGE
        self.page_pos = t.full((shard_size * (pages + 1),), self.trash_page, dtype=t.int32, device=self.tensor_device)
        self.plan: Optional[kvshard.GatherPlan] = None
        self.block_pages = 0
        self._chain: list[int] = []
        self._dst: list[int] = []
        self._request = 0
        self._pending: list[Any] = []
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

    def set_kv_buffer(self, layer: int, loc: Any, cache_k: Any, slot: Optional[ScratchSlot] = None) -> None:
        """Writes a chunk's packed latent rows ``cache_k`` (``[n, 1, row]`` or ``[n, row]``, any
        dtype of the row's bytes) whose logical token slots are ``loc`` (int64; a CUDA tensor is
        read in place, keep it alive until the stream has run): the rows this rank owns into
        layer ``layer`` of its pool; with ``slot`` (a sharded extend), every row into the slot at
        its scratch row (``page_pos``)."""
        n = int(loc.shape[0])
        self._check_layer(layer)
        if n > self.chunk_tokens:
            raise kvshard.InvalidArgumentError(f"a chunk of {n} tokens for a staging of {self.chunk_tokens}")
        rows = self._bytes(cache_k).reshape(n, self.row_bytes)
        if self.device.kind == "cuda":
            # On torch's current stream, which the writes below run on too: the next layer's
            # copy is ordered after this layer's writes have read the staging.
            self._staged[:n].copy_(rows)
        else:
            # The CPU backend runs kvshard's work when something waits for it: the rows enter
            # its stream order, so a later layer's rows never overwrite ones not yet written.
            self._staging.write(kvshard.Component.TARGET_LATENT, 0, rows.contiguous().numpy().tobytes())
        loc = loc if loc.dtype == _torch().int64 else loc.long()
        self._writes[layer].run(loc, n=n)
        if slot is not None:
            # Scratch page s is page s + 1 of the slot's spaces (its padding page first).
            slot._stage.run(self.translate_loc_to_scratch(loc) + PAGE, n=n)

    # --- the gather plan and the scratch table -----------------------------------------------

    def begin_shard_extend(self, requests: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> "kvshard.GatherPlan":
        """Plans a batch: ``requests`` are ``(start_owner, prefix_pages, chunk_pages)`` (logical
        pages in chain order, as the scheduler allocated them). Writes the scratch page table
        into ``page_pos`` (one host-to-device copy on the stream) and returns the plan
        (``block``: SGLang's ``_block_pages``; ``send_list(rank)``: its ``_send_pages``). A batch
        that overflows the scratch, a page not owned along its chain's rotation or named twice
        raises before anything changes."""
        t = _torch()
        plan = kvshard.GatherPlan(
            self.placement, self.max_prefix_tokens, self.chunk_tokens, self.shard_size * self.pages, requests
        )
        entries = plan.page_table()
        table = t.tensor(entries, dtype=t.int32)
        if self.page_pos.is_cuda:
            table = table.pin_memory()
        self._poll()
        self.page_pos[: table.shape[0]].copy_(table, non_blocking=True)
        n = self.shard_size
        # The batch's prefix pages owner-major (the order of the all-gather's blocks); each
        # rank's sender lands those it owns.
        prefix = sorted({p for _, pages, _ in requests for p in pages}, key=lambda p: (p % n, p // n))
        self._chain = prefix
        self._dst = [entries[p] + 1 for p in prefix]
        self.plan = plan
        self.block_pages = plan.block
        self.shard_extend_active = True
        return plan

    def end_shard_extend(self) -> None:
        """No sharded extend in flight; collects landings that have run."""
        self.shard_extend_active = False
        self._poll()

    def translate_loc_to_scratch(self, loc: Any) -> Any:
        """Logical token slots to rows of the batch's scratch slots (SGLang's
        ``translate_loc_to_scratch``), on the device of ``loc``."""
        loc = loc.long()
        return self.page_pos[loc // PAGE].long() * PAGE + loc % PAGE

    def land(self, layer: int, slot: ScratchSlot) -> None:
        """Enqueues this rank's prefix pages of layer ``layer`` (latent rows, and indexer pages
        where the layer has them) onto their scratch pages of ``slot``."""
        self._check_layer(layer)
        if not self._chain:
            return
        has_index = self.layers[layer][1] is not None
        space, layout = slot.space(has_index)
        self._request += 1
        rid = self._request
        sender = self._senders[layer]
        sender.open(kvshard.Registration(rid, layout, self._dst, self._dst, 0), space)
        self._pending.append(sender.send(rid, self._chain, len(self._chain) * PAGE, last=True))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self.layers):
            raise kvshard.InvalidArgumentError(f"layer {layer} of a pool of {len(self.layers)} layers")

    def _poll(self) -> None:
        # A landing's chunk must be collected; one that failed raises ChunkFailedError here.
        self._pending = [c for c in self._pending if c.poll() is None]

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
    def kvshard_pool(self) -> "kvshard.DevicePool":
        """The whole pool as kvshard's ``DevicePool`` (what ``MLAHostPool``'s transfers take)."""
        return self.pool
