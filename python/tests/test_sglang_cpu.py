"""SGLang byte compatibility on the CPU backend: host buffers shaped exactly as sglang 0.5.x
allocates them (``pool_host/mla.py`` ``init_kv_buffer``, ``dsa.py`` ``init_kv_buffer``), filled
by kvshard's backup and read back through SGLang's own indexing, for every layout, with and
without the packed MTP draft; then SGLang's page-level storage calls and the controller's
per-layer load loop."""

import numpy as np
import pytest

import kvshard
from kvshard.error import InvalidArgumentError
from kvshard.geometry import (
    CacheGeometry,
    Component,
    INDEXER_PAGE_BYTES,
    LatentLayout,
    PoolGeometry,
)
from kvshard.pool import DevicePool
from kvshard.shard import Placement
from conftest import PAGE, engine_tensors, nonzero, page_bytes, wrap
from kvshard.sglang import MLAHostPool, resolve_layout_io

C = Component
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
INDEXER = INDEXER_PAGE_BYTES


def sglang_kv_shape(layout, layer_num, page_num, dim):
    """SGLang's MLATokenToKVPoolHost.init_kv_buffer dims (size = page_num * page_size)."""
    size = page_num * PAGE
    return {
        "layer_first": (layer_num, size, 1, dim),
        "page_first": (size, layer_num, 1, dim),
        "page_first_direct": (page_num, layer_num, PAGE, 1, dim),
    }[layout]


def sglang_indexer_shape(layout, layer_num, page_num):
    """SGLang's DSAIndexerPoolHost: indexer_page_num = (size + page_size + 1) // page_size."""
    size = page_num * PAGE
    pages = (size + PAGE + 1) // PAGE
    if layout == "layer_first":
        return (layer_num, pages, INDEXER)
    return (pages, layer_num, 1, INDEXER)


def sglang_row(kv, layout, layer, slot):
    """Host token slot `slot`'s row of layer `layer`, as SGLang's kernels index it."""
    if layout == "layer_first":
        return kv[layer, slot, 0]
    if layout == "page_first":
        return kv[slot, layer, 0]
    return kv[slot // PAGE, layer, slot % PAGE, 0]


def sglang_block(ix, layout, layer, page):
    if layout == "layer_first":
        return ix[layer, page]
    return ix[page, layer, 0]


def geometry_with_shared_indexer():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_SCALED, indexer_layers=[True, False, True]), draft=True
    )


def sglang_buffers(geometry, layout, page_num, packed):
    """The engine's host buffers, in kvshard's buffer order for the format."""
    target = geometry.target
    row = target.row_bytes
    draft = geometry.draft is not None
    if packed:
        kv = np.zeros(sglang_kv_shape(layout, target.num_layers + draft, page_num, row), np.uint8)
        ix = np.zeros(
            sglang_indexer_shape(layout, target.num_indexer_layers + draft, page_num), np.uint8
        )
        return [kv, ix]
    out = [
        np.zeros(sglang_kv_shape(layout, target.num_layers, page_num, row), np.uint8),
        np.zeros(sglang_indexer_shape(layout, target.num_indexer_layers, page_num), np.uint8),
    ]
    if draft:
        out.append(np.zeros(sglang_kv_shape(layout, 1, page_num, row), np.uint8))
        out.append(np.zeros(sglang_indexer_shape(layout, 1, page_num), np.uint8))
    return out


def filled_device_pool(device, geometry, pages, rng):
    tensors = engine_tensors(geometry, pages)
    for arrays in tensors.values():
        for a in arrays:
            a[...] = nonzero(rng, a.shape)
    return wrap(device, geometry, Placement(1), 0, pages, tensors), tensors


def slots(pages):
    return np.asarray([p * PAGE + t for p in pages for t in range(PAGE)], dtype=np.int64)


