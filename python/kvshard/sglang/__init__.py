"""SGLang's HiCache host pool interface on kvshard.

``MLAHostPool`` offers the method names and argument order of SGLang's MLA host KV pool
(sglang 0.5.x, ``mem_cache/pool_host/mla.py`` and ``base.py``), and ``MLAHostPool.indexer`` a
companion with those of its DSA indexer host pool (``pool_host/dsa.py``), both backed by one
kvshard ``HostPool`` in SGLang's byte layout, so an SGLang HiCache controller and its storage
backends can use them in place of SGLang's own:

- transfers: ``load_to_device_per_layer``, ``backup_from_device_all_layer``,
  ``prepare_transfer_indices`` and the ``*_physical`` variants, with int64 per-token indices
  and ``io_backend`` ``"kernel"`` (kvshard's SM block-copy kernel) or ``"direct"`` (kvshard's
  coalesced copy-engine copies), with SGLang's corrections (``page_first_direct`` + ``kernel``
  runs as ``direct``; ``page_first`` + ``direct`` becomes ``page_first_direct`` at
  construction); ``load_all_layers`` runs SGLang's per-layer loop and calls
  ``on_layer_done(layer_id)`` after each layer;
- storage-backend page access on host memory: ``get_data_page(index, flat=True)``,
  ``set_from_flat_data_page``, ``get_dummy_flat_data_page``, ``get_page_buffer_meta`` (host
  pointers), ``is_stride_page_aligned``, ``get_contiguous_buf_infos``;
- the host allocator: ``alloc``, ``free``, ``available_size``, ``clear`` (page 0, the padding
  page, is never handed out).

Byte layout (docs/sglang.md, "SGLang byte compatibility"): ``layer_first``, ``page_first`` and
``page_first_direct``, the MTP draft packed as the tail layer of the target's host buffers
(``packed_draft=True``, SGLang's default NextN mode) or in buffers of its own (the "sidecar"
mode, ``packed_draft=False``), the indexer buffer one page longer than the latent one.

Differences from SGLang's classes, by design:

- One call moves every component of its layers: the MLA pool's transfers move the latent
  rows *and* the indexer blocks (kvshard's transfers are whole-cache), so the indexer
  companion's transfer methods do nothing; and the MTP draft loads with target layer 0 (its
  readiness group), so a ``load_to_device_per_layer(..., is_draft=True)`` call does nothing
  either. The bytes that land are the same as SGLang's two pools' calls together.
- Host page 0 is the padding page: transfers refuse it (SGLang's unsharded allocator hands out
  slot 0; use this class's ``alloc``, which does not).
- Indices are planned on the host: device (CUDA) index tensors are copied to the host first,
  which waits for the current stream (SGLang's ``direct`` backend does the same).
- Transfers enqueue on the current torch stream when torch is in use (``stream=`` overrides),
  and never synchronize.
- SGLang's names stay names here (``layout="page_first"``, ``io_backend="kernel"``: what
  SGLang's server arguments hold); they become kvshard's enums (``kvshard.pool.HostLayout``,
  ``kvshard.copy.Method``) where this module calls kvshard.
"""

from __future__ import annotations

import operator
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

import kvshard

PAGE_SIZE = kvshard.geometry.PAGE_SIZE

__all__ = ["MLAHostPool", "DSAIndexerHostPool", "resolve_layout_io"]


def resolve_layout_io(layout: str, io_backend: str) -> tuple[str, str]:
    """SGLang's automatic corrections between host layout and I/O backend (its
    ``resolve_layout_io_compatibility``): ``page_first_direct`` with ``kernel`` switches the I/O
    backend to ``direct``; ``page_first`` with ``direct`` switches the layout to
    ``page_first_direct``. Returns the corrected ``(layout, io_backend)``, warning as SGLang does.
    """
    if layout == "page_first_direct" and io_backend == "kernel":
        warnings.warn(
            "Kernel io backend does not support page first direct layout, switching to direct io backend",
            stacklevel=2,
        )
        return layout, "direct"
    if layout == "page_first" and io_backend == "direct":
        warnings.warn(
            "Page first layout is not supported with direct IO backend, switching to page first direct layout",
            stacklevel=2,
        )
        return "page_first_direct", io_backend
    return layout, io_backend


def _torch():
    """torch, when the process already uses it (never imported here)."""
    return sys.modules.get("torch")


