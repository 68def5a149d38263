"""The hand-written stub (``kvshard/_kvshard.pyi``) against the built extension, with
``mypy.stubtest``: a class, method, parameter, default or name the two disagree on fails here
(mypy also type-checks the package's Python modules against the stub on the way). And the
extension's Rust modules import only modules below them, so they form no circle."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvshard

# Bottom-up: each module of python/src may import only modules before it (lib.rs, on top,
# declares them all).
MODULE_ORDER = [
    "errors",
    "lock",
    "tensor",
    "device",
    "frees",
    "host_waits",
    "geometry",
    "shard",
    "method",
    "pool_tensors",
    "device_pool",
    "chunk_staging",
    "owned_row_write",
    "budget",
    "batch_plans",
    "capacity",
    # Below transfer, which sends into decode context-parallel registrations.
    "dcp",
    "transfer",
    # The decode side's receiver of the statuses transfer's senders report.
    "receiver",
    # Above the P/D transfer's RemoteSpace: the page copy lands pages in one.
    "page_copy",
    "hicache_enums",
    "host_pool",
    # Above the host pools: Mooncake registers them (engine_regions).
    "mooncake_prefill",
    # The Mooncake side channel's frames and decode side (its addresses from
    # `mooncake_prefill`).
    "side_channel",
    "layer_signals",
    "host_transfer",
    "hicache_controller",
    "chain",
    "storage_keys",
    "disk_store",
    "bench",
]
SRC = Path(__file__).resolve().parents[1] / "src"
# The extension's classes that exist only in a build with the `nixl` feature.
STORAGE_TIER = ["DiskStats", "DiskStore", "LoadOutcome", "Snapshot", "StoreReport"]


def test_the_stub_matches_the_extension(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy): the stub is not checked")
    # From an empty directory, so the installed package is both the stub and the runtime
    # checked (not the source tree), and no project config file applies.
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "cache"))
    args = [sys.executable, "-m", "mypy.stubtest", "kvshard"]
    if not hasattr(kvshard._kvshard, "DiskStore"):
        # A wheel built without the `nixl` feature has no storage tier: the stub's classes of
        # it are allowed to be missing (CI builds with it, so there they are checked).
        allow = tmp_path / "no-nixl.allowlist"
        names = [f"kvshard._kvshard.{n}" for n in STORAGE_TIER]
        allow.write_text("\n".join(names + ["kvshard.storage.__all__", "kvshard._kvshard.__all__"]) + "\n")
        args += ["--allowlist", str(allow)]
    run = subprocess.run(
        args,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"stubtest found mismatches:\n{run.stdout}\n{run.stderr}"
    assert Path(kvshard._kvshard.__file__).parent == Path(kvshard.__file__).parent


def imports_of(path):
    """The modules of this crate `path` names (`crate::x`, or `crate::{x, y}` groups)."""
    text = path.read_text()
    names = set(re.findall(r"\bcrate::(\w+)", text))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
        names.update(re.findall(r"(?:^|,)\s*(\w+)", group))
    return names - {"self"}


def test_the_extension_modules_import_downward_only():
    if not SRC.is_dir():
        pytest.skip(f"the extension's sources are not next to the tests ({SRC})")
    files = {p.stem for p in SRC.glob("*.rs")} - {"lib"}
    assert files == set(MODULE_ORDER), "a module was added or removed: place it in MODULE_ORDER"
    for i, module in enumerate(MODULE_ORDER):
        above = set(imports_of(SRC / f"{module}.rs")) - set(MODULE_ORDER[:i])
        assert not above, f"{module}.rs imports {sorted(above)}, not below it in {MODULE_ORDER}"
