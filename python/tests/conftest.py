"""Shared fixtures: geometries, engine-style NumPy KV tensors, random non-zero bytes.

The CPU backend runs in adversarial stream order here, as in the Rust suites: work runs only
when something waits for it, and every host wait runs the other streams first or last by a
seeded coin, so a missing wait fails here rather than sometimes on a GPU."""

import os

os.environ.setdefault("KVSHARD_CPU_STREAMS", "adversarial")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvshard  # noqa: E402
from kvshard.geometry import (  # noqa: E402
    CacheGeometry,
    Component,
    LatentLayout,
    PAGE_SIZE,
    PoolGeometry,
)

PAGE = PAGE_SIZE


def geometries():
    """A shared-indexer layer with the MTP draft (four components), and a target-only one."""
    return [
        CacheGeometry(
            PoolGeometry(LatentLayout.FP8_TRTLLM, indexer_layers=[True, True, False, True]),
            draft=True,
        ),
        CacheGeometry(PoolGeometry(LatentLayout.FP8_SCALED, 2)),
    ]


@pytest.fixture(params=[0, 1], ids=["draft-shared-indexer", "target-only-scaled"])
def geometry(request):
    return geometries()[request.param]


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % (1 << 32))


def nonzero(rng, shape):
    """Random bytes with no zero (so a missed copy never looks right)."""
    return rng.integers(1, 256, size=shape, dtype=np.uint8)


def engine_tensors(geometry, pages, fill=0):
    """The engine's per-layer KV arrays, SGLang-shaped: latent `[pages*64, 1, row]`, indexer
    `[pages, 8448]`."""
    out = {}
    for c in geometry.components():
        if c.rows > 1:
            shape = (pages * PAGE, 1, c.row_bytes)
        else:
            shape = (pages, c.row_bytes)
        out[c.component] = [np.full(shape, fill, np.uint8) for _ in range(c.layers)]
    return out


def wrap(device, geometry, placement, rank, pages, tensors):
    C = Component
    return kvshard.pool.DevicePool.wrap(
        device,
        geometry,
        placement,
        rank,
        pages,
        tensors[C.TARGET_LATENT],
        tensors.get(C.TARGET_INDEXER),
        tensors.get(C.DRAFT_LATENT),
        tensors.get(C.DRAFT_INDEXER),
    )


def page_bytes(tensors, local_page):
    """One page of every component and layer of engine tensors, in kvshard's canonical order
    (component, layer): what `DevicePool.read_pages_sync` returns."""
    parts = []
    for c in sorted(tensors, key=lambda c: int(c)):
        for t in tensors[c]:
            if t.ndim == 3:
                parts.append(t[local_page * PAGE : (local_page + 1) * PAGE].tobytes())
            else:
                parts.append(t[local_page].tobytes())
    return b"".join(parts)


# The differential tests against SGLang (sglang_oracle.py) count their cases and operations; the
# summary says how many each compared.
def pytest_terminal_summary(terminalreporter):
    import sys

    oracle = sys.modules.get("sglang_oracle")
    if oracle is None or not oracle.COUNTS:
        return
    terminalreporter.section("compared against SGLang's own objects")
    total = [0, 0]
    for test, (cases, operations) in sorted(oracle.COUNTS.items()):
        terminalreporter.write_line(f"differential: {test}: {cases} cases, {operations} operations")
        total[0] += cases
        total[1] += operations
    terminalreporter.write_line(f"differential: all: {total[0]} cases, {total[1]} operations")
