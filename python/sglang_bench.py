#!/usr/bin/env python3
"""SGLang 0.5.23's own data-plane paths against kvshard's adapter, side by side on the same bytes,
in one process and one run (docs/sglang.md, "Side by side").

For DeepSeek-V3.2 / GLM-5 with the MTP draft (61 target layers with their indexer + the packed
draft layer, 576-byte FP8 latent rows, 8,448-byte indexer pages), per shape:

- HiCache host transfers (one rank's pages: 64 and 512, CP2 and CP4; host layouts layer_first
  and page_first with the kernel I/O backend, what SGLang supports for DSA HiCache): SGLang's own
  ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost`` calls as its controller makes them (its
  ``PageInterleaveHostPool.owned_rows`` narrowing, ``backup_from_device_all_layer``, then per
  layer ``load_to_device_per_layer`` with ``is_draft`` for the draft), their JIT HiCache kernels
  (``sglang/kernels/ops/kvcache/hicache.py``: apache-tvm-ffi + nvcc), against the adapter's
  ``MLAHostPool`` (``backup_from_device_all_layer``, ``load_to_device_per_layer`` per layer);
  ceiling: a pinned H2D / D2H copy of the same bytes.
- The sharded extend of one batch (CP2 and CP4, prefix 64 and 512 pages, chunk 4K and 16K
  tokens): its plan (SGLang's ``begin_shard_extend`` from ``req_to_token`` on the device, against
  ``GatherPlan`` from the pages on the host), the owned-row write of every target layer (SGLang's
  ``set_kv_buffer`` on its page-interleave pool, the chunk staged into the scratch slot too,
  against the adapter's), and the prefix gather of every target layer (SGLang's
  ``_prefetch_layer`` pack of every rank and the all-gather's landing emulated by block copies on
  one GPU, against the adapter landing every rank's pages in every rank's slot); ceiling: a D2D
  copy of the same bytes.

Every row: device time (CUDA events around the call), window (host clock from the call to the
bytes usable, the stream synchronized), host CPU of the call (thread CPU time), medians of the
timed iterations, each next to the same-run ceiling; every kvshard result is compared byte for
byte with SGLang's. SGLang's JIT compile is timed apart. Where SGLang's DSA indexer pool calls its
ahead-of-time kernel package (``sgl_kernel.kvcacheio``, built for another torch; not staged), the
same copy runs through SGLang's JIT HiCache kernel, and the row says so.

    python sglang_bench.py [--dry] [--iters N] [--out DIR]

``--dry``: the CPU, tiny shapes, the CPU backend for kvshard, SGLang's pure-torch code; its CUDA
kernels replaced by restatements in torch (``_Restated``); every byte still compared (the
figures mean nothing). Writes ``sglang.md`` and ``sglang.png`` (when matplotlib imports) to
``--out`` (default: $OUT, else .).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.abc
import importlib.machinery
import os
import statistics
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import torch

import kvshard
from kvshard.backend import wait_for_frees_sync
from kvshard.geometry import CacheGeometry, INDEXER_PAGE_BYTES, PAGE_SIZE
from kvshard.shard import Placement, ShardAllocator
from kvshard.sglang.adapter import PageInterleaveAdapter

PAGE = PAGE_SIZE
ROW = 576
INDEXER = INDEXER_PAGE_BYTES


# --- SGLang's kernels: its JIT ones on the GPU, restated on the CPU ------------------------------


class _Restated:
    """SGLang's transfer kernels restated in torch and ctypes for the CPU (``--dry``): the same
    arguments, the same bytes moved (pointers are host addresses there)."""

    @staticmethod
    def _rows(ptr_table, indices, stride, element):
        return [(int(p), [int(i) * stride for i in indices.tolist()]) for p in ptr_table.tolist()], element

    @staticmethod
    def one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, *, element_dim=None, **_):
        element_dim = element_dim or cache_dst.size(-1)
        dst, src = cache_dst.view(-1, element_dim), cache_src.view(-1, element_dim)
        dst[indices_dst.long()] = src[indices_src.long()]

    @staticmethod
    def all_layer_mla(ptr_dst, indices_dst, ptr_src, indices_src, *, cache_src_stride_bytes, cache_dst_stride_bytes, element_size=None, **_):
        element_size = element_size or cache_dst_stride_bytes
        for d, s in zip(ptr_dst.tolist(), ptr_src.tolist()):
            for i, j in zip(indices_dst.tolist(), indices_src.tolist()):
                ctypes.memmove(int(d) + int(i) * cache_dst_stride_bytes, int(s) + int(j) * cache_src_stride_bytes, element_size)

    @staticmethod
    def staged_lf_pf(ptr_src, src_indices, dst_indices, staging, dst, *, page_size, element_size=None, **_):
        # Whole source pages of every layer into the page-major destination (through staging);
        # `src_indices[::page_size]` are the token slots the pages start at, as the kernel reads them.
        element = element_size or staging[0, 0].numel() * staging.element_size()
        layers = dst.shape[1]
        flat = dst.view(dst.shape[0], layers, -1)
        for n, page in enumerate(src_indices[::page_size].tolist()):
            for t in range(page_size):
                row = int(dst_indices[n * page_size + t])
                for layer, base in enumerate(ptr_src.tolist()):
                    ctypes.memmove(flat[row, layer].data_ptr(), int(base) + (int(page) + t) * element, element)


def _jit():
    """SGLang's JIT HiCache entry points (hicache.py), as its pools import them."""
    from sglang.kernels.ops.kvcache import hicache

    return SimpleNamespace(
        one_layer_mla=hicache.transfer_hicache_one_layer_mla,
        all_layer_mla=hicache.transfer_hicache_all_layer_mla,
        staged_lf_pf=hicache.transfer_hicache_all_layer_mla_staged_lf_pf,
    )


