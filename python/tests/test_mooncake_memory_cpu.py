"""kvshard memory with Mooncake on the CPU: every kind (device pools, HiCache host pools, chunk
staging, bounce buffers) registered once and reused, a host pool serving several transfers over
the engine's TCP transport on the loopback, typed errors for a second registration and for
unregistered memory; and the bounce slots of a sender: chunks take turns in them, and a slot is
reused only once its chunk's transfer was reported and the decode side freed it.

The registration tests run on ``KVSHARD_MC_DEVICE`` (default the CPU; the GPU step,
``run-gpu.sh mooncake``, runs them on VRAM pools and pinned host pools with the CUDA engine);
the slot tests move bytes by hand, on the CPU. The engine tests need ``mooncake.engine`` (``mooncake-transfer-engine-non-cuda``): without it
they say SKIPPED, or fail when ``KVSHARD_REQUIRE_MOONCAKE`` is set (CI sets it)."""

import ctypes
import random
import sys
import threading
import time
from pathlib import Path

import pytest

import kvshard
from kvshard import mooncake

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mooncake_procs as procs  # noqa: E402
from test_mooncake_cpu import copy_by_hand, mooncake_loads  # noqa: E402

HOST_PAGES = 8


def memory_of_every_kind(dev):
    """A device pool, a host pool (page-first, one span per page and buffer), a host pool
    (layer-first: a span per layer), chunk staging and a bounce buffer, all on ``dev``."""
    g = procs.geometry()
    pool = kvshard.pool.DevicePool.allocate(dev, g, kvshard.shard.Placement(1), 0, 16, registrable=True)
    return {
        "pool": pool,
        "host": kvshard.pool.HostPool(dev, g, HOST_PAGES, kvshard.pool.HostLayout.PAGE_FIRST),
        "host_layer_first": kvshard.pool.HostPool(dev, g, HOST_PAGES, kvshard.pool.HostLayout.LAYER_FIRST),
        "staging": kvshard.pool.ChunkStaging(pool, 128),
        "bounce": kvshard.transfer.BounceBuffer(dev, g, 4),
    }


def test_engine_regions_cover_each_kind_of_memory_and_refuse_anything_else():
    dev = procs.device()
    m = memory_of_every_kind(dev)
    spans = {k: kvshard.transfer.engine_regions(v) for k, v in m.items()}
    assert spans["pool"] == kvshard.transfer.engine_memory(m["pool"])[0]
    assert spans["bounce"] == [(m["bounce"].address, m["bounce"].bytes)]
    for name in ("host", "host_layer_first"):
        h = m[name]
        assert sum(n for _, n in spans[name]) >= sum(b.bytes for b in h.buffer_layouts())
        # Every page of every buffer lies in the regions (what transfers read and write).
        for i in range(len(h.buffer_layouts())):
            for a, n in h.page_pointers(i, HOST_PAGES - 1):
                assert any(s <= a and a + n <= s + l for s, l in spans[name]), name
    # Disjoint: each kind is its own allocation.
    flat = sorted(r for v in spans.values() for r in v)
    assert all(a + n <= b for (a, n), (b, _) in zip(flat, flat[1:]))
    with pytest.raises(kvshard.error.InvalidArgumentError):
        kvshard.transfer.engine_regions(object())


