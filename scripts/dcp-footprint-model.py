#!/usr/bin/env python3
# The footprint model of BENCHMARKS.md's dcp section: how many 2 MB pages of memory the units of
# one kvs_decode_scatter launch that are in flight at once touch, over the whole GPU and on one
# SM, for the benchmark's requests (DeepSeek-V3.2: 62 latent layers of 576-byte rows, a unit
# a whole page in the pages kernel (I a multiple of 64) and four 16-row slices a page in the
# rows kernel (whole pages before e7bd51f: --whole-pages), 62 indexer layers of 132-byte rows
# a whole page a unit; 512 pages
# from prefill rank 0 of N, into M decode ranks at interleave I) and for each way of handing the
# units to the grid (264 CTAs of 8 warps, two an SM, a unit a warp, unless named):
#   queue      the kernel as it is: every warp takes the next unit, so the 2,112 in flight are
#              consecutive and each SM's 16 are spread over them;
#   runs R     a CTA takes R consecutive units at once: 264 runs in flight, an SM's two runs;
#   runs R+    the same, each CTA's next run taken at the middle of the one before (the runs
#              being moved are spread over twice the window; an SM's are still two);
#   static     a contiguous block of the launch per CTA: an SM's two blocks' current units,
#              the grid's 264 positions spread over the whole launch;
#   queue 8w   the queue on one CTA an SM (132 CTAs, 1,056 units in flight: the grid of a
#              kernel keeping twice the vectors a lane in flight, the same bytes);
#   side by side (--side-by-side) the N prefill ranks' launches at once, each on 1/N of the
#              grid (66 CTAs at N = 4), at the same place in their launches: the GPU's units
#              in flight are each rank's 2,112 / N;
#   blocks B   (--blocks B[,B...]) the queue over another unit order: B of the rank's source
#              pages at a time through every layer (latent, then indexer) before the next B
#              (B = 56 is one 2 MB page of a source region).
# It counts, averaged over windows across the launch, the distinct (region, 2 MB page) pairs of
# the source and destination bytes those units move, each (pool, component, layer) a region of
# its own starting on a 2 MB boundary (the pools' layers are whole regions, allocated 2 MB
# aligned). A model, not a measurement. On the H200 (2026-12-05, BENCHMARKS.md) the changes that
# grow the GPU's count lost in its order while shrinking an SM's: an SM's translation does not
# bind (A/B by scripts/stage-ab.sh, docs/gpu.md).
# Usage: scripts/dcp-footprint-model.py [--pages P] [--queue-only] [--whole-pages] [--side-by-side]
#   [--blocks B[,B]] [N,M,I ...]
#   (default: 512 pages, every schedule, the matrix at I = 1 and 64)
import random
import sys

ROWS, SLICE_ROWS = 64, 16
LATENT_ROW, INDEXER_KEY, INDEXER_SCALE = 576, 128, 4
LATENT_PAGE, INDEXER_PAGE = ROWS * LATENT_ROW, ROWS * (INDEXER_KEY + INDEXER_SCALE)
LAYERS = 62
PAGES = 512
SMS, CTAS, WARPS = 132, 264, 8
MB2 = 21
WHOLE_PAGES = False


def spans(start, length):
    """The 2 MB pages of the bytes [start, start + length)."""
    return range(start >> MB2, (start + length - 1 >> MB2) + 1)


def slice_rows(i):
    """Rows of a latent unit: a whole page for the pages kernel (I a multiple of a page) and,
    with --whole-pages, for the rows kernel before its slices (e7bd51f); else a slice."""
    return ROWS if i % ROWS == 0 or WHOLE_PAGES else SLICE_ROWS


