"""Bounce mode's post time against its transfer time over Mooncake's engine: one decode and N
prefill ranks (``--n``) in this process, each with its own engine, DRAM pools (``--device cpu``)
or VRAM (``--device 0``), one request of ``--pages`` pages (into scattered decode pages) sent as
one final chunk, ``--iters`` times per mode after a warm-up. Prints a Markdown row per (mode, N,
pages): descriptors per chunk and rank, the mean post time per rank (kvshard's planning and
packing launch plus the engine's post; on the CPU twin the launch runs the copy), the engine's
post alone, the slowest rank's transfer time (from ``send`` to the engine reporting its batches
complete), their ratios and GB/s. Needs ``mooncake.engine``.

    python -P python/mooncake_bench.py --n 1,2,8 --pages 64,512,4096
"""

import argparse
import random
import threading
import time

import kvshard
from kvshard import mooncake


def run(device, n, pages, iters, mode):
    """(descriptors per chunk of rank 0, mean post s per rank, mean engine post s per rank,
    transfer s of the slowest rank, bytes of all ranks) per request."""
    g = kvshard.CacheGeometry(kvshard.PoolGeometry(kvshard.LatentLayout.FP8_TRTLLM, 2), draft=False)
    decode_pool = kvshard.DevicePool.allocate(device, g, kvshard.Placement(1), 0, pages + 1)
    # Logical pages n .. n + pages - 1 (0 .. n - 1 are reserved): rank r owns those = r mod n.
    local = pages // n + 2
    pools = [kvshard.DevicePool.allocate(device, g, kvshard.Placement(n), r, local) for r in range(n)]
    for p in pools:
        p.fill(0x5A)
    device.synchronize()
    share = -(-pages // n)
    dec = mooncake.MooncakeDecode(decode_pool, n, bounce_pages=share)
    t = threading.Thread(target=dec.accept_sync)
    t.start()
    pres = [
        mooncake.MooncakePrefill(p, dec.address, mode=mode, bounce_pages=share, bounce_below=1 << 40) for p in pools
    ]
    t.join()
    layout = kvshard.PoolLayout.packed(g, pages + 1)
    logical = list(range(n, n + pages))
    for i in range(iters + 1):
        if i == 1:  # the first iteration warms the connections up
            base = [(p.stats(), p.engine_post_seconds) for p in pres]
        # The decode's pages scattered, as an engine's allocator hands them out (a sharded
        # rank's sit N apart): no two neighbours coalesce.
        dst = random.Random(i).sample(range(1, pages + 1), pages)
        reg = kvshard.Registration(i + 1, layout, dst, dst)
        dec.register(reg)
        for p in pres:
            while not p.take_registrations():
                time.sleep(0.0001)
        descriptors = [p.send(reg.request, logical, pages * kvshard.PAGE_SIZE, last=True).descriptors for p in pres]
        done = False
        while not done:
            for p in pres:
                p.progress()
            finished, _ = dec.poll()
            done = bool(finished)
            if finished:
                assert finished[0].completed, finished[0].failures
    post, engine, transfer, nbytes = [], [], [], 0.0
    for p, (s0, e0) in zip(pres, base):
        s = p.stats()
        post.append((s["post_seconds"] - s0["post_seconds"]) / iters)
        engine.append((p.engine_post_seconds - e0) / iters)
        transfer.append((s["transfer_seconds"] - s0["transfer_seconds"]) / iters)
        nbytes += (s["bytes"] - s0["bytes"]) / iters
        p.close()
    dec.close()
    return descriptors[0], sum(post) / n, sum(engine) / n, max(transfer), nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="512", help="comma-separated page counts")
    ap.add_argument("--n", default="1", help="comma-separated prefill rank counts")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    device = kvshard.Device.cpu() if a.device == "cpu" else kvshard.Device.cuda(int(a.device))
    print(
        "| mode | N | pages | descriptors/chunk/rank | MB/request | post ms (mean/rank) | engine post ms "
        "| transfer ms (max rank) | post/transfer | engine post/transfer | GB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in a.n.split(",")]:
        for pages in [int(p) for p in a.pages.split(",")]:
            for name, mode in [("bounce", kvshard.MooncakeMode.BOUNCE), ("coalesced", kvshard.MooncakeMode.COALESCED)]:
                d, post, engine, transfer, nbytes = run(device, n, pages, a.iters, mode)
                print(
                    f"| {name} | {n} | {pages} | {d} | {nbytes / 1e6:.1f} | {post * 1e3:.3f} | {engine * 1e3:.3f} | "
                    f"{transfer * 1e3:.2f} | {100 * post / transfer:.1f}% | {100 * engine / transfer:.1f}% | "
                    f"{nbytes / transfer / 1e9:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