@pytest.mark.filterwarnings("ignore:Kernel io backend does not support")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed-draft", "sidecar-draft"])
@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_a_backup_lands_where_sglang_reads_and_loads_back_layer_by_layer(rng, layout, packed, io):
    geometry = geometry_with_shared_indexer()
    device = kvshard.Device.cpu()
    page_num, dev_pages = 9, 12
    pool, tensors = filled_device_pool(device, geometry, dev_pages, rng)
    buffers = sglang_buffers(geometry, layout, page_num, packed)
    with pytest.warns(UserWarning) if (layout, io) in (
        ("page_first_direct", "kernel"),
        ("page_first", "direct"),
    ) else _no_warning():
        host = MLAHostPool(
            device, geometry, page_num, layout, io, packed_draft=packed, buffers=_retyped(buffers, layout, io)
        )
    layout = host.layout  # SGLang's correction may have changed it
    buffers = _retyped(buffers, layout, io)
    device_pages, host_pages = [3, 7, 4, 10], [2, 3, 8, 5]
    hidx, didx = slots(host_pages), slots(device_pages)
    h, d = host.prepare_transfer_indices(hidx, didx, io)
    host.backup_from_device_all_layer_physical(pool, h, d, io)
    device.synchronize()
    target = geometry.target
    kv, ix = buffers[0], buffers[1]
    ix_layers = [l for l in range(target.num_layers) if target.indexer_layers[l]]
    for dp, hp in zip(device_pages, host_pages):
        for layer in range(target.num_layers):
            got = np.stack([sglang_row(kv, layout, layer, hp * PAGE + t) for t in range(PAGE)])
            want = tensors[C.TARGET_LATENT][layer][dp * PAGE : (dp + 1) * PAGE, 0]
            assert np.array_equal(got, want), (layout, layer, hp)
        for stored, layer in enumerate(ix_layers):
            assert np.array_equal(
                sglang_block(ix, layout, stored, hp), tensors[C.TARGET_INDEXER][stored][dp]
            )
        # The draft: the tail layer of the target's buffers (packed), or its own (sidecar).
        dkv, dix, dl, dil = (
            (kv, ix, target.num_layers, len(ix_layers)) if packed else (buffers[2], buffers[3], 0, 0)
        )
        got = np.stack([sglang_row(dkv, layout, dl, hp * PAGE + t) for t in range(PAGE)])
        assert np.array_equal(got, tensors[C.DRAFT_LATENT][0][dp * PAGE : (dp + 1) * PAGE, 0])
        assert np.array_equal(sglang_block(dix, layout, dil, hp), tensors[C.DRAFT_INDEXER][0][dp])
    # Nothing else was written (the extra indexer page and page 0 included).
    touched = sum(int(np.count_nonzero(b)) for b in buffers)
    per_page = geometry.page_bytes
    assert touched <= len(host_pages) * per_page
    # Load back into a cleared pool through SGLang's per-layer loop.
    before = {p: page_bytes(tensors, p) for p in device_pages}
    pool.fill(0)
    done = []
    host.load_all_layers(pool, hidx, didx, io, on_layer_done=done.append)
    host.load_to_device_per_layer(pool, hidx, didx, target.num_layers, io, is_draft=True)
    device.synchronize()
    assert done == list(range(target.num_layers))
    for p in device_pages:
        assert page_bytes(tensors, p) == before[p]


class _no_warning:
    def __enter__(self):
        import warnings

        self.w = warnings.catch_warnings()
        self.w.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *a):
        return self.w.__exit__(*a)