def unit_pages(unit, n, m, i):
    """The (region, 2 MB page) pairs a unit reads and writes (its prefill rank: j % N)."""
    kind, layer, j, s = unit
    local = j // n + 1  # the bench's prefill rank: sequence page j at local page j / N + 1
    out = set()
    if kind == "latent":
        span = slice_rows(i)
        rows = range(s * span, (s + 1) * span)
        out.update(("src", j % n, kind, layer, p) for p in spans(local * LATENT_PAGE + rows[0] * LATENT_ROW, span * LATENT_ROW))
    else:
        rows = range(ROWS)
        out.update(("src", j % n, kind, layer, p) for p in spans(local * INDEXER_PAGE, INDEXER_PAGE))
    for row in rows:
        t = j * ROWS + row
        rank = (t // i) % m
        at = (t // (i * m)) * i + t % i  # the token's row on its decode rank
        page, slot = divmod(at, ROWS)
        if kind == "latent":
            offsets = [page * LATENT_PAGE + slot * LATENT_ROW]
        else:
            offsets = [page * INDEXER_PAGE + slot * INDEXER_KEY, page * INDEXER_PAGE + ROWS * INDEXER_KEY + slot * INDEXER_SCALE]
        for o in offsets:
            out.add(("dst", rank, kind, layer, o >> MB2))
    return out


def launch_units(n, i, rank=0):
    """A prefill rank's units in queue order: pair (latent layers, then indexer), page, slice."""
    mine = list(range(rank, PAGES, n))
    units = [("latent", k, j, s) for k in range(LAYERS) for j in mine for s in range(ROWS // slice_rows(i))]
    units += [("indexer", k, j, None) for k in range(LAYERS) for j in mine]
    return units


def block_units(n, i, block):
    """The same units, `block` of the rank's source pages at a time through every layer."""
    local = {j: k for k, j in enumerate(range(0, PAGES, n))}
    return sorted(launch_units(n, i), key=lambda u: (local[u[2]] // block, u[0] != "latent", u[1], u[2], u[3] or 0))


def footprint(n, m, i, schedule, windows=12, seed=7):
    """(GPU-wide, per-SM) distinct 2 MB pages of the units in flight, averaged over windows."""
    rnd = random.Random(seed)
    ctas = SMS if schedule == "queue 8w" else CTAS
    if i % ROWS == 0 and (schedule == "static" or schedule.startswith("runs")):
        # The runs and the per-CTA blocks change the rows kernel only: the pages kernel keeps
        # the queue.
        schedule = "queue"
    if schedule.startswith("blocks"):
        units = block_units(n, i, int(schedule.split()[1]))
        schedule = "queue"
    elif schedule == "side by side":
        # Every rank's k-th unit next to the others': a window of the queue over this order is
        # each rank's window of 1/N the size at the same place in its launch.
        units = [u for group in zip(*(launch_units(n, i, r) for r in range(n))) for u in group]
        schedule = "queue"
    else:
        units = launch_units(n, i)
    cache = {}

    def pages(u):
        if u not in cache:
            cache[u] = unit_pages(units[u], n, m, i)
        return cache[u]

    total = len(units)
    gpu, sm = [], []
    for w in range(windows):
        if schedule == "static":
            block = -(-total // ctas)
            offset = int((w + 0.5) / windows * block)
            held = [[b * block + offset + k for k in range(WARPS) if offset + k < block and b * block + offset + k < total] for b in range(ctas)]
        else:
            if schedule.startswith("queue"):
                size, run = ctas * WARPS, 1
            else:
                run = int(schedule.split()[1].rstrip("+"))
                size = ctas * run * (2 if schedule.endswith("+") else 1)
            start = int((w + 0.5) / windows * max(total - size, 1))
            window = list(range(start, min(start + size, total)))
            if schedule.startswith("queue"):
                rnd.shuffle(window)
                held = [window[c * WARPS:(c + 1) * WARPS] for c in range(ctas)]
            else:
                # With a spare run taken ahead, the runs being moved are half of a window twice
                # as long; the spares are touched only once installed.
                runs = [window[r * run:(r + 1) * run] for r in range(len(window) // run)]
                rnd.shuffle(runs)
                held = (runs + [[]] * ctas)[:ctas]
        everything = set()
        for c in range(ctas):
            for u in held[c]:
                everything |= pages(u)
        gpu.append(len(everything))
        per_sm = []
        for s in range(SMS):
            mine = set()
            for c in range(s, ctas, SMS):
                for u in held[c]:
                    mine |= pages(u)
            per_sm.append(len(mine))
        sm.append(sum(per_sm) / SMS)
    return sum(gpu) / windows, sum(sm) / windows


def main():
    global PAGES, WHOLE_PAGES
    args = sys.argv[1:]
    if "--whole-pages" in args:
        args.remove("--whole-pages")
        WHOLE_PAGES = True
    schedules = ["queue", "runs 16", "runs 32", "runs 64", "runs 32+", "static", "queue 8w"]
    if "--queue-only" in args:
        args.remove("--queue-only")
        schedules = ["queue"]
    if "--side-by-side" in args:
        args.remove("--side-by-side")
        schedules.append("side by side")
    if "--blocks" in args:
        at = args.index("--blocks")
        schedules += [f"blocks {b}" for b in args[at + 1].split(",")]
        del args[at:at + 2]
    if "--pages" in args:
        at = args.index("--pages")
        PAGES = int(args[at + 1])
        del args[at:at + 2]
    cases = [tuple(int(x) for x in a.split(",")) for a in args] or [
        (n, m, i) for i in (1, 64) for n in (2, 4) for m in (2, 4)
    ]
    print("| N, M, I | " + " | ".join(f"{s}: GPU / SM" for s in schedules) + " |")
    print("|---|" + "---:|" * len(schedules))
    for n, m, i in cases:
        cells = [footprint(n, m, i, s) for s in schedules]
        print(f"| {n}, {m}, {i} | " + " | ".join(f"{g:.0f} / {s:.1f}" for g, s in cells) + " |")


if __name__ == "__main__":
    main()
