"""P/D over Mooncake's transfer engine on the CPU: the descriptor export in one process (the
lists copied by hand, as an engine's own Mooncake path would post them), and the transport
across processes (``mooncake_procs.py``: a decode process and N = 2 prefill processes, DRAM
pools, Mooncake's TCP transport on the loopback), byte-identical to the in-process reference,
in every mode; then a prefill process killed mid-transfer, and a decode process killed
mid-transfer.

The process tests need ``mooncake.engine`` (the ``mooncake-transfer-engine-non-cuda`` wheel
and libibverbs/libnuma): without it they say SKIPPED, or fail when ``KVSHARD_REQUIRE_MOONCAKE``
is set (CI sets it)."""

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvshard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mooncake_procs as procs  # noqa: E402

#: How soon after a kill the other side must have failed what the dead process owed: the
#: side channel's end is seen at once; margin for a loaded 2-core machine.
FAILED_WITHIN = 5.0
#: The prefill's transfer timeout in the decode-kill test.
TRANSFER_TIMEOUT = 5.0


def mooncake_loads():
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        if os.environ.get("KVSHARD_REQUIRE_MOONCAKE"):
            pytest.fail(f"KVSHARD_REQUIRE_MOONCAKE is set and mooncake.engine does not load: {e}")
        pytest.skip(f"SKIPPED: mooncake.engine does not load ({e}); pip install mooncake-transfer-engine-non-cuda")


def run_processes(tmp_path, mode, decode_role="decode", prefill1_role="prefill", env_extra=None):
    """Starts the decode and both prefill processes; waits (bounded) for their reports."""
    env = dict(os.environ, KVSHARD_MC_MODE=mode, GLOG_minloglevel="2", **(env_extra or {}))
    script = str(HERE / "mooncake_procs.py")
    seed = 7
    logs = []
    procs_ = []

    def start(*args):
        log = open(tmp_path / f"{args[0]}-{len(procs_)}.log", "w")
        logs.append(log)
        procs_.append(
            subprocess.Popen([sys.executable, script, args[0], str(tmp_path), str(seed), *args[1:]], env=env, stdout=log, stderr=subprocess.STDOUT)
        )

    start(decode_role)
    start("prefill", "0")
    start(prefill1_role, "1")
    try:
        end = time.monotonic() + 120
        for p in procs_:
            p.wait(timeout=max(end - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs_:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()

    def read(name):
        f = tmp_path / f"{name}.json"
        if not f.exists():
            text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))
            pytest.fail(f"{name} wrote no report; logs:\n{text}")
        return json.loads(f.read_text())

    return read


@pytest.mark.parametrize("mode", ["auto", "coalesced", "bounce"])
def test_mooncake_loopback_decode_and_two_prefill_processes_match_the_reference(tmp_path, mode):
    mooncake_loads()
    read = run_processes(tmp_path, mode)
    decode = read("decode-0")
    assert decode["identical"], "the decode pool differs from the in-process reference"
    assert sorted(decode["results"]) == ["1", "2", "3", "4", "5"]
    assert all(r["completed"] for r in decode["results"].values()), decode["results"]
    assert decode["overdue"] == [] and decode["pending"] == 0
    for rank in range(procs.N):
        pre = read(f"prefill-{rank}")
        assert pre["errors"] == [] and all(pre["statuses"]) and len(pre["statuses"]) == 9
        stats = pre["stats"]
        assert stats["chunks"] == stats["posts"] == stats["transfers"] == 9
        assert stats["failed_transfers"] == 0
        assert (stats["bounced_chunks"] > 0) == (mode != "coalesced"), stats
    # The one-page request: rank 1 owns nothing of it, its final chunk is empty.
    assert read("prefill-1")["stats"]["empty_chunks"] >= 1


