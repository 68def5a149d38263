"""The processes of the Mooncake P/D tests (``test_mooncake_cpu.py``, and the GPU step
``run-gpu.sh mooncake``): a decode process and N prefill processes, each with its own
Mooncake engine, meeting over ``kvshard.mooncake``'s side channel, moving random requests chunk
by chunk. Both sides derive the requests and the prefill pools' bytes from the seed, so the
decode process can compute the in-process reference (the same requests sent by
``Sender`` in one process) and compare its pool with it byte for byte.

Run as ``python mooncake_procs.py ROLE DIR SEED [RANK]``: ROLE is ``decode``, ``prefill``, or
``prefill-die`` (rank 1 kills itself with SIGKILL in the middle of request ``DIES_IN``), or
``decode-die`` (the decode kills itself with SIGKILL once the first request has finished, the
others moving), or ``prefill-reconnect`` (once its decode is gone, the rank connects again, to
the decode of session 2, and sends every request again); DIR holds the decode's address
(``decode.addr``; ``decodeS.addr`` for session S) and each process's report
(``ROLE-RANK.json``). ``KVSHARD_MC_PACE`` spaces a prefill's chunks by that many seconds,
``KVSHARD_MC_TIMEOUT`` is its transfer timeout, ``KVSHARD_MC_CONNECT`` the address file it
reads (a fault-injecting proxy's, say). The decode's deadline is ``KVSHARD_MC_DEADLINE``, its
session ``KVSHARD_MC_SESSION`` (its address file and report are named for it). The mode is
``KVSHARD_MC_MODE`` (auto, coalesced, bounce), the device ``KVSHARD_MC_DEVICE`` (cpu, or a
CUDA ordinal).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import kvshard
from kvshard.copy import RemoteSpace
from kvshard.error import TransferError
from kvshard.geometry import CacheGeometry, Component, LatentLayout, PAGE_SIZE, PoolGeometry
from kvshard.pool import PoolLayout
from kvshard.shard import Placement
from kvshard.transfer import MooncakeMode, Registration, Sender
from kvshard import mooncake

N = 2
PREFILL_PAGES = 48
DECODE_PAGES = 128
#: Bounce buffers of 4 pages per section: the large request falls back to coalesced.
BOUNCE_PAGES = 4
DIES_IN = 2
POISON = 0xA5
#: The decode's loop bound: far below the receive deadline, so a failure that waited for a
#: deadline fails the test.
LOOP_BOUND = 40.0
DEADLINE = 120.0
PAGE = PAGE_SIZE


def geometry():
    return CacheGeometry(
        PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, False, True]), draft=True
    )


def device():
    d = os.environ.get("KVSHARD_MC_DEVICE", "cpu")
    return kvshard.Device.cpu() if d == "cpu" else kvshard.Device.cuda(int(d))


def mode():
    return {
        "auto": MooncakeMode.AUTO,
        "coalesced": MooncakeMode.COALESCED,
        "bounce": MooncakeMode.BOUNCE,
    }[os.environ.get("KVSHARD_MC_MODE", "auto")]


def requests(seed):
    """(registration, logical pages, chunk ends as (tokens, last)) of each request: several
    chunks, a cached prefix, a one-page request (a rank owns nothing: its empty final chunk),
    and one larger than a bounce buffer."""
    rng = np.random.default_rng(seed)
    logical = list(rng.permutation(np.arange(N, PREFILL_PAGES * N)))
    decode = list(rng.permutation(np.arange(1, DECODE_PAGES)))
    shapes = [
        (11, 0, [(3 * 64, False), (7 * 64 + 5, False), (11 * 64 - 30, True)]),
        (9, 0, [(2 * 64 + 1, False), (9 * 64, True)]),
        (6, 2, [(4 * 64, False), (6 * 64, True)]),
        (1, 0, [(40, True)]),
        (20, 0, [(20 * 64, True)]),
    ]
    layout = PoolLayout.packed(geometry(), DECODE_PAGES)
    out = []
    for i, (pages, prefix, chunks) in enumerate(shapes):
        src = [int(x) for x in logical[:pages]]
        del logical[:pages]
        state = [int(x) for x in decode[:pages]]
        del decode[:pages]
        kv = [int(x) for x in decode[: pages - prefix]]
        del decode[: pages - prefix]
        reg = Registration(i + 1, layout, kv, state, prefix)
        out.append((reg, src, chunks))
    return out


def engine_arrays(pages, fill=None, rng=None):
    """Per-component, per-layer arrays (SGLang-shaped), random or filled."""
    out = {}
    for c in geometry().components():
        shape = (pages * PAGE, 1, c.row_bytes) if c.rows > 1 else (pages, c.row_bytes)
        out[c.component] = [
            rng.integers(0, 256, size=shape, dtype=np.uint8) if rng is not None else np.full(shape, fill, np.uint8)
            for _ in range(c.layers)
        ]
    return out


def wrap(dev, placement, rank, pages, arrays):
    C = Component
    return kvshard.pool.DevicePool.wrap(
        dev,
        geometry(),
        placement,
        rank,
        pages,
        arrays[C.TARGET_LATENT],
        arrays.get(C.TARGET_INDEXER),
        arrays.get(C.DRAFT_LATENT),
        arrays.get(C.DRAFT_INDEXER),
    )


def prefill_pool(dev, seed, rank):
    """Rank ``rank``'s pool with its seeded random bytes (NumPy on the CPU; copied to the GPU
    through torch there)."""
    arrays = engine_arrays(PREFILL_PAGES, rng=np.random.default_rng([seed, rank]))
    if dev.kind == "cpu":
        return wrap(dev, Placement(N), rank, PREFILL_PAGES, arrays), arrays
    import torch

    tensors = {c: [torch.from_numpy(a).to(f"cuda:{dev.ordinal}") for a in v] for c, v in arrays.items()}
    torch.cuda.synchronize()
    return wrap(dev, Placement(N), rank, PREFILL_PAGES, tensors), tensors


def decode_pool(dev):
    # Registrable: an engine registers it by address (kvshard's stream-ordered pool memory cannot
    # be, over GPUDirect RDMA).
    pool = kvshard.pool.DevicePool.allocate(dev, geometry(), Placement(1), 0, DECODE_PAGES, registrable=True)
    pool.fill(POISON)
    # Before any engine writes into it: a fill still queued would overwrite what lands.
    dev.synchronize()
    return pool


def reference(seed):
    """The decode pool after every request is sent in one process (CPU)."""
    dev = kvshard.Device.cpu()
    dst = decode_pool(dev)
    remote = RemoteSpace.of(dst)
    for rank in range(N):
        pool, _keep = prefill_pool(dev, seed, rank)
        sender = Sender(pool)
        for reg, src, chunks in requests(seed):
            sender.open(reg, remote)
            for end, last in chunks:
                sender.send(reg.request, src, end, last=last).wait_sync()
    return dst.snapshot_sync()


def page_bytes(snapshot, page):
    """Page ``page`` of every layer of a decode pool snapshot (``DevicePool.snapshot``'s
    order: component by component, layer by layer, ``DECODE_PAGES`` blocks each)."""
    out = []
    at = 0
    for c in geometry().components():
        layer = DECODE_PAGES * c.block_bytes
        for lyr in range(c.layers):
            start = at + lyr * layer + page * c.block_bytes
            out.append(snapshot[start : start + c.block_bytes])
        at += c.layers * layer
    return b"".join(out)


def wrong_pages(snapshot, ref, registration):
    """Pages of ``registration`` whose bytes differ from the reference's."""
    pages = set(registration.pages) | set(registration.state_pages)
    return sum(page_bytes(snapshot, p) != page_bytes(ref, p) for p in pages)


