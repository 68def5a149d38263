#!/usr/bin/env python3
"""What the Python binding costs, measured against the Rust path in the same process and run.

Per call (host time of the call itself, the GPU work waited for outside the timed call):
  - a 16-page signalled load (``HostTransfer.run_signalled``: one launch, a ready counter per
    layer) and a 16-page ``HiCacheController.load`` (planning, table upload, the launch);
  - one P/D chunk (``Sender.send`` of a 16-page final chunk).
Rust runs the same calls on the same objects in native loops (``kvshard._kvshard._rust_*``);
the added cost is the difference of the medians (target: at most 3 us) and of the p99s (at most
20 us); every row reports p50, p99 and p10-p90 of both.

Bulk (wall time of back-to-back transfers, waited for): 512-page HiCache backups and loads
(copy engine and SM kernel) and 512-page P/D chunks, through Python and through Rust (target:
Python within 2% of Rust).

    python bench.py [--iters 2000] [--rounds 3] [--cpu] [--out DIR]

On the GPU it uses the DeepSeek-V3.2 geometry (61 layers + the MTP draft); ``--cpu`` is a dry
run of every path on the CPU backend with a small geometry (the figures mean nothing there).
Writes ``bench-python.md`` and ``bench-python.json`` to ``--out`` (default: $OUT, else .).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import kvshard
from kvshard.backend import Stream, embedded_archs
from kvshard.copy import Direction, Method, RemoteSpace
from kvshard.geometry import CacheGeometry, LatentLayout, PoolGeometry
from kvshard.hicache import CacheNode, LayerSignals, Route, TransferPlan
from kvshard.pool import DevicePool, HostLayout, HostPool, PoolLayout
from kvshard.shard import Placement
from kvshard.transfer import Registration
from kvshard import _kvshard as native

NS = 1e-3  # ns -> us
_NONE = object()  # py_signalled's "pass None as the stream"


# Goal 6 of issue 25: what Python adds per call, at the median and at p99.
ADDED_MEDIAN_GOAL_US = 3.0
ADDED_P99_GOAL_US = 20.0


def quantile(sorted_values, f):
    """The nearest-rank f-quantile of sorted values (f in [0, 1])."""
    return sorted_values[min(len(sorted_values) - 1, int(f * len(sorted_values)))]


def stats(ns):
    s = sorted(ns)
    q = lambda f: quantile(s, f) * NS
    return {
        "median_us": statistics.median(s) * NS,
        "p10_us": q(0.1),
        "p90_us": q(0.9),
        "p99_us": q(0.99),
        "n": len(s),
    }


def time_calls(fn, iters, after=None):
    out = []
    for i in range(iters):
        t0 = time.perf_counter_ns()
        r = fn()
        out.append(time.perf_counter_ns() - t0)
        if after is not None:
            after(i, r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating Rust/Python rounds")
    ap.add_argument("--bulk-iters", type=int, default=8)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU backend")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    if args.cpu:
        device = kvshard.Device.cpu()
        geometry = CacheGeometry(PoolGeometry(LatentLayout.FP8_TRTLLM, 4), draft=True)
        pages, bulk = 80, 64
    else:
        device = kvshard.Device.cuda(0)
        geometry = CacheGeometry.deepseek_v32()
        pages, bulk = 600, 512
    torch = sys.modules.get("torch")
    if torch is None and not args.cpu:
        try:
            import torch  # noqa: F401  (optional: a torch stream as the stream argument)
        except ImportError:
            torch = None

    placement = Placement(1)
    pool = DevicePool.allocate(device, geometry, placement, 0, pages)
    pool.fill(0x5A)
    host = HostPool(device, geometry, pages, HostLayout.PAGE_FIRST_DIRECT, sglang=True, packed_draft=True)
    host.fill(0xA5)
    stream = device.new_stream()
    device.synchronize()
    results = {"per_call": {}, "bulk": {}}

    def compare(name, rust, python, iters=args.iters):
        r_all, p_all = [], []
        for _ in range(args.rounds):
            r_all += rust(iters)
            p_all += python(iters)
        r, p = stats(r_all), stats(p_all)
        added, added_p99 = p["median_us"] - r["median_us"], p["p99_us"] - r["p99_us"]
        results["per_call"][name] = {
            "rust": r,
            "python": p,
            "added_us": added,
            "added_p99_us": added_p99,
            "median_goal_met": added <= ADDED_MEDIAN_GOAL_US,
            "p99_goal_met": added_p99 <= ADDED_P99_GOAL_US,
        }
        print(
            f"{name:48s} rust {r['median_us']:8.2f} us (p99 {r['p99_us']:8.2f})  python {p['median_us']:8.2f} us "
            f"(p99 {p['p99_us']:8.2f})  added {added:+6.2f} us (p99 {added_p99:+7.2f})",
            flush=True,
        )

    # 1. A 16-page signalled load, prepared once (the enqueue path alone).
    small = list(range(1, 17))
    plan = TransferPlan(placement, 0, small, small, pages, pages)
    load = kvshard.hicache.HostTransfer(pool, host, plan, Direction.LOAD)
    load.prepare_kernel_sync()
    signals = LayerSignals(device, geometry.model_layers)

    def py_signalled(n, s=stream, arg=None):
        # The stream the work goes on is synchronized every 64 calls, outside the timed call, as
        # in the Rust loop (synchronizing another stream let the launch queue fill and block).
        def sync_every(i, _r):
            if i % 64 == 63:
                s.synchronize()

        a = s if arg is None else (None if arg is _NONE else arg)
        out = time_calls(lambda: load.run_signalled(signals, a, ctas=2), n, sync_every)
        s.synchronize()
        return out

    compare(
        "signalled load, 16 pages (Stream)",
        lambda n: native._rust_run_signalled_ns(load, signals, stream, n, 2),
        py_signalled,
    )
    if torch is not None and not args.cpu:
        ts = torch.cuda.Stream()
        device.stream(ts)  # the one-time wrap, outside the timed calls
        compare(
            "signalled load, 16 pages (torch.cuda.Stream)",
            lambda n: native._rust_run_signalled_ns(load, signals, ts, n, 2),
            lambda n: py_signalled(n, ts),
        )
        # None: torch's current stream, asked from torch per call.
        with torch.cuda.stream(ts):
            compare(
                "signalled load, 16 pages (None: torch's current)",
                lambda n: native._rust_run_signalled_ns(load, signals, torch.cuda.current_stream(), n, 2),
                lambda n: py_signalled(n, ts, arg=_NONE),
            )
        torch.cuda.synchronize()

    # 2. A 16-page controller load: plan, kernel tables, one signalled launch.
    ctl = kvshard.hicache.HiCacheController(pool, host)
    node = CacheNode(1, small)
    ctl.backup(node, stream, Route.COPY_ENGINE)
    ctl.ack_backups_sync(1)
    ack = lambda _i, _h: ctl.ack_loads_sync(1)
    compare(
        "HiCacheController.load, 16 pages, kernel",
        lambda n: native._rust_load_ns(ctl, 1, small, Route.KERNEL, n, 2),
        lambda n: time_calls(lambda: ctl.load(1, small, None, Route.KERNEL), n, ack),
        iters=max(args.iters // 4, 50),
    )

    # 3. One P/D chunk: a 16-page final chunk into a decode pool on the same device.
    decode = DevicePool.allocate(device, geometry, placement, 0, pages)
    dst = RemoteSpace.of(decode)
    reg = Registration(1, PoolLayout.of(decode), small, small)
    sender = kvshard.transfer.Sender(pool, stream)

    def py_send(n):
        out = []
        for _ in range(n):
            sender.open(reg, dst)
            t0 = time.perf_counter_ns()
            p = sender.send(1, small, 16 * 64, last=True)
            out.append(time.perf_counter_ns() - t0)
            p.wait_sync()
        return out

    compare(
        "P/D chunk, 16 pages (Sender.send)",
        lambda n: native._rust_send_ns(sender, reg, dst, small, 16 * 64, n),
        py_send,
    )

    # 4. Bulk: 512-page transfers, Python vs Rust, wall time.
    big = list(range(1, bulk + 1))
    bplan = TransferPlan(placement, 0, big, big, pages, pages)
    # Labelled by name, as in BENCHMARKS.md.
    for direction, way in [("backup", Direction.BACKUP), ("load", Direction.LOAD)]:
        t = kvshard.hicache.HostTransfer(pool, host, bplan, way)
        t.prepare_kernel_sync()
        for name, io in [("copy_engine", Method.COPY_ENGINE), ("kernel", Method.KERNEL)]:
            nbytes = t.bytes() * args.bulk_iters

            def py_bulk():
                t.run(stream, io)
                stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.bulk_iters):
                    t.run(stream, io)
                stream.synchronize()
                return time.perf_counter() - t0

            rs = [native._rust_bulk_seconds(t, stream, io, args.bulk_iters, 2) for _ in range(args.rounds)]
            ps = [py_bulk() for _ in range(args.rounds)]
            rec(results, f"HiCache {direction} {bulk} pages, {name}", nbytes, rs, ps)
    breg = Registration(1, PoolLayout.of(decode), big, big)

    def py_bulk_send(first):
        t0 = time.perf_counter()
        pend = []
        for i in range(args.bulk_iters):
            r = Registration(first + i, PoolLayout.of(decode), big, big)
            sender.open(r, dst)
            pend.append(sender.send(first + i, big, bulk * 64, last=True))
        for p in pend:
            p.wait_sync()
        return time.perf_counter() - t0

    chunk_bytes = bulk * geometry.page_bytes
    rs, ps = [], []
    for k in range(args.rounds):
        rs.append(native._rust_bulk_send_seconds(sender, breg, dst, big, bulk * 64, args.bulk_iters, 1000 + 100 * k))
        ps.append(py_bulk_send(5000 + 100 * k))
    rec(results, f"P/D {bulk}-page chunk", chunk_bytes * args.bulk_iters, rs, ps)

    results["device"] = repr(device)
    results["geometry"] = repr(geometry)
    results["python"] = platform.python_version()
    results["kvshard"] = kvshard.__version__
    results["archs"] = embedded_archs()
    write(args.out, results)


def rec(results, name, nbytes, rust_s, python_s):
    r, p = statistics.median(rust_s), statistics.median(python_s)
    results["bulk"][name] = {
        "bytes": nbytes,
        "rust_gbps": nbytes / r / 1e9,
        "python_gbps": nbytes / p / 1e9,
        "python_over_rust": r / p,
    }
    print(f"{name:48s} rust {nbytes / r / 1e9:8.2f} GB/s  python {nbytes / p / 1e9:8.2f} GB/s  ratio {r / p:6.3f}", flush=True)


def write(out, results):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench-python.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = [
        f"Python binding vs Rust, same process ({results['device']}, {results['geometry']}, Python {results['python']})",
        "",
        f"Added = Python - Rust at the same quantile; goals (issue 25): median <= {ADDED_MEDIAN_GOAL_US:g} us, "
        f"p99 <= {ADDED_P99_GOAL_US:g} us.",
        "",
        "| per call | Rust p50 / p99 (p10-p90) | Python p50 / p99 (p10-p90) | added p50 | added p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    verdict = lambda met: "within" if met else "**over**"
    for name, v in results["per_call"].items():
        r, p = v["rust"], v["python"]
        lines.append(
            f"| {name} | {r['median_us']:.2f} / {r['p99_us']:.2f} us ({r['p10_us']:.2f}-{r['p90_us']:.2f}) | "
            f"{p['median_us']:.2f} / {p['p99_us']:.2f} us ({p['p10_us']:.2f}-{p['p90_us']:.2f}) | "
            f"**{v['added_us']:+.2f} us** ({verdict(v['median_goal_met'])} {ADDED_MEDIAN_GOAL_US:g}) | "
            f"**{v['added_p99_us']:+.2f} us** ({verdict(v['p99_goal_met'])} {ADDED_P99_GOAL_US:g}) |"
        )
    lines += ["", "| bulk (wall time, waited) | Rust | Python | Python / Rust |", "|---|---:|---:|---:|"]
    for name, v in results["bulk"].items():
        lines.append(
            f"| {name} | {v['rust_gbps']:.1f} GB/s | {v['python_gbps']:.1f} GB/s | **{v['python_over_rust']:.3f}** |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "bench-python.md"), "w") as f:
        f.write(text)
    print()
    print(text)


if __name__ == "__main__":
    main()
