"""Choices are enum classes, never strings: every route, method (of P/D senders, HiCache transfers and relayouts),
write policy, direction, host layout, latent layout and component is taken (and handed back)
as its ``kvshard`` enum, and a string where one is expected is a ``TypeError``. SGLang's names
stay names only in ``kvshard.sglang`` (SGLang's own interface), which maps them onto the
enums."""

import pytest

import kvshard
from kvshard.copy import Direction, Method, RemoteSpace
from kvshard.error import InvalidArgumentError
from kvshard.geometry import CacheGeometry, Component, LatentLayout, PoolGeometry
from kvshard.hicache import (
    CacheNode,
    HiCacheController,
    HostTransfer,
    Route,
    TransferPlan,
    WritePolicy,
)
from kvshard.pool import ChunkStaging, DevicePool, HostLayout, HostPool, PoolLayout
from kvshard.shard import Placement
from kvshard.transfer import ChunkStatus, Registration, Sender
from conftest import PAGE

C = Component
H = HostLayout


def small():
    return CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 2))


def test_strings_are_refused_where_an_enum_is_taken():
    g, d = small(), kvshard.Device.cpu()
    placement = Placement(1)
    pool = DevicePool.allocate(d, g, placement, 0, 8)
    host = HostPool(d, g, 8, H.PAGE_FIRST)
    plan = TransferPlan(placement, 0, [1], [1], 8, 8)
    transfer = HostTransfer(pool, host, plan, Direction.BACKUP)
    ctl = HiCacheController(pool, host)
    node = CacheNode(1, [1])
    staging = ChunkStaging(pool, PAGE)
    for call in [
        lambda: PoolGeometry("fp8_trtllm", 2),
        lambda: CacheGeometry.glm5(latent="fp8_scaled"),
        lambda: pool.layer_view("target_latent", 0),
        lambda: pool.read_block_sync("target_latent", 0, 1),
        lambda: staging.write("target_latent", 0, b"\x01"),
        lambda: HostPool(d, g, 8, "page_first"),
        lambda: host.component_buffer("target_latent"),
        lambda: HostTransfer(pool, host, plan, "backup"),
        lambda: transfer.run(None, "kernel"),
        lambda: transfer.calls("copy_engine"),
        lambda: HiCacheController(pool, host, "write_through"),
        lambda: ctl.backup(node, None, "copy_engine"),
        lambda: ctl.load(1, [2], None, "kernel"),
        lambda: Sender(pool, None, "blocks"),
        lambda: ChunkStatus.sent(1, 0, 0, True, {"target_latent": 5}),
    ]:
        with pytest.raises(TypeError):
            call()
    # Nothing above changed anything: the same calls with the enums go through.
    assert transfer.direction == Direction.BACKUP
    transfer.run(None, Method.COPY_ENGINE)
    assert transfer.calls(Method.KERNEL)["launches"] == 1
    assert ctl.backup(node, None, Route.COPY_ENGINE) == 0
    assert ctl.ack_backups_sync(1)[0].node == 1


def test_enums_come_back_from_getters_and_compare_by_identity():
    g, d = small(), kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, 8)
    host = HostPool(d, g, 8, H.LAYER_FIRST)
    ctl = HiCacheController(pool, host, WritePolicy.WRITE_BACK)
    assert ctl.policy == WritePolicy.WRITE_BACK
    assert ctl.policy != WritePolicy.WRITE_THROUGH
    assert host.layout == H.LAYER_FIRST and g.target.latent == LatentLayout.FP8_TRTLLM
    # Write-back backs nothing up on access.
    assert ctl.access(CacheNode(1, [1]), None, Route.KERNEL) is None
    # Hashable: usable as dict keys, as the per-component byte counts are.
    assert {Route.STAGED: 1}[Route.STAGED] == 1
    assert [int(r) for r in [Route.KERNEL, Route.STAGED_KERNEL]] == [0, 5]


def test_sglang_layout_names_map_onto_the_enum():
    for layout in [H.LAYER_FIRST, H.PAGE_FIRST, H.PAGE_FIRST_DIRECT]:
        assert H.from_name(str(layout)) == layout
    assert str(H.PAGE_FIRST_DIRECT) == "page_first_direct"
    with pytest.raises(InvalidArgumentError, match="host layout"):
        H.from_name("page-first")


def test_per_component_bytes_are_keyed_by_component():
    g, d = small(), kvshard.Device.cpu()
    unsharded = Placement(1)
    src = DevicePool.allocate(d, g, unsharded, 0, 8)
    dst = DevicePool.allocate(d, g, unsharded, 0, 8)
    reg = Registration(1, PoolLayout.of(dst), [1], [1])
    M = Method
    for method in [M.KERNEL, M.RANGE_KERNEL, M.COPY_ENGINE, M.PER_BLOCK]:
        sender = Sender(src, None, method)
        sender.open(reg, RemoteSpace.of(dst))
        status = sender.send(1, [1], PAGE, last=True).wait_sync()
        assert list(status.bytes) == [C.TARGET_LATENT, C.TARGET_INDEXER]
        assert status.bytes[C.TARGET_LATENT] == 2 * PAGE * 576
        assert sender.bytes_sent == status.bytes
    again = ChunkStatus.sent(1, 0, 0, True, status.bytes)
    assert again.bytes == status.bytes and again.bytes[C.TARGET_INDEXER] > 0


def test_one_method_enum_every_route_takes_and_refuses_what_it_cannot_run():
    g, d = small(), kvshard.Device.cpu()
    placement = Placement(1)
    pool = DevicePool.allocate(d, g, placement, 0, 8)
    host = HostPool(d, g, 8, H.PAGE_FIRST)
    plan = TransferPlan(placement, 0, [1], [1], 8, 8)
    transfer = HostTransfer(pool, host, plan, Direction.BACKUP)
    M = Method
    # P/D senders: everything but the batched copy engine, refused when the sender is made.
    with pytest.raises(InvalidArgumentError, match="P/D transport cannot move bytes with batched copy engine"):
        Sender(pool, None, M.BATCHED_COPY_ENGINE)
    # HiCache direct: everything but the range kernel.
    with pytest.raises(InvalidArgumentError, match="direct HiCache transfer"):
        transfer.run(None, M.RANGE_KERNEL)
    with pytest.raises(InvalidArgumentError, match="direct HiCache transfer"):
        transfer.calls(M.RANGE_KERNEL)
    for m in [M.COPY_ENGINE, M.BATCHED_COPY_ENGINE, M.PER_BLOCK]:
        transfer.run(None, m)
    # Staged relayouts: the kernel or the copy engine.
    staging = transfer.staging(2)
    for m in [M.RANGE_KERNEL, M.BATCHED_COPY_ENGINE, M.PER_BLOCK]:
        with pytest.raises(InvalidArgumentError, match="relayout of a staged HiCache transfer"):
            transfer.run_staged(staging, None, None, m)
    transfer.run_staged(staging, None, None, M.COPY_ENGINE)


def test_staging_is_made_up_front_once():
    g, d = small(), kvshard.Device.cpu()
    pool = DevicePool.allocate(d, g, Placement(1), 0, 8)
    host = HostPool(d, g, 8, H.PAGE_FIRST)
    ctl = HiCacheController(pool, host)
    assert ctl.staging_bytes == 0
    ctl.prepare_staging()
    made = ctl.staging_bytes
    assert made > 0
    ctl.prepare_staging()
    assert ctl.staging_bytes == made
    with pytest.raises(ValueError):
        ctl.set_staging_pages(0)
    assert ctl.staging_bytes == made