def test_mooncake_a_killed_prefill_fails_its_requests_on_the_decode_side(tmp_path):
    mooncake_loads()
    read = run_processes(tmp_path, "auto", prefill1_role="prefill-die")
    decode = read("decode-0")
    killed = read("killed-1")["at"]
    results = decode["results"]
    # Every request comes back (its pages handed back: nothing leaks), none overdue.
    assert sorted(results) == ["1", "2", "3", "4", "5"] and decode["pending"] == 0
    assert decode["overdue"] == []
    reqs = {reg.request: reg for reg, _, _ in procs.requests(7)}
    for request, r in results.items():
        reg = reqs[int(request)]
        assert r["pages_back"] == len(reg.pages) + len(reg.state_pages)
    # The request rank 1 died in fails, naming rank 1 only (rank 0's statuses all arrived).
    failed = {int(k): r for k, r in results.items() if not r["completed"]}
    assert procs.DIES_IN in failed
    for r in failed.values():
        assert {f[0] for f in r["failures"]} == {1}, r
        assert r["at"] - killed < FAILED_WITHIN, f"handed back {r['at'] - killed:.2f} s after the kill"
    pre0 = read("prefill-0")
    assert all(pre0["statuses"]) and len(pre0["statuses"]) == 9


def test_mooncake_a_killed_decode_fails_the_prefills_chunks_by_their_deadline(tmp_path):
    mooncake_loads()
    read = run_processes(
        tmp_path, "auto", decode_role="decode-die", env_extra={"KVSHARD_MC_TIMEOUT": str(TRANSFER_TIMEOUT), "KVSHARD_MC_PACE": "0.2"}
    )
    killed = read("killed-0")["at"]
    failures = 0
    for rank in range(procs.N):
        pre = read(f"prefill-{rank}")
        assert pre["gone"], "the prefill did not see the decode side gone"
        failures += pre["statuses"].count(False) + len(pre["errors"])
        assert pre["at"] - killed < TRANSFER_TIMEOUT + FAILED_WITHIN, f"done {pre['at'] - killed:.2f} s after the kill"
    assert failures > 0, "no chunk failed though the decode died mid-transfer"


def copy_by_hand(chunk):
    """Moves a chunk's descriptors as an engine would (memmove between process addresses)."""
    for s, d, n in zip(chunk.src_addrs, chunk.dst_addrs, chunk.lengths):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("mode", ["coalesced", "bounce"])
def test_the_descriptor_export_moved_by_hand_matches_the_reference(mode):
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    regions, bases = kvshard.transfer.engine_memory(dst)
    assert regions and len(bases) == len(dst.geometry.components())
    bounce = kvshard.transfer.BounceBuffer(dev, dst.geometry, procs.BOUNCE_PAGES)
    m = kvshard.transfer.MooncakeMode.COALESCED if mode == "coalesced" else kvshard.transfer.MooncakeMode.BOUNCE
    bounced = 0
    for rank in range(procs.N):
        pool, _keep = procs.prefill_pool(dev, 7, rank)
        sender = kvshard.transfer.MooncakeSender(
            pool, bases, procs.DECODE_PAGES, mode=m, bounce_pages=procs.BOUNCE_PAGES,
            decode_bounces=[(bounce.address, bounce.bytes)],
        )
        for reg, src, chunks in procs.requests(7):
            sender.open(reg)
            for end, last in chunks:
                chunk = sender.send(reg.request, src, end, last=last)
                assert chunk.ready()
                if chunk.bounced:
                    # One descriptor per chunk and rank, into the decode's bounce buffer.
                    assert chunk.descriptors == 1 and chunk.dst_addrs == [bounce.address]
                    bounced += 1
                copy_by_hand(chunk)
                chunk.posted(0.0)
                chunk.landed(0.0)
                status = chunk.poll()
                assert status is not None and status.ok and status.chunk == chunk.chunk
                if chunk.bounced:
                    bounce.scatter(chunk.sections, dst).synchronize()
                    sender.bounce_free(chunk.slot)
        assert sender.stats()["chunks"] == 9
    assert (bounced > 0) == (mode == "bounce")
    assert dst.snapshot_sync() == procs.reference(7)


