"""SGLang 0.5.23's own modules as the oracle of the differential tests (test_sglang_*_cpu.py).

``sglang()`` imports what a test needs from SGLang or skips the test, saying why; with
``KVSHARD_REQUIRE_SGLANG=1`` (``.ci/run`` sets it) a missing SGLang fails the test instead.
``scripts/install-sglang.sh`` installs the pinned environment these tests run in.

``tally(test, cases, operations)`` counts what a differential test compared; the suite's
summary prints one line per test (conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

import importlib
import os
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest

SGLANG_VERSION = "0.5.23"

#: Per test: [cases, operations] compared against SGLang.
COUNTS: dict[str, list[int]] = defaultdict(lambda: [0, 0])


def required() -> bool:
    return os.environ.get("KVSHARD_REQUIRE_SGLANG", "") not in ("", "0")


def unavailable(reason: str) -> None:
    """Skips the calling test module (fails it when SGLang is required): for what the SGLang
    environment brings and a plain test venv lacks (hypothesis)."""
    if required():
        pytest.fail(f"KVSHARD_REQUIRE_SGLANG is set: {reason}", pytrace=False)
    pytest.skip(f"{reason}: scripts/install-sglang.sh installs it", allow_module_level=True)


def sglang(**modules: str) -> SimpleNamespace:
    """SGLang's modules by the names given (``placement="mem_cache.page_interleave"`` is
    ``sglang.srt.mem_cache.page_interleave`` as ``.placement``), or a skip (a failure when
    required) naming what did not import. The installed version must be the pinned one."""
    try:
        import sglang as sg

        version = getattr(sg, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("sglang")
        if version != SGLANG_VERSION:
            raise ImportError(f"sglang {version} is installed; these tests pin {SGLANG_VERSION}")
        with warnings.catch_warnings():
            # Its quantization modules warn that they need CUDA when imported on the CPU.
            warnings.simplefilter("ignore")
            out = {name: importlib.import_module(f"sglang.srt.{m}") for name, m in modules.items()}
    except ImportError as why:
        reason = (
            f"SGLang {SGLANG_VERSION} does not import ({why}): scripts/install-sglang.sh installs "
            "the environment these tests run SGLang's own objects in"
        )
        if required():
            pytest.fail(f"KVSHARD_REQUIRE_SGLANG is set: {reason}")
        pytest.skip(reason)
    return SimpleNamespace(**out)


def tally(test: str, cases: int = 0, operations: int = 0) -> None:
    """Adds to what ``test`` compared against SGLang."""
    COUNTS[test][0] += cases
    COUNTS[test][1] += operations


def sglang_function(module: str, qualname: str, **names):
    """SGLang's own function ``qualname`` (``"Class.method"`` or ``"function"``) of module
    ``module`` (under ``sglang.srt``), compiled from its source as installed, byte for byte, without
    importing the module: a few modules whose functions the tests compare (the scheduler's
    ``schedule_policy``, the Mooncake connector) import the whole server (OpenAI protocol types,
    Prometheus, the Mooncake engine), which these tests do not install. ``names`` are the
    module-level names the function uses."""
    import ast
    import importlib.util

    sglang()  # the pinned version, or a skip
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(spec.submodule_search_locations[0], "srt", *module.split(".")) + ".py"
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, path)
    scope: list = tree.body
    node = None
    for part in qualname.split("."):
        node = next(
            n for n in scope
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part
        )
        scope = node.body
    assert isinstance(node, ast.FunctionDef), qualname
    node.decorator_list = [d for d in node.decorator_list if not (isinstance(d, ast.Name) and d.id == "staticmethod")]
    code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec")
    namespace = {"__name__": f"sglang.srt.{module}", **names}
    exec(code, namespace)
    return namespace[node.name]