def _retyped(buffers, layout, io):
    """SGLang turns page_first + direct into page_first_direct before allocating."""
    if layout == "page_first" and io == "direct":
        raise pytest.skip.Exception("the corrected layout is covered by the page_first_direct cases")
    return buffers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_storage_page_access_matches_sglangs_slicing_and_pointers(rng, layout):
    geometry = geometry_with_shared_indexer()
    device = kvshard.Device.cpu()
    page_num = 6
    buffers = sglang_buffers(geometry, layout, page_num, True)
    for b in buffers:
        b[...] = nonzero(rng, b.shape)
    host = MLAHostPool(device, geometry, page_num, layout, "direct" if layout == "page_first_direct" else "kernel", buffers=buffers)
    kv, ix = buffers
    index = 3 * PAGE
    page = host.get_data_page(index, flat=True)
    want = {
        "layer_first": kv[:, index : index + PAGE],
        "page_first": kv[index : index + PAGE],
        "page_first_direct": kv[3:4],
    }[layout]
    assert np.array_equal(page, want.reshape(-1))
    # set_from_flat_data_page writes a page back where get_data_page read it.
    other = host.get_data_page(4 * PAGE, flat=True).copy()
    host.set_from_flat_data_page(index, other)
    assert np.array_equal(host.get_data_page(index), other)
    # A float index is refused, never truncated to a page (operator.index, not int).
    with pytest.raises(TypeError):
        host.get_data_page(index + 0.5)
    with pytest.raises(TypeError):
        host.set_from_flat_data_page(float(index), other)
    assert np.array_equal(host.get_data_page(index), other)
    dummy = host.get_dummy_flat_data_page()
    assert dummy.size == page.size and not dummy.any()
    # get_page_buffer_meta: host pointers of SGLang's formula on the engine's own buffer.
    base = kv.ctypes.data
    D, L, size = kv.shape[-1], host.layer_num, page_num * PAGE
    ptrs, sizes = host.get_page_buffer_meta(slots([1, 4]))
    if layout == "layer_first":
        want_ptrs = [base + i * D + l * size * D for i in (PAGE, 4 * PAGE) for l in range(L)]
        want_sizes = [PAGE * D] * len(want_ptrs)
    else:
        want_ptrs = [base + i * L * D for i in (PAGE, 4 * PAGE)]
        want_sizes = [L * PAGE * D] * 2
    assert (ptrs, sizes) == (want_ptrs, want_sizes)
    # The indexer companion.
    c = host.indexer
    assert c.indexer_page_num == page_num + 1 and c.layer_num == 3
    ipage = c.get_data_page(index)
    iwant = ix[:, 3:4] if layout == "layer_first" else ix[3:4]
    assert np.array_equal(ipage, iwant.reshape(-1))
    if layout == "layer_first":
        with pytest.raises(ValueError):
            c.get_page_buffer_meta(slots([1]))
    else:
        assert c.get_page_buffer_meta(slots([1, 4])) == (
            [ix.ctypes.data + p * 3 * INDEXER for p in (1, 4)],
            [3 * INDEXER] * 2,
        )
    assert host.get_size_per_token() == L * D
    ptrs, lens, items = host.get_contiguous_buf_infos()
    assert len(ptrs) == L and items == [D * PAGE] * L


def test_the_allocator_never_hands_out_the_padding_page():
    geometry = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2), draft=True)
    host = MLAHostPool(kvshard.Device.cpu(), geometry, 4, "page_first")
    assert host.available_size() == 3 * PAGE
    got = host.alloc(3 * PAGE)
    assert sorted({int(v) // PAGE for v in got}) == [1, 2, 3]
    assert host.alloc(PAGE) is None
    assert host.free(got[:PAGE]) == PAGE and host.available_size() == PAGE
    with pytest.raises(InvalidArgumentError):
        host.alloc(10)
    # A transfer naming host page 0 is refused before anything moves.
    device = kvshard.Device.cpu()
    pool = DevicePool.allocate(device, geometry, Placement(1), 0, 4)
    with pytest.raises(InvalidArgumentError, match="reserved"):
        host.backup_from_device_all_layer(pool, slots([0]), slots([1]), "kernel")


def test_sglangs_layout_corrections():
    with pytest.warns(UserWarning):
        assert resolve_layout_io("page_first_direct", "kernel") == ("page_first_direct", "direct")
    with pytest.warns(UserWarning):
        assert resolve_layout_io("page_first", "direct") == ("page_first_direct", "direct")
    assert resolve_layout_io("layer_first", "direct") == ("layer_first", "direct")
    assert resolve_layout_io("page_first", "kernel") == ("page_first", "kernel")


def test_wrapped_host_buffers_must_have_sglangs_size():
    geometry = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2), draft=True)
    bufs = sglang_buffers(geometry, "page_first", 5, True)
    bufs[1] = np.zeros(sglang_indexer_shape("page_first", 3, 4), np.uint8)  # a page short
    with pytest.raises(ValueError, match="exactly"):
        MLAHostPool(kvshard.Device.cpu(), geometry, 5, "page_first", buffers=bufs)


def test_float_indices_are_refused_by_the_sglang_adapters():
    """Indices are integers: a float page or slot is refused (``operator.index``), never
    truncated to a neighbouring page."""
    from kvshard.sglang import pd

    whole = dict(kv_indices=np.array([2, 3]), index_slice=slice(0, 2), shard_rank=0, shard_size=2)
    assert pd.filter_kv_indices_for_shard_rank(**whole)[0].tolist() == [1]
    with pytest.raises(TypeError):
        pd.filter_kv_indices_for_shard_rank(**dict(whole, kv_indices=np.array([2.0, 3.5])))
