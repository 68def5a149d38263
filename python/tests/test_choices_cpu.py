"""Choices are enum classes, never strings: every route, method (of P/D senders, HiCache transfers and relayouts),
write policy, direction, host layout, latent layout and component is taken (and handed back)
as its ``kvshard`` enum, and a string where one is expected is a ``TypeError``. SGLang's names
stay names only in ``kvshard.sglang`` (SGLang's own interface), which maps them onto the
enums."""

import pytest

import kvshard
from conftest import PAGE

C = kvshard.Component
H = kvshard.HostLayout


def small():
    return kvshard.CacheGeometry(kvshard.PoolGeometry(kvshard.LatentLayout.FP8_TRTLLM, 2))


def test_strings_are_refused_where_an_enum_is_taken():
    g, d = small(), kvshard.Device.cpu()
    placement = kvshard.Placement(1)
    pool = kvshard.DevicePool.allocate(d, g, placement, 0, 8)
    host = kvshard.HostPool(d, g, 8, H.PAGE_FIRST)
    plan = kvshard.TransferPlan(placement, 0, [1], [1], 8, 8)
    transfer = kvshard.HostTransfer(pool, host, plan, kvshard.Direction.BACKUP)
    ctl = kvshard.HiCacheController(pool, host)
    node = kvshard.CacheNode(1, [1])
    staging = kvshard.ChunkStaging(pool, PAGE)
    for call in [
        lambda: kvshard.PoolGeometry("fp8_trtllm", 2),
        lambda: kvshard.CacheGeometry.glm5(latent="fp8_scaled"),
        lambda: pool.layer_view("target_latent", 0),
        lambda: pool.read_block_sync("target_latent", 0, 1),
        lambda: staging.write("target_latent", 0, b"\x01"),
        lambda: kvshard.HostPool(d, g, 8, "page_first"),
        lambda: host.component_buffer("target_latent"),
        lambda: kvshard.HostTransfer(pool, host, plan, "backup"),
        lambda: transfer.run(None, "kernel"),
        lambda: transfer.calls("copy_engine"),
        lambda: kvshard.HiCacheController(pool, host, "write_through"),
        lambda: ctl.backup(node, None, "copy_engine"),
        lambda: ctl.load(1, [2], None, "kernel"),
        lambda: kvshard.Sender(pool, None, "blocks"),
        lambda: kvshard.ChunkStatus.sent(1, 0, 0, True, {"target_latent": 5}),
    ]:
        with pytest.raises(TypeError):
            call()
    # Nothing above changed anything: the same calls with the enums go through.
    assert transfer.direction == kvshard.Direction.BACKUP
    transfer.run(None, kvshard.Method.COPY_ENGINE)
    assert transfer.calls(kvshard.Method.KERNEL)["launches"] == 1
    assert ctl.backup(node, None, kvshard.Route.COPY_ENGINE) == 0
    assert ctl.ack_backups_sync(1)[0].node == 1


def test_enums_come_back_from_getters_and_compare_by_identity():
    g, d = small(), kvshard.Device.cpu()
    pool = kvshard.DevicePool.allocate(d, g, kvshard.Placement(1), 0, 8)
    host = kvshard.HostPool(d, g, 8, H.LAYER_FIRST)
    ctl = kvshard.HiCacheController(pool, host, kvshard.WritePolicy.WRITE_BACK)
    assert ctl.policy == kvshard.WritePolicy.WRITE_BACK
    assert ctl.policy != kvshard.WritePolicy.WRITE_THROUGH
    assert host.layout == H.LAYER_FIRST and g.target.latent == kvshard.LatentLayout.FP8_TRTLLM
    # Write-back backs nothing up on access.
    assert ctl.access(kvshard.CacheNode(1, [1]), None, kvshard.Route.KERNEL) is None
    # Hashable: usable as dict keys, as the per-component byte counts are.
    assert {kvshard.Route.STAGED: 1}[kvshard.Route.STAGED] == 1
    assert [int(r) for r in [kvshard.Route.KERNEL, kvshard.Route.STAGED_KERNEL]] == [0, 5]