def test_a_chunk_the_engine_never_reports_fails_at_its_transfer_timeout():
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    _, bases = kvshard.transfer.engine_memory(dst)
    pool, _keep = procs.prefill_pool(dev, 7, 0)
    sender = kvshard.transfer.MooncakeSender(pool, bases, procs.DECODE_PAGES, transfer_timeout=0.05)
    reg, src, chunks = procs.requests(7)[0]
    sender.open(reg)
    chunk = sender.send(reg.request, src, chunks[0][0], last=False)
    assert chunk.poll() is None
    time.sleep(0.1)
    with pytest.raises(kvshard.error.ChunkFailedError) as e:
        chunk.poll()
    assert e.value.status.request == reg.request and not e.value.status.ok
    with pytest.raises(kvshard.error.InvalidArgumentError):
        chunk.posted(-1.0)


def test_transfer_timeouts_past_the_clock_are_none_and_zero_is_refused():
    dev = kvshard.Device.cpu()
    dst = procs.decode_pool(dev)
    _, bases = kvshard.transfer.engine_memory(dst)
    pool, _keep = procs.prefill_pool(dev, 7, 0)
    # Old behaviour: an instant plus 10^18 s overflowed, a panic in the first send.
    sender = kvshard.transfer.MooncakeSender(pool, bases, procs.DECODE_PAGES, transfer_timeout=1e18)
    reg, src, chunks = procs.requests(7)[0]
    sender.open(reg)
    chunk = sender.send(reg.request, src, chunks[0][0], last=False)
    assert chunk.poll() is None
    chunk.landed(0.0)
    assert chunk.poll() is not None
    with pytest.raises(kvshard.error.InvalidArgumentError):
        kvshard.transfer.MooncakeSender(pool, bases, procs.DECODE_PAGES, transfer_timeout=0.0)


def dcp_case(dev, rng, layout, tokens, prefix_pages):
    """N = 2 prefill pools (procs' seeded bytes) on ``dev``, the request's logical pages, and per
    decode rank a poisoned pool on ``dev`` with its share's pages shuffled; the registration."""
    placement = kvshard.shard.Placement(procs.N)
    prefill = [procs.prefill_pool(dev, 7, r) for r in range(procs.N)]
    chain = kvshard.shard.RequestChain(placement)
    chain.grow_to(kvshard.shard.ShardAllocator(placement, procs.PREFILL_PAGES), tokens)
    decode, parts = [], []
    for d in range(layout.ranks):
        pool = procs.decode_pool(dev)
        pages = [int(p) for p in rng.permutation(range(1, procs.DECODE_PAGES))[: layout.pages_on(d, tokens)]]
        decode.append(pool)
        parts.append(kvshard.transfer.DecodeRank.of(pool, pages))
    reg = kvshard.transfer.DecodeRegistration(21, layout, tokens, parts, prefix_pages=prefix_pages)
    return prefill, chain.pages, decode, reg


def dcp_reference(layout, tokens, prefix_pages, ends):
    """Every decode rank's pool after the request is sent in one process (CPU)."""
    import numpy as np

    prefill, src, decode, reg = dcp_case(kvshard.Device.cpu(), np.random.default_rng(5), layout, tokens, prefix_pages)
    dsts = [kvshard.copy.RemoteSpace.of(p) for p in decode]
    for pool, _keep in prefill:
        sender = kvshard.transfer.Sender(pool)
        sender.open_decode(reg, dsts)
        for i, end in enumerate(ends):
            sender.send(reg.request, src, end, last=i == len(ends) - 1).wait_each_sync()
    return [p.snapshot_sync() for p in decode]