def test_every_kind_of_kvshard_memory_registers_once_and_is_reused():
    mooncake_loads()
    dev = procs.device()
    m = memory_of_every_kind(dev)
    e = mooncake.Engine()
    try:
        for v in m.values():
            assert e.register(v) == kvshard.transfer.engine_regions(v)
        regions = e.regions
        assert len(regions) == sum(len(kvshard.transfer.engine_regions(v)) for v in m.values())
        for name, v in m.items():
            # A second registration, of the whole or of a part, is refused, typed.
            with pytest.raises(mooncake.AlreadyRegisteredError, match="register each piece of memory once"):
                e.register(v)
            a, n = kvshard.transfer.engine_regions(v)[0]
            with pytest.raises(mooncake.AlreadyRegisteredError):
                e.register((a + n // 2, n))
            # ensure reuses it.
            assert not e.ensure(v), name
        assert e.regions == regions
        # Unregistered: refused, typed, and nothing else unregistered.
        e.unregister(m["host"])
        with pytest.raises(mooncake.NotRegisteredError):
            e.unregister(m["host"])
        assert len(e.regions) == len(regions) - len(kvshard.transfer.engine_regions(m["host"]))
        assert e.ensure(m["host"]) and e.regions == regions
        with pytest.raises(kvshard.error.InvalidArgumentError):
            e.register((0, 4096))
    finally:
        e.close()
    assert e.regions == []


def fill_random(host, seed):
    """Random bytes in every page of every buffer of ``host`` (through its host addresses)."""
    rng = random.Random(seed)
    for i in range(len(host.buffer_layouts())):
        for p in range(HOST_PAGES):
            for a, n in host.page_pointers(i, p):
                ctypes.memmove(a, rng.randbytes(n), n)


def page_bytes(host, page):
    return b"".join(
        ctypes.string_at(a, n) for i in range(len(host.buffer_layouts())) for a, n in host.page_pointers(i, page)
    )


@pytest.mark.parametrize("layout", ["PAGE_FIRST", "LAYER_FIRST"])
def test_a_host_pool_registered_once_serves_several_transfers(layout):
    mooncake_loads()
    dev = procs.device()
    g = procs.geometry()
    lay = getattr(kvshard.pool.HostLayout, layout)
    src_host = kvshard.pool.HostPool(dev, g, HOST_PAGES, lay)
    dst_host = kvshard.pool.HostPool(dev, g, HOST_PAGES, lay)
    fill_random(src_host, 3)
    dst_host.fill(0)
    dev.synchronize()
    a, b = mooncake.Engine(), mooncake.Engine()
    try:
        a.register(src_host)
        b.register(dst_host)
        registered = (a.regions, b.regions)
        moves = [{1: 6}, {0: 2, 3: 5}, {7: 0, 4: 4, 2: 1}]
        for move in moves:
            src, dst, lens = [], [], []
            for s, d in move.items():
                for i in range(len(src_host.buffer_layouts())):
                    for (sa, n), (da, m) in zip(src_host.page_pointers(i, s), dst_host.page_pointers(i, d)):
                        assert n == m
                        src.append(sa)
                        dst.append(da)
                        lens.append(n)
            # The same registration again: reused, not registered anew.
            assert not a.ensure(src_host) and not b.ensure(dst_host)
            a.write_sync(b.address, src, dst, lens)
            for s, d in move.items():
                assert page_bytes(dst_host, d) == page_bytes(src_host, s), (s, d)
        assert (a.regions, b.regions) == registered
        # Memory no registration covers is refused before the engine is called: nothing moves.
        loose = ctypes.create_string_buffer(b"\x77" * 4096, 4096)
        before = page_bytes(dst_host, 3)
        da = dst_host.page_pointers(0, 3)[0][0]
        with pytest.raises(mooncake.NotRegisteredError):
            a.write_sync(b.address, [ctypes.addressof(loose)], [da], [4096])
        # A range that starts inside the registration and runs past its end: refused too.
        end = max(s + n for s, n in a.regions)
        with pytest.raises(mooncake.NotRegisteredError):
            a.write_sync(b.address, [end - 16], [da], [64])
        assert page_bytes(dst_host, 3) == before
        with pytest.raises(kvshard.error.InvalidArgumentError):
            a.write_sync(b.address, [1, 2], [3], [4])
    finally:
        a.close()
        b.close()


def test_a_transport_reuses_what_its_engine_holds_and_unregisters_only_its_own():
    mooncake_loads()
    dev = procs.device()
    pool = procs.decode_pool(dev)
    host = kvshard.pool.HostPool(dev, pool.geometry, HOST_PAGES, kvshard.pool.HostLayout.PAGE_FIRST)
    e = mooncake.Engine()
    try:
        e.register(pool)
        e.register(host)
        dec = mooncake.MooncakeDecode(pool, 2, engine=e, bounce_pages=4, bounce_slots=3)
        # The pool reused; two ranks x three slots of bounce buffers registered once each.
        assert len(dec.bounces) == 2 and all(len(b) == 3 for b in dec.bounces)
        for bs in dec.bounces:
            for address, length in bs:
                assert e.covers(address, length)
                with pytest.raises(mooncake.AlreadyRegisteredError):
                    e.register((address, length))
        dec.close()
        # The engine's own registrations stay; the transport's went.
        assert not e.ensure(pool) and not e.ensure(host)
        assert not any(e.covers(a, n) for bs in dec.bounces for a, n in bs)
    finally:
        e.close()


SLOT_PAGES = 16


def sender_with_slots(dev, dst, slots, bounces, rank=0, **kw):
    _, bases = kvshard.transfer.engine_memory(dst)
    pool, keep = procs.prefill_pool(dev, 7, rank)
    sender = kvshard.transfer.MooncakeSender(
        pool,
        bases,
        procs.DECODE_PAGES,
        mode=kvshard.transfer.MooncakeMode.BOUNCE,
        bounce_pages=SLOT_PAGES,
        decode_bounces=[(b.address, b.bytes) for b in bounces[:slots]],
        **kw,
    )
    return sender, keep


def test_bounce_slots_take_turns_and_a_slot_is_reused_only_after_its_transfer():
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    for rank in range(procs.N):
        send_with_two_slots(dev, dst, rank)
    assert dst.snapshot_sync() == procs.reference(7)


def send_with_two_slots(dev, dst, rank):
    """Sends every request of rank ``rank`` with two bounce slots, keeping chunks on the wire
    (not landed) while the next ones are packed."""
    bounces = [kvshard.transfer.BounceBuffer(dev, dst.geometry, SLOT_PAGES) for _ in range(2)]
    sender, _keep = sender_with_slots(dev, dst, 2, bounces, rank)
    assert sender.bounce_slots == 2 and sender.bounce_slots_free == 2
    assert len(sender.bounce_regions) == 2
    in_flight = []  # bounced chunks sent, not yet landed and scattered
    overlapped = 0
    fell_back = 0

    def finish(chunk):
        """Moves, reports and scatters a chunk once its packing has run (the CPU twin's
        streams run adversarially late here, as a GPU's may); frees its slot (as the decode
        side does)."""
        end = time.monotonic() + 10
        while not chunk.ready():
            assert time.monotonic() < end, "the packing never ran"
            time.sleep(0.001)
        copy_by_hand(chunk)
        chunk.posted(0.0)
        if chunk.bounced:
            with pytest.raises(kvshard.error.InvalidArgumentError, match="not reported"):
                sender.bounce_free(chunk.slot)  # on the wire: the engine may still read it
        chunk.landed(0.0)
        status = chunk.poll()
        assert status is not None and status.ok
        if chunk.bounced:
            bounces[chunk.slot].scatter(chunk.sections, dst).synchronize()
            sender.bounce_free(chunk.slot)
            with pytest.raises(kvshard.error.InvalidArgumentError, match="free already"):
                sender.bounce_free(chunk.slot)

    for reg, src, chunks in procs.requests(7):
        sender.open(reg)
        for end, last in chunks:
            chunk = sender.send(reg.request, src, end, last=last)
            if chunk.bounced:
                assert chunk.descriptors == 1 and chunk.dst_addrs == [bounces[chunk.slot].address]
                # A slot another chunk on the wire holds is never packed into.
                assert chunk.slot not in [c.slot for c in in_flight]
                overlapped += bool(in_flight)
                in_flight.append(chunk)
            elif chunk.descriptors:
                # Both slots held by chunks on the wire: this one went coalesced.
                fell_back += len(in_flight) == 2
                finish(chunk)
            else:
                finish(chunk)
            assert sender.bounce_slots_free == 2 - len(in_flight)
            # Both slots stay held until a chunk has found them so; then the oldest lands.
            if len(in_flight) == 2 and fell_back:
                finish(in_flight.pop(0))
    while in_flight:
        finish(in_flight.pop(0))
    assert overlapped > 0, "no chunk packed into one slot while another was on the wire"
    assert fell_back > 0, "no chunk found both slots held"
    with pytest.raises(kvshard.error.InvalidArgumentError):
        sender.bounce_free(2)


def test_a_bounce_slot_of_a_chunk_past_its_deadline_frees_only_once_the_engine_is_done():
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    bounces = [kvshard.transfer.BounceBuffer(dev, dst.geometry, SLOT_PAGES)]
    sender, _keep = sender_with_slots(dev, dst, 1, bounces, transfer_timeout=0.05)
    reg, src, chunks = procs.requests(7)[0]
    sender.open(reg)
    chunk = sender.send(reg.request, src, chunks[0][0], last=False)
    assert chunk.bounced and chunk.slot == 0
    time.sleep(0.1)
    with pytest.raises(kvshard.error.ChunkFailedError):
        chunk.poll()
    # Failed by its deadline, but the engine was never heard from: it may still read the slot.
    with pytest.raises(kvshard.error.InvalidArgumentError, match="not reported"):
        sender.bounce_free(0)
    assert sender.bounce_slots_free == 0
    chunk.failed("the engine gave up")
    sender.bounce_free(0)
    assert sender.bounce_slots_free == 1


def test_a_coalesced_sender_has_no_slots():
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    bounces = [kvshard.transfer.BounceBuffer(dev, dst.geometry, SLOT_PAGES)]
    _, bases = kvshard.transfer.engine_memory(dst)
    pool, _keep = procs.prefill_pool(dev, 7, 0)
    sender = kvshard.transfer.MooncakeSender(
        pool, bases, procs.DECODE_PAGES, mode=kvshard.transfer.MooncakeMode.COALESCED,
        decode_bounces=[(bounces[0].address, bounces[0].bytes)],
    )
    assert sender.bounce_slots == 0 and sender.bounce_regions == []


def test_the_readme_sglang_example_moves_a_request():
    """README's "In SGLang's terms" example, as written there (the raw engine, one per side,
    over TCP on the loopback), for every request of both ranks: byte-identical."""
    mooncake_loads()
    TransferEngine = mooncake.load_engine_class()
    dev = kvshard.Device.cpu()
    geometry = procs.geometry()
    decode_pages = procs.DECODE_PAGES
    decode_host = "127.0.0.1"
    decode_pool = procs.decode_pool(dev)
    te = TransferEngine()
    assert te.initialize(decode_host, "P2PHANDSHAKE", "tcp", "") == 0
    regions, bases = kvshard.transfer.engine_memory(decode_pool)
    bounce = kvshard.transfer.BounceBuffer(decode_pool.device, decode_pool.geometry, 64)
    for addr, length in regions + kvshard.transfer.engine_regions(bounce):
        assert te.register_memory(addr, length) == 0
    decode_session = f"{decode_host}:{te.get_rpc_port()}"
    bounced = 0
    for rank in range(procs.N):
        prefill_pool, _keep = procs.prefill_pool(dev, 7, rank)
        te_prefill = TransferEngine()
        assert te_prefill.initialize(decode_host, "P2PHANDSHAKE", "tcp", "") == 0
        sender = kvshard.transfer.MooncakeSender(prefill_pool, bases, decode_pages, mode=kvshard.transfer.MooncakeMode.AUTO,
                                        decode_bounces=[(bounce.address, bounce.bytes)])
        for addr, length in kvshard.transfer.engine_regions(prefill_pool) + sender.bounce_regions:
            assert te_prefill.register_memory(addr, length) == 0
        for reg, prefill_pages, chunks in procs.requests(7):
            rid = reg.request
            decode_kv_pages, decode_state_pages = reg.pages, reg.state_pages
            sender.open(kvshard.transfer.Registration(rid, kvshard.pool.PoolLayout.packed(geometry, decode_pages),
                                             decode_kv_pages, decode_state_pages, reg.prefix_pages))
            for tokens_so_far, is_last in chunks:
                chunk = sender.send(rid, prefill_pages, tokens_so_far, last=is_last)
                end = time.monotonic() + 10
                while not chunk.ready():
                    assert time.monotonic() < end
                    time.sleep(0)
                t0 = time.perf_counter()
                rc = 0
                src, dst, lens = chunk.src_addrs, chunk.dst_addrs, chunk.lengths
                for i in range(0, len(lens), 512):
                    rc = rc or te_prefill.batch_transfer_sync_write(decode_session, src[i:i + 512],
                                                                    dst[i:i + 512], lens[i:i + 512])
                chunk.posted(0.0)
                if rc == 0:
                    chunk.landed(time.perf_counter() - t0)
                else:
                    chunk.failed(f"batch_transfer_sync_write returned {rc}")
                status = chunk.poll()
                assert status is not None and status.ok, rc
                if chunk.bounced:
                    bounce.scatter(chunk.sections, decode_pool).synchronize()
                    sender.bounce_free(chunk.slot)
                    bounced += 1
        for addr, _ in kvshard.transfer.engine_regions(prefill_pool) + sender.bounce_regions:
            te_prefill.unregister_memory(addr)
    for addr, _ in regions + kvshard.transfer.engine_regions(bounce):
        te.unregister_memory(addr)
    assert bounced > 0
    assert decode_pool.snapshot_sync() == procs.reference(7)


def test_a_prefill_frees_the_slot_of_a_chunk_past_its_deadline_only_once_the_engine_is_done():
    """The transport's side of the asynchronous contract: a bounced chunk fails by its deadline
    while the engine still moves it (its completion held back here); its status is delivered at
    once, but its slot stays held until the engine is done with it, then is freed."""
    mooncake_loads()
    dev = kvshard.Device.cpu()
    g = procs.geometry()
    decode_pool = kvshard.pool.DevicePool.allocate(dev, g, kvshard.shard.Placement(1), 0, 16, registrable=True)
    pool = kvshard.pool.DevicePool.allocate(dev, g, kvshard.shard.Placement(1), 0, 8, registrable=True)
    pool.fill(0x5A)
    dev.synchronize()
    dec = mooncake.MooncakeDecode(decode_pool, 1, bounce_pages=4, bounce_slots=1)
    t = threading.Thread(target=dec.accept_sync)
    t.start()
    pre = mooncake.MooncakePrefill(pool, dec.address, mode=kvshard.transfer.MooncakeMode.BOUNCE, bounce_pages=4,
                                   transfer_timeout=0.3)
    t.join()
    try:
        gate = threading.Event()
        real_rest = pre._rest

        def held(*args):
            gate.wait(10)  # the engine "still moving": its completion is held back
            return real_rest(*args)

        pre._rest = held
        reg = kvshard.transfer.Registration(1, kvshard.pool.PoolLayout.packed(g, 16), [1, 2, 3, 4], [5, 6, 7, 8])
        dec.register(reg)
        end = time.monotonic() + 10
        while not pre.take_registrations():
            assert time.monotonic() < end
            time.sleep(0.001)
        chunk = pre.send(1, [1, 2, 3, 4], 4 * kvshard.geometry.PAGE_SIZE, last=True)
        assert chunk.bounced and chunk.slot == 0
        statuses = []
        while not statuses:
            assert time.monotonic() < end, "the chunk never failed by its deadline"
            statuses += pre.progress()
            time.sleep(0.005)
        assert not statuses[0].ok
        # Failed and delivered, but the engine may still read the slot: it stays held.
        time.sleep(0.05)
        assert pre.sender.bounce_slots_free == 0
        with pytest.raises(kvshard.error.InvalidArgumentError):
            pre.sender.bounce_free(0)
        gate.set()
        while pre.sender.bounce_slots_free != 1:
            assert time.monotonic() < end, "the slot was never freed once the engine was done"
            time.sleep(0.005)
    finally:
        gate.set()
        pre.close()
        dec.close()