def report(dir, name, data):
    tmp = Path(dir) / f"{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(Path(dir) / f"{name}.json")


def decode_main(dir, seed, die):
    dev = device()
    pool = decode_pool(dev)
    deadline = float(os.environ.get("KVSHARD_MC_DEADLINE", DEADLINE))
    session = os.environ.get("KVSHARD_MC_SESSION", "")
    dec = mooncake.MooncakeDecode(pool, N, bounce_pages=BOUNCE_PAGES, deadline=deadline)
    (Path(dir) / f"decode{session}.addr.tmp").write_text(json.dumps(list(dec.address)))
    (Path(dir) / f"decode{session}.addr.tmp").rename(Path(dir) / f"decode{session}.addr")
    dec.accept_sync()
    reqs = requests(seed)
    for reg, _, _ in reqs:
        dec.register(reg)
    results = {}
    overdue = []
    gone_at = {}
    start = time.monotonic()
    while len(results) < len(reqs):
        if time.monotonic() - start > LOOP_BOUND:
            break
        finished, late = dec.poll()
        if die and finished:
            # Mid-transfer: the first request is done, the others are moving.
            report(dir, "killed-0", {"at": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        for f in finished:
            results[f.request] = {
                "completed": f.completed,
                "failures": f.failures,
                "pages_back": len(f.registration.pages) + len(f.registration.state_pages),
                "at": time.time(),
            }
        overdue += [o.request for o in late]
        for rank, why in dec.gone.items():
            gone_at.setdefault(rank, time.time())
        time.sleep(0.0005)
    snap = dec.pool.snapshot_sync()
    ref = reference(seed)
    for reg, _, _ in reqs:
        r = results.get(reg.request)
        if r is not None and r["completed"]:
            r["wrong_pages"] = wrong_pages(snap, ref, reg)
    report(
        dir,
        f"decode{session}-0",
        {
            "results": results,
            "overdue": overdue,
            "pending": dec.pending_requests,
            "identical": snap == ref,
            "gone_at": gone_at,
            "busy_slots": [dec.receiver.busy_slots(r) for r in range(N)],
            "counters": dec.counters(),
        },
    )
    dec.close()


def prefill_main(dir, seed, rank, die, reconnect=False):
    dev = device()
    pool, _keep = prefill_pool(dev, seed, rank)
    prefill_session(dir, seed, rank, die, pool, os.environ.get("KVSHARD_MC_CONNECT", "decode.addr"), "prefill")
    if reconnect:
        # The decode of session 1 is gone; the same rank serves the decode of session 2.
        prefill_session(dir, seed, rank, False, pool, "decode2.addr", "prefill2")


def prefill_session(dir, seed, rank, die, pool, addr_name, name):
    addr_file = Path(dir) / addr_name
    end = time.monotonic() + 60
    while not addr_file.exists():
        if time.monotonic() > end:
            raise TimeoutError("no decode address")
        time.sleep(0.01)
    host, port = json.loads(addr_file.read_text())
    timeout = float(os.environ.get("KVSHARD_MC_TIMEOUT", "20"))
    # Seconds between chunks: keeps transfers going while the decode dies (decode-die tests).
    pace = float(os.environ.get("KVSHARD_MC_PACE", "0"))
    pre = mooncake.MooncakePrefill(
        pool, (host, port), mode=mode(), bounce_pages=BOUNCE_PAGES, transfer_timeout=timeout
    )
    statuses = []
    errors = []
    reqs = requests(seed)
    registered = {}
    start = time.monotonic()
    for reg, src, chunks in reqs:
        while reg.request not in registered:
            for r in pre.take_registrations():
                registered[r.request] = r
            statuses += [s.ok for s in pre.progress()]
            if pre.gone and reg.request not in registered:
                break
            time.sleep(0.0005)
        if reg.request not in registered:
            errors.append(f"request {reg.request}: never registered ({pre.gone})")
            continue
        for i, (end, last) in enumerate(chunks):
            if die and rank == 1 and reg.request == DIES_IN and i == 1:
                report(dir, f"killed-{rank}", {"at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                pre.send(reg.request, src, end, last=last)
            except TransferError as e:
                errors.append(f"{type(e).__name__}: {e}")
                break
            statuses += [s.ok for s in pre.progress()]
            time.sleep(pace)
    while pre.in_flight:
        statuses += [s.ok for s in pre.progress()]
        time.sleep(0.0005)
    report(
        dir,
        f"{name}-{rank}",
        {
            "statuses": statuses,
            "errors": errors,
            "seconds": time.monotonic() - start,
            "stats": pre.stats(),
            "gone": pre.gone,
            "at": time.time(),
        },
    )
    # Stay until the decode has read everything (it closes first), answering its aborts and
    # taking its frees meanwhile.
    end = time.monotonic() + 30
    while not pre.gone and time.monotonic() < end:
        pre.progress()
        time.sleep(0.01)
    # Every failed chunk's slot is freed once the engine is done with it.
    end = time.monotonic() + 10
    while pre.sender.bounce_slots_free < pre.sender.bounce_slots and time.monotonic() < end:
        pre.progress()
        time.sleep(0.01)
    pre.close()
    report(
        dir,
        f"{name}-{rank}-closed",
        {
            "slots_free": pre.sender.bounce_slots_free,
            "slots": pre.sender.bounce_slots,
            "in_flight": pre.in_flight,
            "refused": pre.refused,
        },
    )


if __name__ == "__main__":
    role, dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role.startswith("decode"):
        decode_main(dir, seed, role == "decode-die")
    else:
        prefill_main(dir, seed, int(sys.argv[4]), role == "prefill-die", role == "prefill-reconnect")
