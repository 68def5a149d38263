"""The package's namespace (docs/python.md, "The namespace"): the top level is exactly the small
set the docs list, every submodule's ``__all__`` resolves, every public name of the extension and
every exception has exactly one home (one name per thing), each class says that home in its
``__module__``, and kvshard 0.1's flat names resolve to the same objects with a warning."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvshard
from kvshard import _errors, _kvshard, mooncake

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
# The submodules the top level imports, and those imported on their own (they need SGLang's or
# Mooncake's objects, or are what an engine's config names).
CORE = ["backend", "copy", "error", "geometry", "hicache", "pool", "shard", "storage", "transfer"]
OWN = ["mooncake", "sglang", "sglang.adapter", "sglang.pd", "sglang_storage"]


def documented():
    """The docs' namespace table: each name its first column lists under ``kvshard.``, with the
    plain names (no call, path or attribute) its second column gives."""
    text = DOC.read_text()
    section = text.split("## The namespace", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `kvshard\.(\w+)` \|(.*)\|$", section, re.MULTILINE)
    return {name: set(re.findall(r"`(\w+)`", what)) for name, what in rows}


def documented_top_level():
    return list(documented())


def test_the_top_level_is_exactly_the_documented_set():
    documented = documented_top_level()
    assert documented, "docs/python.md has no namespace table"
    assert sorted(documented) == sorted(kvshard.__all__)
    # In a fresh interpreter (this one's tests import kvshard.sglang and others on their own).
    names = subprocess.run(
        [sys.executable, "-c", "import kvshard; print(' '.join(n for n in dir(kvshard) if not n.startswith('_')))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(names) == sorted(kvshard.__all__)
    assert sorted(set(kvshard.__all__) - set(CORE)) == ["Device", "KvshardError", "host_waits"]
    assert kvshard.__version__ == "0.1.0"


@pytest.mark.parametrize("name", CORE)
def test_the_docs_list_each_submodule_exactly(name):
    listed = documented()[name]
    exported = set(getattr(kvshard, name).__all__)
    if name == "storage" and not hasattr(kvshard.storage, "DiskStore"):  # a build without `nixl`
        listed -= {"DiskStore", "DiskStats", "LoadOutcome", "Snapshot", "StoreReport"}
    # The table may name the base class a submodule's classes derive from.
    assert listed - {"KvshardError"} == exported, f"docs/python.md's row for kvshard.{name}"


@pytest.mark.parametrize("name", CORE + OWN)
def test_every_submodule_all_resolves(name):
    module = __import__(f"kvshard.{name}", fromlist=["__all__"])
    assert module.__all__, f"kvshard.{name} exports nothing"
    assert len(set(module.__all__)) == len(module.__all__), f"kvshard.{name} lists a name twice"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"kvshard.{name}.__all__ names what it does not have: {missing}"


def homes():
    """Each exported name with every module that exports it (the top level as ``kvshard``)."""
    found = {}
    for module in [kvshard, mooncake] + [getattr(kvshard, name) for name in CORE]:
        for name in module.__all__:
            if module is not kvshard or name not in CORE:
                found.setdefault(name, []).append(module.__name__)
    return found


def test_every_public_name_has_exactly_one_home():
    found = homes()
    twice = {name: where for name, where in found.items() if len(where) > 1}
    assert not twice, f"names exported from two places: {twice}"
    public = {n for n in _kvshard.__all__ if not n.startswith("_")} | set(_errors.__all__)
    assert public - set(found) == set(), "a public name of the extension or an exception has no home"


def test_each_class_names_its_home():
    for name, (home,) in homes().items():
        module = sys.modules[home]
        value = getattr(module, name)
        if isinstance(value, type) and home != "kvshard.mooncake":
            assert value.__module__ == home, f"{name}.__module__ is {value.__module__}, not {home}"
    assert repr(kvshard.pool.DevicePool) == "<class 'kvshard.pool.DevicePool'>"


def test_the_flat_names_of_0_1_are_the_same_objects_with_a_warning():
    for name, (home,) in homes().items():
        if home == "kvshard" or name not in _kvshard.__all__ and name not in _errors.__all__:
            continue
        with pytest.warns(DeprecationWarning, match=rf"kvshard\.{name} is {re.escape(home)}\.{name}"):
            flat = getattr(kvshard, name)
        assert flat is getattr(sys.modules[home], name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'Engine'"):
            kvshard.Engine  # kvshard.mooncake's own, never a flat name
        with pytest.raises(AttributeError, match="no attribute '_rust_send_ns'"):
            kvshard._rust_send_ns