class _Arrays:
    """Tensors of the engine's kind: torch when the pool is on a GPU and torch is loaded,
    NumPy otherwise."""

    def __init__(self, use_torch: bool):
        self.torch = _torch() if use_torch else None
        if self.torch is None:
            import numpy

            # Typed as a value: mypy (and stubtest) would take a module alias for a class member.
            self.np: Any = numpy

    def of(self, host, index):
        """Host buffer `index` of `host` as a tensor (raw bytes for NumPy: no bfloat16)."""
        if self.torch is not None:
            return self.torch.from_dlpack(host.buffer_view(index))
        return self.np.from_dlpack(host.buffer_view(index, raw=True))

    def flat(self, t):
        # torch's flatten and NumPy's reshape(-1) both view when they can, copy otherwise.
        return t.flatten() if self.torch is not None else t.reshape(-1)

    def zeros(self, shape, like):
        if self.torch is not None:
            return self.torch.zeros(shape, dtype=like.dtype, device="cpu").flatten()
        return self.np.zeros(shape, dtype=like.dtype).reshape(-1)

    def int64(self, values):
        if self.torch is not None:
            return self.torch.tensor(values, dtype=self.torch.int64)
        return self.np.asarray(values, dtype=self.np.int64)

    def tolist(self, t) -> list:
        return [operator.index(v) for v in t.tolist()]


def _host_indices(indices):
    """Index values on the host (a CUDA tensor is copied, which waits for its stream)."""
    if getattr(indices, "is_cuda", False):
        indices = indices.cpu()
    return indices


class _Transfers:
    """Prepared kvshard transfers, by the identity of the index objects they were made for
    (SGLang hands the same objects from ``prepare_transfer_indices`` to the ``*_physical``
    calls). A few are kept; the objects are held so identities are not reused."""

    KEEP = 8

    def __init__(self) -> None:
        self.entries: list[tuple[tuple, tuple, Any]] = []

    def get(self, key):
        for k, _, t in self.entries:
            if k == key:
                return t
        return None

    def put(self, key, objects, transfer):
        self.entries.append((key, objects, transfer))
        del self.entries[: -self.KEEP]


