"""Bounce mode's post time against its transfer time over Mooncake's engine: one decode and one
prefill (N = 1) in this process, each with its own engine, DRAM pools (``--device cpu``) or
VRAM (``--device 0``), one request of ``--pages`` pages (into scattered decode pages) sent as
one final chunk, ``--iters``
times per mode. Prints, per mode, descriptors per chunk, the mean post time (kvshard's planning
and packing launch plus the engine's post; on the CPU twin the launch runs the copy), the engine's
post alone, and transfer time (from ``send`` to the engine
reporting the batch complete), and their ratio. Needs ``mooncake.engine``.

    python -P python/mooncake_bench.py --pages 64,512,4096
"""

import argparse
import random
import threading
import time

import kvshard
from kvshard import mooncake


def run(device, pages, iters, mode):
    g = kvshard.CacheGeometry(kvshard.PoolGeometry(kvshard.LatentLayout.FP8_TRTLLM, 2), draft=False)
    decode_pool = kvshard.DevicePool.allocate(device, g, kvshard.Placement(1), 0, pages + 1)
    prefill_pool = kvshard.DevicePool.allocate(device, g, kvshard.Placement(1), 0, pages + 1)
    prefill_pool.fill(0x5A)
    device.synchronize()
    dec = mooncake.MooncakeDecode(decode_pool, 1, bounce_pages=pages)
    t = threading.Thread(target=dec.accept_sync)
    t.start()
    pre = mooncake.MooncakePrefill(prefill_pool, dec.address, mode=mode, bounce_pages=pages, bounce_below=1 << 40)
    t.join()
    layout = kvshard.PoolLayout.packed(g, pages + 1)
    for i in range(iters + 1):
        if i == 1:
            base = pre.stats()  # the first iteration warms the connection up
            engine0 = pre.engine_post_seconds
        # The decode's pages scattered, as an engine's allocator hands them out (a sharded rank's
        # sit N apart): no two neighbours coalesce.
        dst = random.Random(i).sample(range(1, pages + 1), pages)
        reg = kvshard.Registration(i + 1, layout, dst, dst)
        dec.register(reg)
        while not pre.take_registrations():
            time.sleep(0.0001)
        chunk = pre.send(reg.request, list(range(1, pages + 1)), pages * kvshard.PAGE_SIZE, last=True)
        descriptors = chunk.descriptors
        done = False
        while not done:
            pre.progress()
            finished, _ = dec.poll()
            done = bool(finished)
            if finished:
                assert finished[0].completed, finished[0].failures
    s = pre.stats()
    post = (s["post_seconds"] - base["post_seconds"]) / iters
    transfer = (s["transfer_seconds"] - base["transfer_seconds"]) / iters
    nbytes = (s["bytes"] - base["bytes"]) / iters
    engine = (pre.engine_post_seconds - engine0) / iters
    pre.close()
    dec.close()
    return descriptors, post, engine, transfer, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="512", help="comma-separated page counts")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    device = kvshard.Device.cpu() if a.device == "cpu" else kvshard.Device.cuda(int(a.device))
    print("| mode | pages | descriptors/chunk | MB/chunk | post ms (kvshard + engine) | engine post ms | transfer ms | post/transfer | engine post/transfer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pages in [int(p) for p in a.pages.split(",")]:
        for name, mode in [("bounce", kvshard.MooncakeMode.BOUNCE), ("coalesced", kvshard.MooncakeMode.COALESCED)]:
            d, post, engine, transfer, nbytes = run(device, pages, a.iters, mode)
            print(
                f"| {name} | {pages} | {d} | {nbytes / 1e6:.1f} | {post * 1e3:.3f} | {engine * 1e3:.3f} | "
                f"{transfer * 1e3:.2f} | {100 * post / transfer:.2f}% | {100 * engine / transfer:.2f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