def test_mooncake_loopback_dcp_two_prefill_ranks_into_two_decode_ranks_match_the_reference():
    """Decode context parallelism over real Mooncake engines (TCP on the loopback, one engine
    per rank, all in this process): N = 2 prefill ranks into M = 2 decode ranks at I = 1, after
    a cached page, in two chunks; each chunk packed per decode rank into a slot of that rank's
    and written as one range to its engine, its status a dense frame the rank checks and
    unpacks. Every decode rank byte-identical to the in-process route; one descriptor per
    (chunk, prefill rank, decode rank reached); every slot freed."""
    import numpy as np

    mooncake_loads()
    from kvshard import mooncake

    dev = procs.device()
    layout = kvshard.shard.DecodeLayout.sglang(dcp_size=2)
    tokens, prefix_pages, ends = 700, 1, [300, 700]
    prefill, src, decode, reg = dcp_case(dev, np.random.default_rng(5), layout, tokens, prefix_pages)
    engines = []
    try:
        dec_engines = [mooncake.Engine() for _ in decode]
        pre_engines = [mooncake.Engine() for _ in prefill]
        engines = dec_engines + pre_engines
        receivers = []
        for pool, e in zip(decode, dec_engines):
            r = kvshard.mooncake.MooncakeReceiver(pool, procs.N, bounce_pages=16, bounce_slots=2)
            e.ensure(pool)
            for rank in range(procs.N):
                for b in r.bounce_regions(rank):
                    e.ensure(b)
            receivers.append(r)
        senders = []
        for rank, ((pool, _keep), e) in enumerate(zip(prefill, pre_engines)):
            hi = {"t": "hi", "rank": rank, "shape": kvshard.mooncake.side_shape(pool.geometry)}
            hellos = []
            for r, de in zip(receivers, dec_engines):
                joined, reply = r.join(hi, de.address)
                assert joined == rank
                hellos.append(kvshard.mooncake.SideReader().feed(reply)[0])
            h = hellos[0]
            s = kvshard.transfer.MooncakeSender(
                pool, h["bases"], h["pages"], mode=kvshard.transfer.MooncakeMode.BOUNCE, bounce_pages=16, decode_bounces=h["bounce"]
            )
            for d, h in enumerate(hellos[1:], 1):
                assert s.add_destination(h["bases"], h["pages"], decode_bounces=h["bounce"]) == d
            e.ensure(pool)
            for b in s.bounce_regions:
                e.ensure(b)
            senders.append(s)
        for d, r in enumerate(receivers):
            r.register_decode(reg, d)
        for s in senders:
            s.open_decode(reg, list(range(layout.ranks)))

        finished = [[] for _ in decode]

        def poll():
            for d, r in enumerate(receivers):
                finished[d] += r.poll()
                for rank, s in enumerate(senders):
                    for f in kvshard.mooncake.SideReader().feed(r.take_outgoing(rank)):
                        assert f["t"] == "free", f
                        s.bounce_free(f["slot"], request=f["request"], chunk=f["chunk"], destination=d)

        descriptors = 0
        for i, end in enumerate(ends):
            for rank, (s, e) in enumerate(zip(senders, pre_engines)):
                # Two slots per (prefill rank, decode rank): one per chunk, freed by the polls.
                due = time.monotonic() + 10
                chunk = s.send(reg.request, src, end, last=i == len(ends) - 1)
                while not chunk.ready():
                    assert time.monotonic() < due, "the packing never ran"
                t0 = time.perf_counter()
                for target, a, b, n in zip(chunk.targets, chunk.src_addrs, chunk.dst_addrs, chunk.lengths):
                    e.write_sync(dec_engines[target].address, [a], [b], [n])
                chunk.posted(0.0)
                chunk.landed(time.perf_counter() - t0)
                statuses = chunk.poll_each()
                assert statuses is not None and len(statuses) == layout.ranks
                reached = [d for d, st in enumerate(statuses) if st.ok and sum(st.bytes.values()) > 0]
                assert chunk.targets == reached, (chunk.targets, reached)
                descriptors += len(reached)
                for d, st in enumerate(statuses):
                    assert receivers[d].feed(rank, chunk.report_decode(d, st)) is None
                poll()
        due = time.monotonic() + 10
        while not all(finished):
            assert time.monotonic() < due, finished
            poll()
        for d, f in enumerate(finished):
            assert len(f) == 1 and f[0].completed, (d, f)
            c = receivers[d].counters()
            assert c["refused_frames"] == c["dropped_statuses"] == 0, c
            assert receivers[d].pending_requests == 0
        assert sum(s.stats()["descriptors"] for s in senders) == descriptors
        for s in senders:
            for d in range(layout.ranks):
                assert s.held_slots(reg.request, destination=d) == [], "every slot freed"
        assert descriptors == len(ends) * procs.N * layout.ranks, "every chunk reaches both ranks at I = 1"
        want = dcp_reference(layout, tokens, prefix_pages, ends)
        for d, pool in enumerate(decode):
            assert pool.snapshot_sync() == want[d], f"decode rank {d} differs from the in-process route"
    finally:
        for e in engines:
            e.close()