def test_sglang_layout_names_map_onto_the_enum():
    for layout in [H.LAYER_FIRST, H.PAGE_FIRST, H.PAGE_FIRST_DIRECT]:
        assert H.from_name(str(layout)) == layout
    assert str(H.PAGE_FIRST_DIRECT) == "page_first_direct"
    with pytest.raises(kvshard.InvalidArgumentError, match="host layout"):
        H.from_name("page-first")


def test_per_component_bytes_are_keyed_by_component():
    g, d = small(), kvshard.Device.cpu()
    unsharded = kvshard.Placement(1)
    src = kvshard.DevicePool.allocate(d, g, unsharded, 0, 8)
    dst = kvshard.DevicePool.allocate(d, g, unsharded, 0, 8)
    reg = kvshard.Registration(1, kvshard.PoolLayout.of(dst), [1], [1])
    M = kvshard.Method
    for method in [M.KERNEL, M.RANGE_KERNEL, M.COPY_ENGINE, M.PER_BLOCK]:
        sender = kvshard.Sender(src, None, method)
        sender.open(reg, kvshard.RemoteSpace.of(dst))
        status = sender.send(1, [1], PAGE, last=True).wait_sync()
        assert list(status.bytes) == [C.TARGET_LATENT, C.TARGET_INDEXER]
        assert status.bytes[C.TARGET_LATENT] == 2 * PAGE * 576
        assert sender.bytes_sent == status.bytes
    again = kvshard.ChunkStatus.sent(1, 0, 0, True, status.bytes)
    assert again.bytes == status.bytes and again.bytes[C.TARGET_INDEXER] > 0


def test_one_method_enum_every_route_takes_and_refuses_what_it_cannot_run():
    g, d = small(), kvshard.Device.cpu()
    placement = kvshard.Placement(1)
    pool = kvshard.DevicePool.allocate(d, g, placement, 0, 8)
    host = kvshard.HostPool(d, g, 8, H.PAGE_FIRST)
    plan = kvshard.TransferPlan(placement, 0, [1], [1], 8, 8)
    transfer = kvshard.HostTransfer(pool, host, plan, kvshard.Direction.BACKUP)
    M = kvshard.Method
    # P/D senders: everything but the batched copy engine, refused when the sender is made.
    with pytest.raises(kvshard.InvalidArgumentError, match="P/D transport cannot move bytes with batched copy engine"):
        kvshard.Sender(pool, None, M.BATCHED_COPY_ENGINE)
    # HiCache direct: everything but the range kernel.
    with pytest.raises(kvshard.InvalidArgumentError, match="direct HiCache transfer"):
        transfer.run(None, M.RANGE_KERNEL)
    with pytest.raises(kvshard.InvalidArgumentError, match="direct HiCache transfer"):
        transfer.calls(M.RANGE_KERNEL)
    for m in [M.COPY_ENGINE, M.BATCHED_COPY_ENGINE, M.PER_BLOCK]:
        transfer.run(None, m)
    # Staged relayouts: the kernel or the copy engine.
    staging = transfer.staging(2)
    for m in [M.RANGE_KERNEL, M.BATCHED_COPY_ENGINE, M.PER_BLOCK]:
        with pytest.raises(kvshard.InvalidArgumentError, match="relayout of a staged HiCache transfer"):
            transfer.run_staged(staging, None, None, m)
    transfer.run_staged(staging, None, None, M.COPY_ENGINE)


def test_staging_is_made_up_front_once():
    g, d = small(), kvshard.Device.cpu()
    pool = kvshard.DevicePool.allocate(d, g, kvshard.Placement(1), 0, 8)
    host = kvshard.HostPool(d, g, 8, H.PAGE_FIRST)
    ctl = kvshard.HiCacheController(pool, host)
    assert ctl.staging_bytes == 0
    ctl.prepare_staging()
    made = ctl.staging_bytes
    assert made > 0
    ctl.prepare_staging()
    assert ctl.staging_bytes == made
    with pytest.raises(ValueError):
        ctl.set_staging_pages(0)
    assert ctl.staging_bytes == made