def _aot_stand_in(kernels):
    """``sgl_kernel.kvcacheio``'s MLA ops the DSA indexer pool calls, on ``kernels()``'s (SGLang's
    JIT ones on the GPU): the same bytes, item by item."""
    m = types.ModuleType("sgl_kernel.kvcacheio")

    def per_layer(src, dst, src_indices, dst_indices, item_size):
        kernels().one_layer_mla(cache_dst=dst, indices_dst=dst_indices, cache_src=src, indices_src=src_indices, element_dim=item_size)

    def per_layer_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
        kernels().one_layer_mla(
            cache_dst=dst, indices_dst=dst_indices, cache_src=src.transpose(0, 1)[layer_id],
            indices_src=src_indices, element_dim=item_size,
        )

    def all_layer(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
        kernels().all_layer_mla(
            ptr_dst=dst_layers, indices_dst=dst_indices, ptr_src=src_layers, indices_src=src_indices,
            cache_src_stride_bytes=item_size, cache_dst_stride_bytes=item_size, element_size=item_size,
        )

    def all_layer_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers):
        from sglang.srt.mem_cache.pool_host.common import make_kernel_ptr_table

        views = [dst.transpose(0, 1)[i] for i in range(num_layers)]
        table = make_kernel_ptr_table(views, src_layers.device, host_memory_registered=src_layers.is_cuda)
        kernels().all_layer_mla(
            ptr_dst=table, indices_dst=dst_indices, ptr_src=src_layers, indices_src=src_indices,
            cache_src_stride_bytes=item_size, cache_dst_stride_bytes=dst_layout_dim, element_size=item_size,
        )

    m.transfer_kv_per_layer_mla = per_layer
    m.transfer_kv_per_layer_mla_pf_lf = per_layer_pf_lf
    m.transfer_kv_all_layer_mla = all_layer
    m.transfer_kv_all_layer_mla_lf_pf = all_layer_lf_pf
    return m