class MLAHostPool:
    """SGLang's MLA host KV pool (sglang 0.5.x), backed by a kvshard ``HostPool`` in SGLang's
    byte layout.

    ``MLAHostPool(device, geometry, page_num, layout="page_first", io_backend="kernel",
    packed_draft=True)`` allocates the host pool (pinned on a GPU); ``buffers=[kv, indexer]``
    wraps the engine's own host tensors instead (on a GPU: already registered with
    ``cudaHostRegister``, as SGLang registers them): SGLang's ``kv_buffer`` and indexer host
    buffer (packed draft), or those and the sidecar draft's two. ``page_num`` counts the padding
    page (SGLang: ``size // page_size + 1``). ``ctas``: CTAs of the ``kernel`` I/O backend.
    ``stream`` (default: torch's current stream on a GPU) is where transfers are enqueued;
    ``tables_stream`` where kernel tables are uploaded (a stream of its own by default).

    With the sidecar draft (``packed_draft=False``) ``kv_buffer`` holds the target's layers and
    ``draft_buffer`` the draft's (SGLang's separate draft host pool).
    """

    def __init__(
        self,
        device: "kvshard.Device",
        geometry: "kvshard.geometry.CacheGeometry",
        page_num: int,
        layout: str = "page_first",
        io_backend: str = "kernel",
        *,
        packed_draft: bool = True,
        buffers: Optional[Sequence[Any]] = None,
        ctas: int = 2,
        stream: Any = None,
        tables_stream: Any = None,
    ):
        layout, io_backend = resolve_layout_io(layout, io_backend)
        self.io_backend = io_backend
        self.layout = layout
        self.page_size = PAGE_SIZE
        self.page_num = page_num
        self.size = page_num * PAGE_SIZE
        self.device = "cpu"
        self.pin_memory = device.kind == "cuda"
        self.kvshard_device = device
        self.ctas = ctas
        # None is resolved by kvshard at every transfer: torch's current stream on a GPU when
        # torch is in use (as SGLang's own transfers run), the default stream otherwise.
        self.stream = stream
        self._tables = tables_stream if tables_stream is not None else device.new_stream()
        self.geometry = geometry
        # SGLang names its layouts; kvshard's API takes the enum of the name.
        host_layout = kvshard.pool.HostLayout.from_name(layout)
        if buffers is None:
            self.host = kvshard.pool.HostPool(
                device, geometry, page_num, host_layout, sglang=True, packed_draft=packed_draft
            )
        else:
            self.host = kvshard.pool.HostPool.wrap(
                device, geometry, page_num, list(buffers), host_layout, sglang=True, packed_draft=packed_draft
            )
        self._arrays = _Arrays(device.kind == "cuda")
        self._transfers = _Transfers()
        self._warned: set[str] = set()
        layouts = self.host.buffer_layouts()
        self._latent = 0
        self._indexer = next((i for i, b in enumerate(layouts) if b.is_indexer), None)
        latent = layouts[self._latent]
        self.target_layer_num = geometry.target.num_layers
        self.layer_num = latent.layers
        self.kv_buffer = self._arrays.of(self.host, self._latent)
        self.dtype = self.kv_buffer.dtype
        self.kv_cache_dim = int(self.kv_buffer.shape[-1])
        self.token_stride_size = latent.row_bytes
        self.layout_dim = self.token_stride_size * self.layer_num
        self.draft_buffer = None
        if not packed_draft and geometry.draft is not None:
            # The sidecar draft: its own host buffer (the draft latent component's).
            index, _ = self.host.component_buffer(kvshard.geometry.Component.DRAFT_LATENT)
            self.draft_buffer = self._arrays.of(self.host, index)
        self.indexer = DSAIndexerHostPool(self) if self._indexer is not None else None
        self.clear()

    # --- the host allocator (SGLang's HostKVCache.alloc/free) -----------------------------

    def clear(self) -> None:
        """Frees every host page."""
        self._allocator = kvshard.shard.ShardAllocator(kvshard.shard.Placement(1), self.page_num)

    def available_size(self) -> int:
        """Free host slots (page 0 excluded)."""
        return self._allocator.total_free() * PAGE_SIZE

    def alloc(self, need_size: int):
        """``need_size`` host slots (a multiple of the page size) as int64 per-token indices,
        or None when the pool cannot hold them. Page 0 is never handed out."""
        if need_size % PAGE_SIZE:
            raise kvshard.error.InvalidArgumentError(
                f"alloc of {need_size} slots: not a multiple of the page size {PAGE_SIZE}"
            )
        pages = need_size // PAGE_SIZE
        if pages > self._allocator.total_free():
            return None
        got = self._allocator.alloc(pages).pages
        return self._arrays.int64([p * PAGE_SIZE + t for p in got for t in range(PAGE_SIZE)])

    def free(self, indices) -> int:
        """Returns the pages of ``indices`` (int64 per-token, whole pages)."""
        values = self._arrays.tolist(_host_indices(indices))
        if not values:
            return 0
        self._allocator.free(sorted({v // PAGE_SIZE for v in values}))
        return len(values)

    def get_size_per_token(self) -> int:
        """Host bytes per token: the latent row of every layer (the draft's included)."""
        return self.token_stride_size * self.layer_num

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    # --- transfers -------------------------------------------------------------------------

    def _io(self, io_backend: str) -> "kvshard.copy.Method":
        """kvshard's method for SGLang's ``io_backend`` name (its default when empty)."""
        io = io_backend or self.io_backend
        if io == "kernel" and self.layout == "page_first_direct":
            if "kernel" not in self._warned:
                self._warned.add("kernel")
                warnings.warn(
                    "Kernel io backend does not support page first direct layout, switching to direct io backend",
                    stacklevel=3,
                )
            io = "direct"
        if io not in ("kernel", "direct"):
            raise kvshard.error.InvalidArgumentError(f"Unsupported IO backend: {io_backend}")
        return kvshard.copy.Method.KERNEL if io == "kernel" else kvshard.copy.Method.COPY_ENGINE

    @staticmethod
    def _pool(device_pool) -> "kvshard.pool.DevicePool":
        if isinstance(device_pool, kvshard.pool.DevicePool):
            return device_pool
        pool = getattr(device_pool, "kvshard_pool", None)
        if isinstance(pool, kvshard.pool.DevicePool):
            return pool
        raise kvshard.error.InvalidArgumentError(
            "device_pool: expected a kvshard.pool.DevicePool wrapping the engine's device tensors "
            "(or an object with a `kvshard_pool` attribute holding one)"
        )

    def _transfer(
        self,
        device_pool,
        host_indices,
        device_indices,
        direction: "kvshard.copy.Direction",
        io: "kvshard.copy.Method",
    ):
        key = (id(device_pool), id(host_indices), id(device_indices), direction)
        t = self._transfers.get(key)
        if t is None:
            pool = self._pool(device_pool)
            plan = kvshard.hicache.TransferPlan.from_slots(
                pool.placement,
                pool.rank,
                _host_indices(device_indices),
                _host_indices(host_indices),
                pool.pages,
                self.host.pages,
            )
            t = kvshard.hicache.HostTransfer(pool, self.host, plan, direction)
            self._transfers.put(key, (device_pool, host_indices, device_indices), t)
        if io == kvshard.copy.Method.KERNEL:
            t.prepare_kernel_sync(self._tables)
        return t

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        """SGLang's hook before the ``*_physical`` calls of one submission: returns the
        indices unchanged; kvshard plans and prepares the transfer for them once, on their
        first ``*_physical`` call."""
        return host_indices, device_indices

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        """Loads layer ``layer_id`` of the pages (every component; layer 0 carries the MTP
        draft) onto the current stream. ``is_draft=True`` does nothing: the draft landed with
        layer 0."""
        if is_draft:
            return
        io = self._io(io_backend)
        t = self._transfer(device_pool, host_indices, device_indices, kvshard.copy.Direction.LOAD, io)
        t.run(self.stream, io, layer_id, ctas=self.ctas)

    def load_to_device_per_layer_physical(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        self.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft
        )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend: str
    ) -> None:
        """Backs up every layer (every component, the draft's too) on the current stream."""
        io = self._io(io_backend)
        t = self._transfer(device_pool, host_indices, device_indices, kvshard.copy.Direction.BACKUP, io)
        t.run(self.stream, io, None, ctas=self.ctas)

    def backup_from_device_all_layer_physical(
        self, device_pool, host_indices, device_indices, io_backend: str
    ) -> None:
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_all_layers(
        self,
        device_pool,
        host_indices,
        device_indices,
        io_backend: str,
        on_layer_done: Optional[Callable[[int], Any]] = None,
    ) -> None:
        """SGLang's load submission: ``prepare_transfer_indices``, then per target layer
        ``load_to_device_per_layer_physical`` and ``on_layer_done(layer_id)`` (where SGLang's
        controller records that layer's event on the load stream)."""
        host_indices, device_indices = self.prepare_transfer_indices(
            host_indices, device_indices, io_backend
        )
        for layer_id in range(self.target_layer_num):
            self.load_to_device_per_layer_physical(
                device_pool, host_indices, device_indices, layer_id, io_backend
            )
            if on_layer_done is not None:
                on_layer_done(layer_id)

    # --- storage-backend page access (host memory) ---------------------------------------

    def get_data_page(self, index, flat: bool = True):
        """The host page whose first token slot is ``index`` (every layer, the packed draft's
        too), as SGLang slices it; ``flat`` flattens it."""
        index = operator.index(index)
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real = index // self.page_size
            page = self.kv_buffer[real : real + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return self._arrays.flat(page) if flat else page

    def get_dummy_flat_data_page(self):
        """A zero page, flat."""
        return self._arrays.zeros(
            (self.layer_num, self.page_size, 1, self.kv_cache_dim), self.kv_buffer
        )

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        """Writes a flat page (as ``get_data_page`` gives it) at first token slot ``index``."""
        index = operator.index(index)
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + self.page_size, :, :] = data_page.reshape(
                self.layer_num, self.page_size, 1, self.kv_cache_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[index : index + self.page_size, :, :, :] = data_page.reshape(
                self.page_size, self.layer_num, 1, self.kv_cache_dim
            )
        elif self.layout == "page_first_direct":
            real = index // self.page_size
            self.kv_buffer[real : real + 1, :, :, :, :] = data_page.reshape(
                1, self.layer_num, self.page_size, 1, self.kv_cache_dim
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    def get_page_buffer_meta(self, indices):
        """Host pointers and byte sizes of the pages of ``indices`` (int64 per token, whole
        pages) for zero-copy storage I/O: per page one pointer (page layouts) or one per layer
        (``layer_first``)."""
        values = self._arrays.tolist(_host_indices(indices))
        if len(values) % self.page_size:
            raise kvshard.error.InvalidArgumentError(
                f"{len(values)} indices: not whole pages of {self.page_size}"
            )
        ptrs, sizes = [], []
        for start in values[:: self.page_size]:
            for ptr, n in self.host.page_pointers(self._latent, start // self.page_size):
                ptrs.append(ptr)
                sizes.append(n)
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """Whether every page's pointer (page layouts) is a multiple of ``page_size_bytes``."""
        if self.layout not in ("page_first", "page_first_direct"):
            return False
        stride = self.page_size * self.layout_dim
        base = self.host.host_ptr(self._latent) or 0
        return base % page_size_bytes == 0 and stride % page_size_bytes == 0

    def get_contiguous_buf_infos(self):
        """``(data_ptrs, data_lens, item_lens)`` per layer, as SGLang registers host memory
        with a transfer engine."""
        base = self.host.host_ptr(self._latent) or 0
        layers = self.layer_num
        # SGLang's per-layer views: `page_first` transposes its buffer, so view i starts one
        # row into it; the other layouts index the buffer's first dimension (a layer of
        # `layer_first`, but a page of `page_first_direct`), and so does `data_lens`.
        first = self.kv_buffer[0]
        if self.layout == "page_first":
            ptrs = [base + i * self.token_stride_size for i in range(layers)]
        else:
            ptrs = [base + i * int(first.nbytes) for i in range(layers)]
        data_len = int(first.nbytes)
        return ptrs, [data_len] * layers, [self.token_stride_size * self.page_size] * layers


class DSAIndexerHostPool:
    """The DSA indexer host pool companion of an ``MLAHostPool`` (SGLang's
    ``DSAIndexerPoolHost`` page access): the same kvshard host pool's indexer buffer, one page
    longer than the latent's, ``[L, pages + 1, 8448]`` (``layer_first``) or
    ``[pages + 1, L, 1, 8448]``. Its transfer methods do nothing: the MLA pool's transfers
    move the indexer blocks with the latent rows."""

    def __init__(self, mla: MLAHostPool):
        self.mla = mla
        host = mla.host
        index = mla._indexer
        assert index is not None, "a cache without indexer layers has no indexer pool"
        self._index: int = index
        layout = host.buffer_layouts()[index]
        self.layout = mla.layout
        self.page_size = PAGE_SIZE
        self.size = mla.size
        self.page_num = mla.page_num
        self.indexer_page_num = layout.pages
        self.layer_num = layout.layers
        self.indexer_page_stride_size = layout.block_bytes
        self.indexer_layout_dim = self.indexer_page_stride_size * self.layer_num
        self.index_k_with_scale_buffer = mla._arrays.of(host, index)
        self.indexer_dtype = self.index_k_with_scale_buffer.dtype

    def get_size_per_token(self) -> int:
        return self.indexer_page_stride_size // PAGE_SIZE * self.layer_num

    def load_to_device_per_layer(self, *args, **kwargs) -> None:
        """Nothing: the MLA pool's load moved the indexer blocks."""

    def backup_from_device_all_layer(self, *args, **kwargs) -> None:
        """Nothing: the MLA pool's backup moved the indexer blocks."""

    load_to_device_per_layer_physical = load_to_device_per_layer
    backup_from_device_all_layer_physical = backup_from_device_all_layer

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def get_data_page(self, index, flat: bool = True):
        page = operator.index(index) // self.page_size
        if self.layout == "layer_first":
            data = self.index_k_with_scale_buffer[:, page : page + 1, :]
        else:
            data = self.index_k_with_scale_buffer[page : page + 1, :, :, :]
        return self.mla._arrays.flat(data) if flat else data

    def get_dummy_flat_data_page(self):
        return self.mla._arrays.zeros(
            (self.layer_num, self.indexer_page_stride_size), self.index_k_with_scale_buffer
        )

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        page = operator.index(index) // self.page_size
        if self.layout == "layer_first":
            self.index_k_with_scale_buffer[:, page : page + 1, :] = data_page.reshape(
                self.layer_num, 1, self.indexer_page_stride_size
            )
        else:
            self.index_k_with_scale_buffer[page : page + 1, :, :, :] = data_page.reshape(
                1, self.layer_num, 1, self.indexer_page_stride_size
            )

    def get_page_buffer_meta(self, indices):
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        values = self.mla._arrays.tolist(_host_indices(indices))
        if len(values) % self.page_size:
            raise kvshard.error.InvalidArgumentError(
                f"{len(values)} indices: not whole pages of {self.page_size}"
            )
        ptrs, sizes = [], []
        for start in values[:: self.page_size]:
            for ptr, n in self.mla.host.page_pointers(self._index, start // self.page_size):
                ptrs.append(ptr)
                sizes.append(n)
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.layout not in ("page_first", "page_first_direct"):
            return False
        base = self.mla.host.host_ptr(self._index) or 0
        return base % page_size_bytes == 0 and self.indexer_layout_dim % page_size_bytes == 0