class _NotStaged(types.ModuleType):
    """A module of SGLang's ahead-of-time kernel package (``sgl_kernel``, not staged): its names
    import (SGLang's modules import many at import time on CUDA) and refuse when called."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name}: SGLang's ahead-of-time kernel package is not staged")

        return refuse


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel`` and its submodules as ``_NotStaged`` modules, ``kvcacheio`` with the
    stand-ins; ``sgl_kernel.scalar_type`` does not import (SGLang has a fallback for it and
    reads attributes of it at import)."""

    MISSING = {"sgl_kernel.scalar_type"}

    def __init__(self, kvcacheio):
        self.kvcacheio = kvcacheio

    def find_spec(self, name, path=None, target=None):
        if (name == "sgl_kernel" or name.startswith("sgl_kernel.")) and name not in self.MISSING:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        if spec.name == "sgl_kernel.kvcacheio":
            return self.kvcacheio
        return _NotStaged(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install_kernels(gpu: bool):
    """Binds SGLang's host pools to their kernels before they are imported: its JIT ones on the
    GPU (``sgl_kernel``, which its modules import on CUDA, is ``_SglKernelFinder``'s), their
    restatements on the CPU. Returns what the rows name as SGLang's kernels."""
    kernels = _jit if gpu else (lambda: _Restated)
    kvcacheio = _aot_stand_in(kernels)
    if gpu:
        sys.meta_path.insert(0, _SglKernelFinder(kvcacheio))
        return "JIT (hicache.py: apache-tvm-ffi + nvcc); the DSA indexer pool's sgl_kernel.kvcacheio ops on the same JIT kernels"
    from sglang.srt.mem_cache.pool_host import dsa, mla

    k = _Restated
    mla.jit_transfer_hicache_one_layer_mla = k.one_layer_mla
    mla.jit_transfer_hicache_all_layer_mla = k.all_layer_mla
    mla.jit_transfer_hicache_all_layer_mla_staged_lf_pf = k.staged_lf_pf
    dsa.jit_transfer_hicache_all_layer_mla_staged_lf_pf = k.staged_lf_pf
    for name in ("transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf"):
        setattr(mla, name, getattr(kvcacheio, name))
        setattr(dsa, name, getattr(kvcacheio, name))
    return "restated in torch (the CPU: SGLang's kernels are CUDA's)"


#: What the benchmark imports of SGLang, on the GPU as on the CPU.
SGLANG_MODULES = (
    "sglang.kernels.ops.kvcache.hicache",
    "sglang.srt.mem_cache.device_pool_info",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.page_interleave",
    "sglang.srt.mem_cache.page_interleave_pool",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.host_pool_decl",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.page_interleave",
    "kvshard.sglang_storage",
)


def imports_on_cuda():
    """Imports ``SGLANG_MODULES`` here as they import on a CUDA host (torch's CUDA queries
    answered as an H200's, ``sgl_kernel`` from ``_SglKernelFinder``) and returns, one a line,
    ``file PATH`` of every ``sglang`` module loaded and ``dist NAME==VERSION`` of every
    distribution any loaded module belongs to: what the GPU host needs
    (scripts/stage-sglang.sh), and a check on the CPU that the GPU's imports resolve."""
    import importlib

    torch.cuda.is_available = lambda: True
    torch.version.cuda = torch.version.cuda or "13.0"
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    install_kernels(True)
    for name in SGLANG_MODULES:
        importlib.import_module(name)
    from sglang.srt.utils import is_cuda

    assert is_cuda(), "the CUDA branches of SGLang's imports did not run"
    import importlib.metadata as md

    loaded = [(n, getattr(m, "__file__", None) or "") for n, m in list(sys.modules.items())]
    files = sorted({f for n, f in loaded if n.split(".")[0] == "sglang" and f})
    owners = md.packages_distributions()
    dists = sorted({d for n, f in loaded if "site-packages" in f for d in owners.get(n.split(".")[0], [])})
    return [f"file {f}" for f in files] + [f"dist {d}=={md.version(d)}" for d in dists]


# --- timing ---------------------------------------------------------------------------------------


class Clock:
    """Device time by CUDA events (the host clock on the CPU), the window and host CPU."""

    def __init__(self, gpu: bool, kv_device):
        self.gpu = gpu
        self.kv_device = kv_device

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()
        else:
            self.kv_device.synchronize()

    def time(self, fn, iters):
        fn()
        self.sync()
        device, window, cpu = [], [], []
        for _ in range(iters):
            self.sync()
            if self.gpu:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            if self.gpu:
                e0.record()
            fn()
            if self.gpu:
                e1.record()
            c1 = time.thread_time()
            self.sync()
            t1 = time.perf_counter()
            device.append(e0.elapsed_time(e1) if self.gpu else (t1 - t0) * 1e3)
            window.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
        return statistics.median(device), statistics.median(window), statistics.median(cpu)


def ceiling(clock, nbytes, kind, iters):
    """A pinned H2D or D2H copy, or a D2D copy, of ``nbytes``: the same-run ceiling."""
    dev = "cuda" if clock.gpu else "cpu"
    pin = clock.gpu
    if kind == "d2d":
        a, b = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    elif kind == "h2d":
        a, b = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    else:
        a, b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return clock.time(lambda: a.copy_(b, non_blocking=True), iters)


# --- SGLang's objects -----------------------------------------------------------------------------


def sglang_host_pools(target, draft, target_ix, draft_ix, layout, skip, dev, pin):
    """SGLang's MLA and DSA indexer host pools over device buffers, built as its assembler does."""
    from sglang.srt.mem_cache import device_pool_info as info_mod
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host import dsa, host_pool_decl, mla

    layers = len(target)
    rows = target[0].shape[0]

    def info(buffers, ids):
        # SGLang's own pool passes its pointer table's device (`cuda:0`, not `cuda`): validate()
        # compares it with each buffer's device exactly.
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=dev)
        return info_mod.MLABufferInfo(
            buffers=tuple(buffers), data_ptrs=ptrs,
            layer_indices=tuple(ids), device_layer_num=len(ids), page_size=PAGE, kv_lora_rank=512,
            qk_rope_head_dim=64, kv_cache_dim=ROW, dtype=torch.uint8, device=ptrs.device, packed_fp8=True,
        )

    kv = mla.MLATokenToKVPoolHost(
        info(target, range(layers)), 1.0, 0, PAGE, layout, pin_memory=pin, device="cpu",
        override_kv_cache_dim=ROW, draft_buffer_infos=(info(draft, [0]),),
        device_capacity_tokens=rows - PAGE, start_layer=0, end_layer=layers, target_layer_num=layers,
    )
    device_pool = SimpleNamespace(
        device=dev, index_k_with_scale_buffer=target_ix, start_layer=0, end_layer=layers, layer_num=layers,
        store_dtype=torch.uint8, skip_topk_layers=list(skip), layer_shard_enabled=False,
    )
    decl = host_pool_decl.HostPoolDecl(
        pool_name=PoolName.INDEXER, device_pool=device_pool, indices_from_pool=PoolName.KV,
        layout_source=PoolName.KV,
        storage_info=host_pool_decl.HostPoolStorageInfo(bytes_per_token_per_layer=INDEXER // PAGE, dtype=torch.uint8),
        host_pool_builder=None, owned_device_layers=tuple(i for i, s in enumerate(skip) if not s),
    )
    draft_pool = SimpleNamespace(device=dev, index_k_with_scale_buffer=draft_ix, layer_num=1)
    ix = dsa.DSAIndexerPoolHost(decl, kv, packed_draft_device_pools=(draft_pool,), pin_memory=pin)
    return kv, ix, device_pool, draft_pool


def force_kernels(kv, ix, gpu):
    """On the CPU, the flags SGLang's pools set on CUDA (its JIT kernels usable; the staged
    write-back's staging buffer for page_first), so its CUDA branches run (restated)."""
    if gpu:
        return
    kv.can_use_jit = True
    if kv.layout == "page_first":
        kv.can_use_write_back_jit = True
        kv.staging_buffer = torch.empty((min(kv.page_num, 64) * PAGE, kv.layer_num, 1, ROW), dtype=torch.uint8)
        ix.can_use_write_back_jit = True
        ix.staging_buffer = torch.empty((min(ix.indexer_page_num, 64), ix.layer_num, 1, INDEXER), dtype=torch.uint8)


def device_set(layers, skip, pages, dev, gen):
    """A rank's device pool tensors (SGLang's shapes), random bytes: target latent and indexer
    per layer, the draft's."""

    def rnd(shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)

    target = [rnd((pages * PAGE, 1, ROW)) for _ in range(layers)]
    target_ix = [rnd((0 if s else pages, INDEXER)) for s in skip]
    return target, [rnd((pages * PAGE, 1, ROW))], target_ix, [rnd((pages, INDEXER))]


def copy_set(s):
    return tuple([t.clone() for t in part] for part in s)


# --- the sections ---------------------------------------------------------------------------------


def host_section(args, clock, rows_out, checks):
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    gpu, dev = clock.gpu, ("cuda" if clock.gpu else "cpu")
    gen = torch.Generator(device=dev).manual_seed(1)
    for pages in args.pages:
        theirs_dev = device_set(args.layers, args.skip, pages + 1, dev, gen)
        ours_dev = copy_set(theirs_dev)
        for layout in ("layer_first", "page_first"):
            kv, ix, device_pool, draft_pool = sglang_host_pools(*theirs_dev, layout, args.skip, dev, gpu)
            kv2, ix2, _, _ = sglang_host_pools(*ours_dev, layout, args.skip, dev, gpu)
            force_kernels(kv, ix, gpu)
            for cp in args.cp:
                spec = PageShardSpec(shard_rank=0, shard_size=cp, page_size=PAGE, max_prefix_tokens=cp * PAGE, chunk_tokens=PAGE)
                facade = PageInterleaveHostPool(kv, PageInterleavePlacement(spec))
                # Rank 0's pages of a chain of cp * pages logical pages: its device pages 1..,
                # host pages in reverse (a reload lands elsewhere than it was stored).
                dev_logical = [cp * (1 + i) for i in range(pages)]
                host_logical = [cp * (pages - i) for i in range(pages)]
                slots = lambda ps: torch.tensor([p * PAGE + o for p in ps for o in range(PAGE)], dtype=torch.int64)
                host_idx, dev_idx = slots(host_logical), slots(dev_logical)
                adapter = PageInterleaveAdapter(
                    ours_dev[0], ours_dev[2], 0, cp, cp * PAGE, PAGE, draft_kv=ours_dev[1][0], draft_index=ours_dev[3][0]
                )
                ours = adapter.host_pool(kv2, ix2)
                dev_idx_d = dev_idx.to(dev)
                host_idx_d = host_idx.to(dev)

                def sglang_backup():
                    h, d = facade.owned_rows(host_idx, dev_idx_d)
                    # The staged page_first write-back keeps CPU host indices (its controller's
                    # _move_write_operation); every other kernel call takes them on the device.
                    h = h if layout == "page_first" and kv.can_use_write_back_jit else h.to(dev, non_blocking=True)
                    kv.backup_from_device_all_layer(None, h, d, "kernel")
                    ix.backup_from_device_all_layer(device_pool, h, d, "kernel")

                def sglang_load():
                    h, d = facade.owned_rows(host_idx, dev_idx_d)
                    h = h.to(dev, non_blocking=True)
                    for layer in range(args.layers):
                        kv.load_to_device_per_layer(None, h, d, layer, "kernel")
                        ix.load_to_device_per_layer(device_pool, h, d, layer, "kernel")
                    kv.load_to_device_per_layer(None, h, d, args.layers, "kernel", is_draft=True)
                    ix.load_to_device_per_layer(draft_pool, h, d, args.layers, "kernel", is_draft=True)

                def ours_backup():
                    ours.backup_from_device_all_layer(adapter, host_idx_d, dev_idx_d, "kernel")

                def ours_load():
                    for layer in range(args.layers):
                        ours.load_to_device_per_layer(adapter, host_idx_d, dev_idx_d, layer, "kernel")

                nbytes = pages * (args.layers + 1) * PAGE * ROW + pages * (args.layers - sum(args.skip) + 1) * INDEXER
                for direction, theirs_fn, ours_fn, kind in (
                    ("backup", sglang_backup, ours_backup, "d2h"),
                    ("load", sglang_load, ours_load, "h2d"),
                ):
                    top = ceiling(clock, nbytes, kind, args.iters)
                    t = clock.time(theirs_fn, args.iters)
                    o = clock.time(ours_fn, args.iters)
                    clock.sync()
                    same = compare_host(kv, ix, kv2, ix2, theirs_dev, ours_dev, host_logical, dev_logical, cp, direction)
                    checks.append(same)
                    shape = f"{layout} {direction}, CP{cp}, {pages} pages"
                    rows_out.append(("host", shape, nbytes, t, o, top, same))
                    print(f"host {shape}: SGLang {t[0]:.3f} ms, kvshard {o[0]:.3f} ms, ceiling {top[0]:.3f} ms, {'byte-identical' if same else 'BYTES DIFFER'}", flush=True)
                # kvshard wraps a memory once: this CP size's pool and host pool go (their work
                # has run) before the next wraps the same tensors.
                clock.sync()
                del ours, adapter
                gc.collect()
            # SGLang's host pools registered their buffers with cudaHostRegister: `destroy()`
            # unregisters them (SGLang calls it at teardown) before the memory goes back to the
            # allocator, else the next pool's buffer may land on still-registered pages
            # (cudaErrorHostMemoryAlreadyRegistered). kvshard's frees of what it wrapped in them
            # have run first.
            clock.sync()
            wait_for_frees_sync(60.0)
            for pool in (kv, ix, kv2, ix2):
                if hasattr(pool, "destroy"):
                    pool.destroy()
            del kv, ix, kv2, ix2


def compare_host(kv, ix, kv2, ix2, theirs_dev, ours_dev, host_logical, dev_logical, cp, direction):
    if direction == "backup":
        pages = [h // cp for h in host_logical]
        return all(
            torch.equal(a.get_data_page(p * PAGE, flat=True), b.get_data_page(p * PAGE, flat=True))
            for p in pages
            for a, b in ((kv, kv2), (ix, ix2))
        )
    return all(torch.equal(x, y) for a, b in zip(theirs_dev, ours_dev) for x, y in zip(a, b))


def extend_section(args, clock, rows_out, checks):
    """One sharded extend batch: plan, owned-row writes, prefix gathers; CP ranks of one GPU."""
    from sglang.srt.mem_cache import page_interleave, page_interleave_pool

    gpu, dev = clock.gpu, ("cuda" if clock.gpu else "cpu")
    dm = torch.get_device_module(dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    layers = args.layers
    for cp in args.cp:
        for prefix in args.pages:
            for chunk_tokens in args.chunks:
                chunk = chunk_tokens // PAGE
                ppr = -(-prefix // cp) + -(-chunk // cp) + 2
                alloc = ShardAllocator(Placement(cp), ppr)
                a = alloc.alloc(prefix)
                new = alloc.alloc(chunk, a.start_owner, prefix * PAGE).pages
                requests = [(a.start_owner, list(a.pages), new)]
                max_prefix = -(-prefix // cp) * cp * PAGE
                sets = [[device_set(layers, args.skip, ppr, dev, gen)[::2] for _ in range(cp)] for _ in range(2)]
                for r in range(cp):
                    sets[1][r] = tuple([t.clone() for t in part] for part in sets[0][r])
                adapters = [PageInterleaveAdapter(kv_, ix_, r, cp, max_prefix, chunk_tokens) for r, (kv_, ix_) in enumerate(sets[1])]
                our_slots = [[ad.scratch_slot() for _ in range(2)] for ad in adapters]
                their_slots = [[{"kv": torch.zeros_like(s.kv), "index_k": torch.zeros_like(s.index_k)} for s in sl] for sl in our_slots]
                calls = []

                class Comm:
                    def __init__(self, r):
                        self.r = r

                    def change_state(self, enable=True):
                        import contextlib

                        return contextlib.nullcontext()

                    def all_gather(self, out, send):
                        calls.append((self.r, out, send))

                pools = []
                for r, (kv_, ix_) in enumerate(sets[0]):
                    spec = page_interleave.PageShardSpec(shard_rank=r, shard_size=cp, page_size=PAGE, max_prefix_tokens=max_prefix, chunk_tokens=chunk_tokens)
                    p = object.__new__(page_interleave_pool.PageInterleaveDSATokenToKVPool)
                    size = (ppr - 1) * PAGE
                    p.__dict__.update(
                        shard_spec=spec, placement=page_interleave.PageInterleavePlacement(spec), shard_rank=r, shard_size=cp,
                        page_size=PAGE, device=dev, size=size, start_layer=0, layer_num=layers, kv_buffer=kv_,
                        index_key_cache=SimpleNamespace(buffer=ix_), dtype=torch.uint8, store_dtype=torch.uint8,
                        dsa_kv_cache_store_fp8=False, requires_physical_write_loc=False, write_loc_is_dcp_resolved=True,
                        _chunk_base=max_prefix, _trash_base=max_prefix + chunk_tokens, _epoch=0, _local_page_stride=size // PAGE + 2,
                        _debug_plan_checks=False, _translate_cache={}, _shard_extend_active=False, _block_pages=0,
                        _send_pages=None, _send_rows=None, _write_plan_key=None, _write_plan=None,
                        _page_pos=torch.full((cp * (size // PAGE + 2),), (max_prefix + chunk_tokens) // PAGE, dtype=torch.int32, device=dev),
                        _slots=[page_interleave_pool._ScratchSlot(s, dm) for s in their_slots[r]], device_module=dm,
                        kv_gather_stream=dm.current_stream(), kv_gather_comm=Comm(r), layer_transfer_counter=None,
                    )
                    pools.append(p)

                def all_gather():
                    by_rank = {}
                    for r, out, send in calls:
                        by_rank.setdefault(r, []).append((out, send))
                    for k in range(len(by_rank.get(0, []))):
                        for mine in by_rank.values():
                            for r, theirs in by_rank.items():
                                n = theirs[k][1].shape[0]
                                mine[k][0][r * n : (r + 1) * n].copy_(theirs[k][1], non_blocking=True)
                    calls.clear()

                slots = [p * PAGE + o for p in requests[0][1] + new for o in range(PAGE)]
                req_to_token = torch.tensor([slots], dtype=torch.int32, device=dev)
                loc = torch.tensor(slots[prefix * PAGE :], dtype=torch.int64, device=dev)
                rows = torch.randint(0, 256, (loc.shape[0], 1, ROW), dtype=torch.uint8, device=dev, generator=gen)

                def sglang_plan():
                    for p in pools:
                        p.begin_shard_extend(req_to_token, torch.arange(1, device=dev), [prefix * PAGE], [len(slots)])
                    calls.clear()

                def ours_plan():
                    for ad in adapters:
                        ad.begin_shard_extend(requests)

                def sglang_write():
                    p = pools[0]
                    p._epoch += 1  # a new batch: SGLang recomputes its write plan once
                    for layer in range(layers):
                        p.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, rows, None)

                def ours_write():
                    ad = adapters[0]
                    for layer in range(layers):
                        ad.set_kv_buffer(layer, loc, rows)
                        # The chunk into the slot: SGLang's own torch copy, as its pool makes it.
                        our_slots[0][layer % 2].kv[ad.translate_loc_to_scratch(loc)] = rows

                def sglang_gather():
                    for layer in range(layers):
                        for p in pools:
                            p._slots[layer % 2].resident_key = None
                            p._prefetch_layer(layer)
                        all_gather()

                def ours_gather():
                    for layer in range(layers):
                        for ad in adapters:
                            for q in range(cp):
                                ad.land(layer, our_slots[q][layer % 2])

                shape = f"CP{cp}, prefix {prefix} pages, chunk {chunk_tokens // 1024 or chunk_tokens}{'K' if chunk_tokens >= 1024 else ''} tokens"
                owned = sum(1 for s in slots[prefix * PAGE :: PAGE] if (s // PAGE) % cp == 0) * PAGE
                sizes = {
                    "plan": cp * ppr * 4,
                    "write": layers * (owned + len(loc)) * ROW,
                    "gather": layers * cp * (prefix * PAGE * ROW + prefix * INDEXER),
                }
                for name, theirs_fn, ours_fn in (("plan", sglang_plan, ours_plan), ("write", sglang_write, ours_write), ("gather", sglang_gather, ours_gather)):
                    top = ceiling(clock, sizes[name], "d2d", args.iters)
                    t = clock.time(theirs_fn, args.iters)
                    o = clock.time(ours_fn, args.iters)
                    clock.sync()
                    if name == "write":
                        # The last layer's slot holds its staged chunk in both.
                        for p in pools:
                            p._shard_extend_active = True
                        sglang_write()
                    clock.sync()
                    same = compare_extend(name, pools, adapters, their_slots, our_slots, sets, requests, cp, layers)
                    checks.append(same)
                    rows_out.append((name, shape, sizes[name], t, o, top, same))
                    print(f"{name} {shape}: SGLang {t[0]:.3f} ms, kvshard {o[0]:.3f} ms, ceiling {top[0]:.3f} ms, {'byte-identical' if same else 'BYTES DIFFER'}", flush=True)
                for ad in adapters:
                    ad.end_shard_extend()
                del pools, adapters, sets, our_slots, their_slots


def compare_extend(name, pools, adapters, their_slots, our_slots, sets, requests, cp, layers):
    if name == "plan":
        n = len(adapters[0].page_pos)
        return all(
            torch.equal(p._page_pos[:n].cpu(), a.page_pos.cpu()) and p._block_pages == a.block_pages for p, a in zip(pools, adapters)
        )
    if name == "write":
        last = (layers - 1) % 2
        mapped = requests[0][2]
        same = all(torch.equal(x, y) for x, y in zip(sets[0][0][0], sets[1][0][0]))
        for pg in mapped:
            s = int(pools[0]._page_pos[pg])
            same &= torch.equal(their_slots[0][last]["kv"][s * PAGE : (s + 1) * PAGE], our_slots[0][last].kv[s * PAGE : (s + 1) * PAGE])
        return bool(same)
    last = (layers - 1) % 2
    same = True
    for r in range(cp):
        for pg in requests[0][1]:
            s = int(pools[r]._page_pos[pg])
            same &= torch.equal(their_slots[r][last]["kv"][s * PAGE : (s + 1) * PAGE], our_slots[r][last].kv[s * PAGE : (s + 1) * PAGE])
            same &= torch.equal(their_slots[r][last]["index_k"][s], our_slots[r][last].index_k[s])
    return bool(same)


# --- the report -----------------------------------------------------------------------------------


def report(rows, out, title, jit_s, kernels):
    def cell(t, nbytes):
        gbps = nbytes / (t[0] * 1e6) if t[0] > 0 else float("inf")
        return f"{t[0]:.3f} / {t[1]:.3f} / {t[2]:.3f} ({gbps:.1f} GB/s)"

    lines = [
        f"# SGLang 0.5.23's own path against kvshard's adapter, same bytes ({title})",
        "",
        f"SGLang's kernels: {kernels}; its JIT compile took {jit_s:.1f} s (apart from the rows).",
        "Each cell: device ms (CUDA events) / window ms (call to bytes usable) / host CPU ms of the call, medians;",
        "GB/s from the device time. Ceiling: pinned H2D or D2H copy of the same bytes (host rows), D2D copy (device rows).",
        "host: one rank's pages, SGLang's MLA and DSA indexer host pools' calls (owned_rows, backup of every layer; load",
        "layer by layer and the draft) against the adapter's host pool. plan: every rank's begin_shard_extend (SGLang's, as",
        "written, also launches layer 0's pack) against GatherPlan and the table copy. write: one rank's owned-row writes of",
        "every target layer with the chunk staged into the scratch slot. gather: every target layer's prefix into every",
        "rank's slot (SGLang: each rank's pack, the all-gather as device copies; kvshard: each rank's landings).",
        "",
        "| path | shape | bytes | SGLang | kvshard | ceiling | kvshard / SGLang (device) | bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, shape, nbytes, t, o, top, same in rows:
        ratio = t[0] / o[0] if o[0] > 0 else float("inf")
        lines.append(
            f"| {name} | {shape} | {nbytes:,} | {cell(t, nbytes)} | {cell(o, nbytes)} | {cell(top, nbytes)} | "
            f"{ratio:.2f}x | {'byte-identical' if same else 'DIFFER'} |"
        )
    lines.append("")
    lines.append("kvshard's results: " + ("every one byte-identical to SGLang's." if all(r[-1] for r in rows) else "SOME BYTES DIFFER from SGLang's."))
    with open(os.path.join(out, "sglang.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    chart(rows, out, title)


def chart(rows, out, title):
    """GB/s of SGLang, kvshard and the ceiling per row, as ``sglang.png`` (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart: matplotlib does not import; table only")
        return
    labels = [f"{r[0]}: {r[1]}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.5))
    y = np.arange(len(rows))
    # Percent of the same-run ceiling (host rows next to a pinned copy, device rows next to a
    # D2D copy: one scale for both).
    for k, (name, idx) in enumerate((("SGLang", 3), ("kvshard", 4))):
        ax.barh(y + (k - 0.5) * 0.4, [100 * r[5][0] / r[idx][0] if r[idx][0] > 0 else 0 for r in rows], 0.4, label=name)
    ax.axvline(100, color="gray", linewidth=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the same-run ceiling (device time)")
    ax.legend()
    ax.set_title(f"SGLang 0.5.23 vs kvshard, same bytes ({title})")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sglang.png"), dpi=110)
    print("chart:", os.path.join(out, "sglang.png"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="the CPU, tiny shapes, SGLang's kernels restated")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--imports-on-cuda", action="store_true",
        help="import what the GPU run imports, as on a CUDA host; print the sglang files and distributions loaded",
    )
    args = ap.parse_args(argv)
    if args.imports_on_cuda:
        print("\n".join(imports_on_cuda()))
        return
    gpu = not args.dry
    if gpu and not torch.cuda.is_available():
        sys.exit("sglang_bench: no CUDA device (use --dry on the CPU)")
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    kernels = install_kernels(gpu)
    if args.dry:
        # Two of each loop but chunks: every loop body runs again after its first round.
        args.layers, args.skip, args.pages, args.chunks, args.cp = 3, (False, True, False), [2, 4], [128], [2, 4]
        args.iters = args.iters or 1
    else:
        geometry = CacheGeometry.deepseek_v32()
        args.layers = geometry.target.num_layers
        args.skip = tuple(not x for x in geometry.target.indexer_layers)
        args.pages, args.chunks, args.cp = [64, 512], [4096, 16384], [2, 4]
        args.iters = args.iters or 5
    jit_s = 0.0
    if gpu:
        t = time.perf_counter()
        from sglang.kernels.ops.kvcache import hicache

        ok = [
            hicache.can_use_hicache_jit_kernel(element_size=ROW, page_size=PAGE),
            hicache.can_use_write_back_jit_kernel(element_size=ROW),
            hicache.can_use_write_back_jit_kernel(element_size=INDEXER),
            hicache.can_use_hicache_jit_kernel(element_size=INDEXER),
        ]
        jit_s = time.perf_counter() - t
        print(f"SGLang JIT compile: {jit_s:.1f} s, usable {ok}", flush=True)
        if not all(ok):
            sys.exit("sglang_bench: SGLang's JIT HiCache kernels did not build (see the warnings above)")
    kv_device = kvshard.Device.cuda(0) if gpu else kvshard.Device.cpu()
    clock = Clock(gpu, kv_device)
    rows, checks = [], []
    if not gpu:
        # The CPU backend's streams: what the adapters run on.
        from kvshard.sglang import adapter as adapter_mod

        clock.kv_device = adapter_mod._device_of(torch.zeros(1))
    host_section(args, clock, rows, checks)
    extend_section(args, clock, rows, checks)
    title = "dry run on the CPU: tiny shapes, figures meaningless" if args.dry else torch.cuda.get_device_name(0)
    report(rows, args.out, title, jit_s, kernels)
    print(f"sglang_bench: {len(rows)} rows, {sum(checks)} byte-identical, {time.perf_counter() - started:.1f} s in all")
    print(open(os.path.join(args.out, "sglang.md")).read())
    if not all(checks):
        sys.exit("sglang_bench: kvshard's bytes differ from SGLang's")


if __name__ == "__main__":
    main()
